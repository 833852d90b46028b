"""Pure routing and permutation functions of expert parallelism, against brute-force references.

No processes: the all-to-all is simulated by moving row blocks between lists.
"""

from __future__ import annotations

import torch

from fivefold.model.moe import Experts, combine_slots, scatter_rows
from fivefold.parallel.expert_parallel import dispatch_order, rank_splits, regroup_by_local_expert, unpermute
from fivefold.rules.volumes import FP32, all_to_all_wire_bytes


def _random_routing(gen: torch.Generator, slots: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, experts, (slots,), generator=gen)
    keep = torch.rand(slots, generator=gen) < 0.8
    return ids, keep


def test_dispatch_order_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        E = int(torch.randint(1, 9, (1,), generator=gen))
        ids, keep = _random_routing(gen, int(torch.randint(0, 40, (1,), generator=gen)), E)
        order, counts = dispatch_order(ids, keep, E)
        expected = [s for e in range(E) for s in range(len(ids)) if keep[s] and ids[s] == e]
        assert order.tolist() == expected, trial
        assert counts.tolist() == [sum(1 for s in expected if ids[s] == e) for e in range(E)]


def test_rank_splits_sum_blocks_of_experts():
    counts = torch.tensor([1, 2, 0, 4, 5, 0, 7, 1])
    assert rank_splits(counts.tolist(), 2) == [7, 13]
    assert rank_splits(counts.tolist(), 4) == [3, 4, 5, 8]
    assert rank_splits(counts.tolist(), 8) == counts.tolist()


def test_simulated_all_to_all_round_trip():
    """Route, send, regroup by local expert, 'compute', return and un-permute on every rank;
    each slot must come back with its own expert's result for its own token."""
    gen = torch.Generator().manual_seed(1)
    for ep, E, k in [(2, 8, 2), (4, 8, 1), (8, 8, 2), (3, 6, 3)]:
        local = E // ep
        N = [int(torch.randint(0, 12, (1,), generator=gen)) for _ in range(ep)]
        tokens = [torch.randn(n, 4, generator=gen) for n in N]
        routing = [_random_routing(gen, n * k, E) for n in N]
        plans = [dispatch_order(ids, keep, E) for ids, keep in routing]
        sent = [x[order // k] for x, (order, _) in zip(tokens, plans)]  # (S_kept, h)
        splits = [rank_splits(counts.tolist(), ep) for _, counts in plans]
        blocks = [list(rows.split(s)) for rows, s in zip(sent, splits)]
        results_back: list[list[torch.Tensor]] = [[None] * ep for _ in range(ep)]  # type: ignore[list-item]
        for dst in range(ep):
            recv_counts = torch.stack([plans[src][1].view(ep, local)[dst] for src in range(ep)])  # (ep, local)
            received = torch.cat([blocks[src][dst] for src in range(ep)])
            order, per_expert = regroup_by_local_expert(recv_counts, recv_counts.tolist())
            grouped = received[order]
            expert_of_row = torch.repeat_interleave(torch.arange(local), torch.tensor(per_expert))
            computed = grouped * 10.0 + (dst * local + expert_of_row)[:, None]  # 'expert e' adds e
            back = unpermute(computed, order).split(recv_counts.sum(dim=1).tolist())
            for src in range(ep):
                results_back[src][dst] = back[src]
        for r in range(ep):
            order = plans[r][0]
            slots = torch.zeros(N[r] * k, 4).index_copy(0, order, torch.cat(results_back[r]))
            ids, keep = routing[r]
            token_of_slot = torch.arange(N[r] * k) // k
            expected = (tokens[r][token_of_slot] * 10.0 + ids[:, None].float()) * keep[:, None]
            assert torch.equal(slots, expected), (ep, E, k, r)


def test_regroup_is_stable_per_expert():
    recv = torch.tensor([[2, 1], [0, 3]])  # source 0: 2 rows for e0, 1 for e1; source 1: 3 for e1
    order, per_expert = regroup_by_local_expert(recv, recv.tolist())
    assert per_expert == [2, 4]
    assert order.tolist() == [0, 1, 2, 3, 4, 5]
    recv = torch.tensor([[1, 2], [2, 0]])  # rows: s0e0, s0e1, s0e1, s1e0, s1e0
    order, per_expert = regroup_by_local_expert(recv, recv.tolist())
    assert order.tolist() == [0, 3, 4, 1, 2] and per_expert == [3, 2]


def test_unpermute_undoes_a_gather():
    gen = torch.Generator().manual_seed(2)
    for n in (0, 1, 7, 30):
        perm = torch.randperm(n, generator=gen)
        values = torch.randn(n, 3, generator=gen)
        assert torch.equal(unpermute(values[perm], perm), values)


def test_analytic_all_to_all_bytes():
    sent = torch.tensor([[3, 1, 2, 0], [0, 4, 1, 1]])  # ep=2, E=4: rank 0 owns experts 0,1
    # rank 0 sends 2 rows to rank 1 and receives 0 + 4 = 4 rows from rank 1
    assert all_to_all_wire_bytes(sent, 0, hidden=8, eb=FP32, calls=3) == 2 * (2 + 4) * 32 + 3 * 2 * 8
    assert all_to_all_wire_bytes(sent, 1, hidden=8, eb=FP32, calls=3) == 2 * (4 + 2) * 32 + 3 * 2 * 8


def test_expert_kernels_agree():
    gen = torch.Generator().manual_seed(4)
    experts = Experts(4, 16, 32)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    x = torch.randn(13, 16, generator=gen)
    counts = [5, 0, 6, 2]
    outputs = {}
    for kernel in ("loop", "grouped", "padded"):
        experts.kernel = kernel
        outputs[kernel] = experts(x, counts)
    assert torch.equal(outputs["grouped"], outputs["loop"])  # same per-group GEMMs
    torch.testing.assert_close(outputs["padded"], outputs["loop"], rtol=1e-6, atol=1e-6)


def _seeded_experts(kernel: str) -> tuple[Experts, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    experts = Experts(4, 16, 32, kernel=kernel)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return experts, torch.randn(13, 16, generator=gen)


def test_grouped_kernel_runs_under_bf16_autocast_cast_at_the_experts(monkeypatch):
    """Under bf16 autocast "auto" takes the grouped kernel (it used to fall back to the
    per-expert loop): its inputs are cast to bf16 as autocast casts the loop's matmuls, so the
    output is bf16 and agrees with the loop's; the fp32 master weights get fp32 gradients."""
    counts = [5, 0, 6, 2]
    grouped_calls = []
    grouped_mm = torch._grouped_mm

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        grouped_calls.append(args[0].dtype)
        return grouped_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counted)
    runs = {}
    for kernel in ("auto", "loop"):
        experts, x = _seeded_experts(kernel)
        x.requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = experts(x, counts)
        out.float().square().sum().backward()
        runs[kernel] = (out, x.grad, experts.gate.grad)
    (out, x_grad, gate_grad), (loop_out, loop_x_grad, loop_gate_grad) = runs["auto"], runs["loop"]
    assert grouped_calls == [torch.bfloat16] * 3  # the auto run's three matmuls, in bf16
    assert out.dtype == torch.bfloat16 and gate_grad.dtype == torch.float32 and x_grad.dtype == torch.float32
    # bf16 products with fp32 accumulation in both kernels; they differ by the kernels' order of sums
    torch.testing.assert_close(out, loop_out, rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(gate_grad, loop_gate_grad, rtol=2**-6, atol=1e-3)
    torch.testing.assert_close(x_grad, loop_x_grad, rtol=2**-6, atol=1e-3)


def test_grouped_kernel_is_chosen_by_device_dtype_and_alignment():
    from fivefold.model.moe import grouped_mm_supported

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    shape = torch.Size((8, 64, 32))
    assert grouped_mm_supported(cpu, torch.float32, shape) and grouped_mm_supported(cpu, torch.bfloat16, shape)
    assert grouped_mm_supported(cuda, torch.bfloat16, shape) and not grouped_mm_supported(cuda, torch.float32, shape)
    assert not grouped_mm_supported(cpu, torch.bfloat16, torch.Size((8, 64, 36)))  # rows of 72 bytes
    assert not grouped_mm_supported(torch.device("meta"), torch.float32, shape)


def test_combine_slots_weights_and_sums_the_kept_slots():
    """Against the dense formula: scatter the kept rows into all N*k slots (zeros where dropped),
    weight every slot, sum over the k choices. With k <= 2 the two agree bit for bit (a sum of
    two terms does not depend on their order); with more choices to rounding."""
    gen = torch.Generator().manual_seed(5)
    for k in (1, 2, 3):
        for dtype in (torch.float32, torch.bfloat16):
            N, E, h = 23, 6, 8
            ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])  # distinct per token
            keep = torch.rand(N, k, generator=gen) < 0.7
            weights = torch.rand(N, k, generator=gen)
            order = dispatch_order(ids.reshape(-1), keep.reshape(-1), E)[0]
            rows = torch.randn(order.numel(), h, generator=gen).to(dtype)
            slots = torch.zeros(N * k, h, dtype=dtype).index_copy(0, order, rows).view(N, k, h)
            dense = (slots * (weights * keep).to(dtype)[..., None]).sum(dim=1)
            combined = combine_slots(rows, order, order // k, weights)
            if k <= 2:
                assert torch.equal(combined, dense), (k, dtype)
            else:
                torch.testing.assert_close(combined, dense)


def test_scatter_rows_matches_index_add_and_keeps_only_the_index():
    gen = torch.Generator().manual_seed(6)
    rows = torch.randn(9, 4, generator=gen, requires_grad=True)
    for accumulate, index, num_rows in [(True, torch.tensor([3, 0, 3, 5, 1, 0, 2, 2, 4]), 7),
                                        (False, torch.randperm(9, generator=gen), 9)]:
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = scatter_rows(rows, index, num_rows, accumulate)
        assert [t.data_ptr() for t in saved] == [index.data_ptr()]  # not the rows
        reference = (torch.zeros(num_rows, 4).index_add(0, index, rows) if accumulate
                     else torch.empty(num_rows, 4).index_copy(0, index, rows))
        assert torch.equal(out, reference)
        grad = torch.randn(num_rows, 4, generator=gen)
        (ours,) = torch.autograd.grad(out, rows, grad)
        (theirs,) = torch.autograd.grad(reference, rows, grad)
        assert torch.equal(ours, theirs)

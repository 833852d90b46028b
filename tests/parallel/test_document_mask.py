"""Document masking: attention stays inside packed documents, positions restart, in every layout."""

from __future__ import annotations

import json
import random

import pytest
import torch

from fivefold.config import load_config
from fivefold.config import Layout
from fivefold.model.attention import (
    AttentionCore,
    document_causal_attention,
    document_causal_mask,
    grouped_query_attention,
    positions_in_documents,
)
from fivefold.parallel.context_parallel import (
    CORES,
    _ring_block,
    saved_activation_bytes,
    block_forward,
    block_forward_reference,
    local_positions,
)
from fivefold.tools.parity import with_layout
from helpers import many_layout_parity


def _documents_jsonl(path, count: int, seed: int) -> None:
    """Documents of 2..60 characters: most sequences of 32 tokens hold several, some span two."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    with open(path, "w") as f:
        for _ in range(count):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 10)))
            f.write(json.dumps({"text": text}) + "\n")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from fivefold.data.prepare import prepare

    root = tmp_path_factory.mktemp("docmask")
    _documents_jsonl(root / "docs.jsonl", 400, seed=1)
    prepare([str(root / "docs.jsonl")], root / "prepared", workers=1)
    return str(root / "prepared")


@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    """Documents of exactly 8 tokens (7 letters + EOS): each zigzag segment of cp=2 is one document."""
    from fivefold.data.prepare import prepare

    root = tmp_path_factory.mktemp("aligned")
    rng = random.Random(2)
    lines = [json.dumps({"text": "".join(rng.choice("abcdefgh") for _ in range(7))}) for _ in range(200)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    prepare([str(root / "docs.jsonl")], root / "prepared", workers=1)
    return str(root / "prepared")


def _config(prepared: str, preset: str = "tiny"):
    return load_config(preset, [f"data.source={prepared}", "data.document_mask=true", "train.seq_len=32"])


def test_positions_restart_at_each_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 6, 6]])
    assert positions_in_documents(docs).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]]
    pos = torch.arange(8)
    mask = document_causal_mask(docs, docs, pos, pos)[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False]


def test_masked_fused_block_equals_reference_and_fully_masked_queries_merge_as_nothing():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    mask = torch.rand(2, 1, 6, 5) > 0.5
    mask[:, :, 2] = False  # a query that sees no key of this block
    out, lse = block_forward(q, k, v, False, mask)
    ref_out, ref_lse = block_forward_reference(q, k, v, False, mask)
    assert torch.isneginf(lse[:, :, 2]).all() and (out[:, :, 2] == 0).all()
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


def test_ring_skips_blocks_wholly_in_other_documents():
    cp, seq = 2, 16
    one_document_per_segment = torch.arange(seq).div(seq // (2 * cp), rounding_mode="floor")[None]  # (1, 16)
    skipped = [_ring_block(one_document_per_segment, (r - s) % cp, r, cp, seq // cp)[4] for r in range(cp) for s in range(cp)]
    assert skipped == [False, True, False, True]  # own blocks computed, every other block skipped
    whole = torch.zeros(1, seq, dtype=torch.long)
    assert not any(_ring_block(whole, (r - s) % cp, r, cp, seq // cp)[4] for r in range(cp) for s in range(cp))
    assert local_positions("ring", cp, 0, seq).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


def _ragged_documents(B: int, T: int, seed: int) -> torch.Tensor:
    """(B, T) document ids: documents of 1..T/2 tokens, so some cross any segment boundary."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T // 2 + 1, (B, T), generator=gen)
    return torch.stack([torch.repeat_interleave(torch.arange(T), row)[:T] for row in lengths])


def _masked_reference(q, k, v, documents, query_start: int):
    """The materialising oracle: SDPA with the boolean (B, 1, Tq, Tk) same-document causal mask."""
    q_pos = torch.arange(query_start, query_start + q.shape[2])
    k_pos = torch.arange(k.shape[2])
    return grouped_query_attention(q, k, v, document_causal_mask(documents[:, q_pos], documents, q_pos, k_pos))


@pytest.mark.parametrize("dtype, bound", [(torch.float64, 1e-12), (torch.float32, 4e-6)])
@pytest.mark.parametrize("query_start, Tq", [(0, 48), (0, 17), (13, 20), (24, 24)])
def test_document_attention_equals_the_masked_reference(dtype, bound, query_start, Tq):
    """Per-document causal kernels (no mask) against the masked oracle: output and the three
    gradients, GQA (8 query heads on 2 K/V heads), queries starting inside a document
    (all-gather context parallel), one-token documents and a sequence of one document."""
    gen = torch.Generator().manual_seed(Tq + query_start)
    B, Hq, Hkv, T, d = 3, 8, 2, 48, 8
    documents = _ragged_documents(B, T, seed=1)
    documents[0, :7] = torch.arange(-7, 0)  # one-token documents
    documents[1] = 0  # one document: the plain causal case
    q = torch.randn(B, Hq, Tq, d, generator=gen, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, Hkv, T, d, generator=gen, dtype=dtype, requires_grad=True) for _ in range(2))
    grad = torch.randn(B, Hq, Tq, d, generator=gen, dtype=dtype)
    out = document_causal_attention(q, k, v, documents, query_start)
    ref = _masked_reference(q, k, v, documents, query_start)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert (a - b).abs().max().item() < bound, name


def _document_core_saved_bytes(T: int, core: torch.nn.Module | None = None) -> int:
    """Bytes the single-process core saves for backward, documents of T/4 tokens."""
    B, Hq, Hkv, d = 1, 4, 2, 8
    documents = torch.arange(T).div(T // 4, rounding_mode="floor")[None]
    q = torch.randn(B, Hq, T, d, requires_grad=True)
    k, v = (torch.randn(B, Hkv, T, d, requires_grad=True) for _ in range(2))
    core = core or AttentionCore()
    return saved_activation_bytes(lambda: core(q, k, v, documents))


class _MaskedCore(AttentionCore):
    def forward(self, q, k, v, documents=None):  # type: ignore[override]
        return _masked_reference(q, k, v, documents, 0)


def test_document_attention_saves_linear_in_sequence_length():
    """Doubling the sequence (same four documents, twice as long) doubles what the core saves
    for backward: no tensor of T x T elements, as the masked path keeps (its mask)."""
    saved = [_document_core_saved_bytes(T) for T in (256, 512)]
    assert saved[1] == 2 * saved[0], saved
    masked = [_document_core_saved_bytes(T, _MaskedCore()) for T in (256, 512)]
    assert masked[1] > 3 * masked[0], masked  # the oracle is quadratic: the test can tell


def _cores_with_documents(ctx, cases):
    """Each cp core on this rank's segment with packed documents (float64) against the masked
    oracle on the whole sequence: largest error of output and gradients per case."""
    results = []
    for algorithm, cp, Hq, Hkv, T in cases:
        mesh = ctx.mesh(Layout(cp=cp, dp=ctx.world_size // cp))
        gen = torch.Generator().manual_seed(T + Hq)
        B, d = 2, 8
        documents = _ragged_documents(B, T, seed=T)
        q, k, v, grad = (torch.randn(B, h, T, d, generator=gen, dtype=torch.float64) for h in (Hq, Hkv, Hkv, Hq))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        ref = _masked_reference(q, k, v, documents, 0)
        ref.backward(grad)
        pos = local_positions(algorithm, cp, mesh.cp.rank, T)
        local = [t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
        out = CORES[algorithm](mesh.cp)(*local, documents)
        out.backward(grad[:, :, pos])
        errors = [(out - ref[:, :, pos]).abs().max().item()]
        errors += [(t.grad - full.grad[:, :, pos]).abs().max().item() for t, full in zip(local, (q, k, v))]
        results.append(max(errors))
    return results


def test_every_cp_core_with_documents_equals_the_masked_reference(pools):
    """ring, allgather and ulysses at cp=2, GQA head counts (8 on 2, 4 on 1), ragged documents."""
    cases = [(a, 2, Hq, Hkv, 24) for a in CORES for Hq, Hkv in ((8, 2), (4, 1))]
    for rank_errors in pools.run(2, _cores_with_documents, cases):
        for case, error in zip(cases, rank_errors):
            assert error < 1e-12, (case, error)


def test_attention_does_not_cross_documents(prepared):
    """Changing one document's tokens leaves the logits of every other document unchanged."""
    from fivefold.model import build_model
    from fivefold.data.loader import open_training_data

    config = _config(prepared)
    _, sampler = open_training_data(config)
    inputs, _, documents = sampler.local_rows_at(0, 0, 1)
    model = build_model(config.model, seed=0)
    positions = positions_in_documents(documents)
    row = int(torch.nonzero(documents[:, 0] != documents[:, -1])[0])  # a sequence holding several documents
    first = documents[row] == documents[row, 0]
    changed = inputs.clone()
    changed[row, first] = (changed[row, first] + 7) % 256
    with torch.no_grad():
        a, _ = model(inputs, positions, documents)
        b, _ = model(changed, positions, documents)
        unmasked, _ = model(changed, positions)
    assert torch.equal(a[row, ~first], b[row, ~first])  # bitwise: no path from the first document
    assert not torch.allclose(a[row, first], b[row, first])
    assert not torch.allclose(unmasked[row, ~first], b[row, ~first])  # without the mask it would leak


def test_document_mask_parity_in_every_layout(pools, reference, prepared, aligned):
    from fivefold.data.loader import open_training_data

    dense, moe = _config(prepared), _config(prepared, "tiny-moe")
    _, sampler = open_training_data(_config(aligned))
    documents = sampler.local_rows_at(0, 0, 1)[2]
    assert _ring_block(documents, 1, 0, 2, 16)[4]  # the aligned data makes the ring skip blocks
    configs = [
        with_layout(dense, cp=2, cp_algorithm="ring"),
        with_layout(_config(aligned), cp=2, cp_algorithm="ring"),
        with_layout(dense, cp=2, cp_algorithm="allgather"),
        with_layout(dense, cp=2, cp_algorithm="ulysses"),
        with_layout(dense, tp=2, sequence_parallel=True),
        with_layout(dense, pp=2, grad_accum=2),
        with_layout(moe, dp=2, ep=2),
    ]
    many_layout_parity(pools, reference, configs, steps=2)

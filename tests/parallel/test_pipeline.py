"""Pipeline parallelism: stage split, executor parity with the single process, memory, timeline."""

from __future__ import annotations

import functools
import importlib.util
import json
import types

import pytest
import torch

from fivefold.config import load_config
from fivefold.rules.layout import LayoutError, validate
from fivefold.parallel.pipeline import (
    WeightGradDeferral,
    apply_deferred_weight_grads,
    balanced_counts,
    forward_only,
    layer_cost,
    release_storage,
    stage_layer_ids,
)
from fivefold.rules.layout import SCHEDULES
from fivefold.rules.schedules import build_schedule, placement_of, simulate
from fivefold.observe.timeline import Event, bubble_formula, bubble_fraction, chrome_trace, draw_gantt
from fivefold.tools.parity import assert_parity
from helpers import layout_parity, trace_on_rank


def _config(preset: str = "tiny", **layout) -> object:
    return load_config(preset, [f"layout.{k}={v}" for k, v in layout.items()])


# --------------------------------------------------------------------------- pure logic


def test_balanced_split_puts_fewer_layers_next_to_a_costly_head():
    assert balanced_counts([1.0] * 8, 4) == [2, 2, 2, 2]
    assert balanced_counts([1.0] * 8, 2, last_extra=2.0) == [5, 3]
    assert balanced_counts([1.0] * 4, 4, last_extra=9.0) == [1, 1, 1, 1]  # at least one layer each
    assert balanced_counts([3.0, 1.0, 1.0, 1.0], 2) == [1, 3]


def test_stage_layers_cover_the_model_in_order():
    config = validate(_config(pp=2))
    assert stage_layer_ids(config) == [[0, 1], [2, 3]]
    config = validate(_config("small", pp=2, vpp=2, pp_schedule="interleaved", grad_accum=4))
    ids = stage_layer_ids(config)
    assert [i for stage in ids for i in stage] == list(range(8)) and len(ids) == 4
    config = validate(_config(pp=2, pp_layers="3,1"))
    assert stage_layer_ids(config) == [[0, 1, 2], [3]]
    moe = load_config("tiny-moe").model
    assert layer_cost(moe, 0, 32) > layer_cost(load_config("tiny").model, 0, 32)


@pytest.mark.parametrize("name", SCHEDULES)
def test_forward_only_tables_run_without_deadlock(name):
    for pp, m in [(2, 4), (4, 8), (4, 1)]:
        vpp = 2 if name in ("interleaved", "dualpipev") else 1
        if (name == "interleaved" and m % pp) or (name == "dualpipev" and m < 2 * pp - 1):
            continue
        table = [forward_only(row) for row in build_schedule(name, pp, m, vpp)]
        result = simulate(table, pp, placement=placement_of(name))
        assert all(len(t) == m * vpp for t in result.timelines)


@pytest.mark.parametrize("name", ("gpipe", "1f1b", "interleaved", "zb-h1"))
def test_bubble_formula_matches_the_simulated_idle_share(name):
    for pp, m in [(2, 4), (4, 8), (4, 4)]:
        vpp = 2 if name == "interleaved" else 1
        result = simulate(build_schedule(name, pp, m, vpp), pp, f_time=1.0, b_time=2.0)
        expected = bubble_formula(name, pp, m, vpp)
        # the idle share of the busiest rank equals the paper's bubble
        assert 1 - result.ideal / result.makespan == pytest.approx(expected, abs=1e-9)


def test_released_output_still_backpropagates():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4)
    out = torch.tanh(x @ w) + x
    expected = torch.autograd.grad(out, w, torch.ones(3, 4), retain_graph=True)[0]
    release_storage(out)
    assert out.untyped_storage().nbytes() == 4 and out.shape == (3, 4)
    torch.autograd.backward([out], [torch.ones(3, 4)])
    assert torch.equal(w.grad, expected)


def test_weight_step_does_the_deferred_linear_work():
    """B leaves every linear weight's gradient undone and W computes exactly the eager ones,
    one parameter after another in the given order; outside `collect` the hooks do nothing."""
    from fivefold.model.llama import build_model

    model = build_model(_config().model, seed=0)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    model(ids)[0].square().mean().backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    deferral = WeightGradDeferral(model)
    pending: list = []
    with deferral.collect(pending) as deferred:
        out = model(ids)[0]
    others = [p for p in model.parameters() if id(p) not in deferred]
    torch.autograd.backward([out.square().mean()], inputs=others)  # B: every gradient but the deferred ones
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert {id(item.weight) for item in pending} == deferred
    assert len(pending) == len(linears)
    assert all(model.get_submodule(n).weight.grad is None for n in linears)  # left for W
    order = list(model.parameters())[::-1]
    accumulated: list[int] = []
    for p in order:
        p.register_post_accumulate_grad_hook(lambda p: accumulated.append(id(p)))
    apply_deferred_weight_grads(pending, order=order)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[i] for i in accumulated] == [f"{n}.weight" for n in reversed(linears)]
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-7)
    model.zero_grad(set_to_none=True)
    model(ids)[0].square().mean().backward()  # no collect: a plain backward, every gradient at once
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=0)


@pytest.mark.parametrize("rows", [(2, 8), (4, 256)])
def test_weight_step_adds_later_micro_batches_in_place(rows):
    """From the second micro-batch on, W adds each deferred dW into the .grad that is there
    (data parallel's flat views stay put) and every parameter's accumulation hook still
    fires once per micro-batch; the sums equal eager accumulation up to fp32 rounding. At
    1024 rows the GEMM that adds into .grad (beta = 1) adds each block of its inner
    dimension in turn (past 512 rows on MKL), a different order from one added dW."""
    from fivefold.model.llama import build_model

    model = build_model(load_config("tiny", ["model.layers=2"]).model, seed=0)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, model.config.vocab_size, rows, generator=generator) for _ in range(2)]
    for ids in batches:
        model(ids)[0].square().mean().backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    deferral = WeightGradDeferral(model)
    order = list(model.parameters())[::-1]
    accumulated: list[int] = []
    for p in order:
        p.register_post_accumulate_grad_hook(lambda p: accumulated.append(id(p)))
    storage: dict[str, int] = {}
    for ids in batches:
        pending: list = []
        with deferral.collect(pending) as deferred:
            out = model(ids)[0]
        others = [p for p in model.parameters() if id(p) not in deferred]
        grads = torch.autograd.grad([out.square().mean()], others, allow_unused=True)  # B
        held = {id(p): (p, g) for p, g in zip(others, grads) if g is not None}
        apply_deferred_weight_grads(pending, held, order)  # W
        if not storage:
            storage = {name: p.grad.data_ptr() for name, p in model.named_parameters()}
    assert sorted(accumulated) == sorted(2 * [id(p) for p in order])
    for name, p in model.named_parameters():
        assert p.grad.layout == torch.strided and p.grad.data_ptr() == storage[name]
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-7)


def test_sends_are_posted_once_their_tensor_exists_in_list_order_per_peer():
    """The executor posts a send ahead of its place once its tensor exists, but never
    past an earlier send to the same peer (messages match first-in first-out)."""
    from fivefold.parallel.pipeline import PipelineRunner, _sends_by_peer, _StepState
    from fivefold.rules.schedules import ActionKind, group_steps

    row = build_schedule("1f1b", 2, 4)[0]  # rank 0 sends activations 0..3 to rank 1
    st = _StepState([], torch.zeros(()), torch.zeros(()))
    st.unposted_sends = _sends_by_peer(group_steps(row))
    sends = [a for a in row if a.kind is ActionKind.SEND_ACT]
    assert list(st.unposted_sends[1]) == sends
    assert PipelineRunner._ready_sends(None, st, True) == ()  # type: ignore[arg-type]
    st.units[(1, 0)] = "forward 1 ran"
    assert PipelineRunner._ready_sends(None, st, True) == ()  # type: ignore[arg-type]  # the send of 0 comes first
    st.units[(0, 0)] = "forward 0 ran"
    assert PipelineRunner._ready_sends(None, st, True) == tuple(sends[:2])  # type: ignore[arg-type]


def test_receives_are_posted_ahead_in_list_order_per_peer_up_to_the_depth():
    """On gloo the executor keeps the next receives from each peer posted ahead of their
    place (the sender's transfer waits for them), in list order, at most RECVS_AHEAD
    waiting for their consumer; a consumed receive makes room for the next."""
    from fivefold.parallel.pipeline import RECVS_AHEAD, PipelineRunner, _by_peer, _StepState
    from fivefold.rules.schedules import ActionKind, group_steps

    row = build_schedule("interleaved", 2, 4, 2)[0]  # rank 0 receives activations and gradients from 1
    recvs = [a for a in row if a.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)]
    st = _StepState([], torch.zeros(()), torch.zeros(()))
    st.unposted_recvs = _by_peer(group_steps(row), (ActionKind.RECV_ACT, ActionKind.RECV_GRAD))
    runner = types.SimpleNamespace(recvs_ahead=RECVS_AHEAD)
    assert list(st.unposted_recvs[1]) == recvs
    assert PipelineRunner._early_recvs(runner, st) == tuple(recvs[:RECVS_AHEAD])  # type: ignore[arg-type]
    for a in recvs[:RECVS_AHEAD]:  # posted: they wait for their consumers
        st.unposted_recvs[1].popleft()
        st.recv_peers[(a.kind, a.microbatch, a.chunk)] = 1
    assert PipelineRunner._early_recvs(runner, st) == ()  # type: ignore[arg-type]
    del st.recv_peers[(recvs[0].kind, recvs[0].microbatch, recvs[0].chunk)]  # its consumer ran
    assert PipelineRunner._early_recvs(runner, st) == (recvs[RECVS_AHEAD],)  # type: ignore[arg-type]
    runner.recvs_ahead = 0  # a coalesced backend: every receive at its place
    assert PipelineRunner._early_recvs(runner, st) == ()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["layout.pp=8"], "only 4 layers"),
        (["layout.pp=2", "layout.pp_layers=3,2"], "sum to the model's 4 layers"),
        (["layout.pp=2", "layout.pp_layers=4"], "lists 1 stages but pp x vpp = 2"),
        (["layout.pp=2", "layout.pp_layers=4,0"], "must be positive"),
        (["model.layers=6", "layout.pp=2", "layout.vpp=2", "layout.pp_schedule=interleaved"], "does not divide"),
        (["layout.pp=2", "layout.grad_accum=3"], "grad_accum=3 does not divide"),
        (["layout.pp=4", "layout.vpp=2", "model.layers=8", "layout.pp_schedule=interleaved", "layout.grad_accum=2"],
         "multiple of pp=4"),
        (["layout.pp=2", "layout.vpp=2"], "needs layout.pp_schedule='interleaved'"),
        (["layout.pp=2", "layout.pp_schedule=interleaved", "layout.grad_accum=1", "layout.vpp=2"], "multiple of pp=2"),
    ],
)
def test_bad_pipeline_layouts_are_rejected_before_launch(overrides, message):
    with pytest.raises(LayoutError, match=message):
        validate(load_config("tiny", overrides))


def test_timeline_outputs(tmp_path):
    rows = [[Event("F", 0, 0, 0.0, 1.0), Event("B", 0, 0, 2.0, 4.0)],
            [Event("comm", 0, 0, 0.0, 1.0), Event("F", 0, 0, 1.0, 2.0), Event("B", 0, 0, 2.0, 4.0)]]
    assert bubble_fraction(rows) == pytest.approx(1 - 6 / 8)
    trace = chrome_trace(rows)
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == 5
    json.dumps(trace)
    path = draw_gantt(rows, tmp_path / "t.png")
    assert path.stat().st_size > 1000


# ----------------------------------------------------------------------- parity (gloo)


def _parity_cases(pp: int) -> list[list[str]]:
    """Every schedule x micro-batches in {1, p, 2p, 8}, with uneven stages and the extras."""
    layers = ["model.layers=8"] if pp == 4 else []
    cases = []
    for name in (s for s in SCHEDULES if s != "dualpipev"):  # test_parity_dualpipev
        for m in sorted({1, pp, 2 * pp, 8}):
            extra = [f"layout.pp_schedule={name}", f"layout.grad_accum={m}"]
            if name == "interleaved":
                if m % pp:
                    continue
                extra += ["layout.vpp=2"] + layers
            cases.append([f"layout.pp={pp}"] + extra)
    uneven = "3,1" if pp == 2 else "1,2,1,4"
    cases.append([f"layout.pp={pp}", "layout.grad_accum=4", f"layout.pp_layers={uneven}",
                  "layout.pp_schedule=1f1b"] + (layers if pp == 4 else []))
    return cases


@functools.lru_cache(maxsize=None)
def _single_process_with_same_microbatches(config, steps: int):
    """The one-process run that accumulates the same micro-batches.

    With 8 layers, accumulating 4 or 8 micro-batches instead of one already moves a few
    parameters by ~3e-5 after two steps in ONE process (Adam amplifies the rounding of
    near-zero gradients), beyond the parameter bound. A dense pipeline is bitwise equal to
    this run; with MoE layers it differs by rounding (<= 1e-5 after two steps: gradients
    reaching a tensor with three or more consumers, as the MoE input has, are summed in
    another order once the graph is cut into stages).
    """
    from fivefold.rules.layout import Layout
    from fivefold.parallel.mesh import Mesh
    from fivefold.tools.parity import train_trace

    single = validate(config.replace(layout=Layout(grad_accum=config.layout.grad_accum * config.layout.dp)))
    return train_trace(single, Mesh.single(single.layout), steps)


def _check_parity(pools, reference, overrides: list[str], preset: str = "tiny", steps: int = 2):
    config = load_config(preset, ["train.seq_len=16", *overrides])  # short sequences: many layouts, little time
    if config.model.layers > 4 or config.model.is_moe:
        result = pools.run(config.layout.world_size, trace_on_rank, config, steps)[0]
        return assert_parity(_single_process_with_same_microbatches(config, steps), result)
    return layout_parity(pools, reference, config, steps=steps)


@pytest.mark.parametrize("pp", [2, 4])
def test_parity_every_schedule_and_microbatch_count(pools, reference, pp):
    for overrides in _parity_cases(pp):
        _check_parity(pools, reference, overrides)


def test_parity_tied_embeddings_and_moe(pools, reference):
    for overrides in [
        ["model.tied_embeddings=true", "layout.pp=4", "layout.grad_accum=4", "layout.pp_schedule=1f1b"],
        ["model.tied_embeddings=true", "layout.pp=4", "layout.vpp=2", "model.layers=8",
         "layout.pp_schedule=interleaved", "layout.grad_accum=4"],
    ]:
        _check_parity(pools, reference, overrides)
    overrides = ["layout.pp=2", "layout.grad_accum=4", "layout.pp_schedule=zb-h1"]  # aux losses on both stages
    _check_parity(pools, reference, overrides, preset="tiny-moe")


def test_parity_dualpipev(pools, reference):
    """The V placement (two chunks per rank, handing over in memory at the tip) and the split
    backward: dense at pp = 2 and pp = 4 from the fewest micro-batches on, MoE with experts
    sharded over ep = 2."""
    dualpipev = ["layout.pp_schedule=dualpipev", "layout.vpp=2"]
    for overrides in [
        ["layout.pp=2", "layout.grad_accum=3", "train.global_batch=6"],
        ["layout.pp=4", "layout.grad_accum=7", "train.global_batch=7", "model.layers=8"],
        # layers that do not divide into 2 pp chunks: the balanced cut gives the chunks 1 to 2 layers
        ["layout.pp=2", "layout.grad_accum=3", "train.global_batch=6", "model.layers=7"],
    ]:
        _check_parity(pools, reference, dualpipev + overrides)
    moe = ["layout.pp=2", "layout.dp=2", "layout.ep=2", "layout.grad_accum=3", "train.global_batch=6"]
    _check_parity(pools, reference, dualpipev + moe, preset="tiny-moe")


def _missing(module: str) -> bool:
    return importlib.util.find_spec(f"fivefold.parallel.{module}") is None


@pytest.mark.skipif(_missing("data_parallel"), reason="fivefold.parallel.data_parallel is not built yet")
def test_parity_with_data_parallel_and_zero(pools, reference):
    for extra in (["layout.zero=0"], ["layout.zero=1"], ["layout.zero=2"]):  # zero=3: test_zero3_pipeline.py
        overrides = ["layout.pp=2", "layout.dp=2", "layout.grad_accum=4", "layout.pp_schedule=1f1b"] + extra
        _check_parity(pools, reference, overrides)
    overrides = ["layout.pp=4", "layout.dp=2", "layout.pp_layers=1,2,1,4", "model.layers=8", "layout.grad_accum=2",
                 "layout.pp_schedule=zb-h1", "model.tied_embeddings=true"]
    _check_parity(pools, reference, overrides)


@pytest.mark.skipif(_missing("tensor_parallel"), reason="fivefold.parallel.tensor_parallel is not built yet")
def test_parity_with_tensor_and_sequence_parallel(pools, reference):
    for extra in (["layout.sequence_parallel=false"], ["layout.sequence_parallel=true"]):
        for name in ("1f1b", "zb-h1"):
            overrides = ["layout.pp=2", "layout.tp=2", "layout.grad_accum=4", f"layout.pp_schedule={name}"] + extra
            _check_parity(pools, reference, overrides)
    overrides = ["layout.pp=2", "layout.tp=2", "layout.dp=2", "layout.grad_accum=2", "model.tied_embeddings=true",
                 "layout.sequence_parallel=true"]
    if not _missing("data_parallel"):
        _check_parity(pools, reference, overrides)


# ---------------------------------------------------------------- memory and the timeline


def _measure_step(ctx, config, out_dir):
    """One traced step: activation memory and timeline per stage, and the evaluation loss."""
    from pathlib import Path

    from fivefold.data.sources import Sampler, load_tokenizer, load_tokens
    from fivefold.observe.timeline import trace_step
    from fivefold.train import build, evaluate, local_micro_batches

    config = validate(config, ctx.world_size)
    model = build(config, ctx.mesh(config.layout), torch.device("cpu"))
    data = load_tokens(config.data, load_tokenizer(config.data.tokenizer))
    sampler = Sampler(data.train, config.train.seq_len, config.train.global_batch, config.train.seed)
    model.runner.measure_memory = True
    with trace_step(model, Path(out_dir), enabled=True):
        model.runner.run(local_micro_batches(model, sampler, 0))
    memory = model.runner.memory
    return memory.peak_units, memory.peak_saved_bytes, evaluate(model, data, 1)


def test_activation_memory_timeline_and_evaluation(pools, tmp_path):
    from fivefold.tools.parity import reference_config
    from fivefold.train import build as build_single, evaluate as evaluate_single
    from fivefold.data.sources import load_tokenizer, load_tokens
    from fivefold.parallel.mesh import Mesh

    pp, m = 4, 8
    measured = {}
    for name in ("gpipe", "1f1b"):
        config = _config(pp=pp, grad_accum=m, pp_schedule=name)
        measured[name] = pools.run(pp, _measure_step, config, str(tmp_path / name))
    for rank in range(pp):
        gpipe_units, gpipe_bytes, _ = measured["gpipe"][rank]
        units, saved, _ = measured["1f1b"][rank]
        assert gpipe_units == m  # GPipe holds every micro-batch
        assert units == min(pp - rank, m)  # 1F1B at most p (p - rank on rank `rank`)
        assert saved * gpipe_units == pytest.approx(gpipe_bytes * units, rel=0.05)
    trace = json.loads((tmp_path / "1f1b" / "trace.json").read_text())
    forwards = [e for e in trace["traceEvents"] if e.get("cat") == "forward"]
    assert len(forwards) == pp * m
    assert (tmp_path / "gpipe" / "timeline.png").stat().st_size > 1000
    # forward-only evaluation on the pipeline equals the single process
    config = validate(_config(pp=pp, grad_accum=m))
    single = build_single(validate(reference_config(config)), Mesh.single(), torch.device("cpu"))
    data = load_tokens(config.data, load_tokenizer(config.data.tokenizer))
    expected = evaluate_single(single, data, 1)
    assert measured["1f1b"][0][2] == pytest.approx(expected, rel=1e-6)

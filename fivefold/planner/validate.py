"""Check a `LayoutSpec` against a model and a device count; name the values that work."""

from __future__ import annotations

import math

from .errors import PlanError, choices
from .spec import LayoutSpec, ModelSpec, divisors


def _fail(msg: str) -> None:
    raise PlanError(msg)


def valid_tp(model: ModelSpec, limit: int | None = None) -> list[int]:
    """Tensor-parallel degrees that split heads, KV heads and every MLP width evenly."""
    g = math.gcd(model.heads, model.n_kv_heads, model.ffn)
    if model.is_moe:
        g = math.gcd(g, model.expert_ffn)
    return [d for d in divisors(g) if limit is None or d <= limit]


def check_layout(model: ModelSpec, layout: LayoutSpec, gpus: int | None = None) -> None:
    """Raise `PlanError` naming the offending values and the values that would work."""
    lay = layout
    if gpus is not None and lay.world != gpus:
        _fail(f"dp*tp*pp*cp = {lay.dp}*{lay.tp}*{lay.pp}*{lay.cp} = {lay.world} devices, "
              f"but gpus={gpus}; change the degrees so that their product is {gpus}")
    ok_tp = valid_tp(model)
    if lay.tp not in ok_tp:
        _fail(f"tp={lay.tp} does not divide heads={model.heads}, kv_heads={model.n_kv_heads} and the "
              f"MLP width(s); tp can be one of {choices(ok_tp)}")
    if lay.pp * lay.vpp > model.layers:
        ok = [p for p in divisors(model.layers) if p * lay.vpp <= model.layers]
        _fail(f"pp*vpp = {lay.pp * lay.vpp} model chunks exceed layers={model.layers}; "
              f"with vpp={lay.vpp}, pp can be at most {model.layers // lay.vpp} (even splits: {choices(ok)})")
    _check_batch(lay)
    _check_context(model, lay)
    _check_experts(model, lay)


def _check_batch(lay: LayoutSpec) -> None:
    if lay.global_batch % lay.dp:
        _fail(f"global_batch={lay.global_batch} is not divisible by dp={lay.dp}; dp can be one of "
              f"{choices(divisors(lay.global_batch))} or pick a global batch that is a multiple of {lay.dp}")
    per_dp = lay.global_batch // lay.dp
    if per_dp % lay.micro_batch:
        _fail(f"global_batch/dp = {per_dp} is not divisible by micro_batch={lay.micro_batch}; "
              f"micro_batch can be one of {choices(divisors(per_dp))}")
    m = per_dp // lay.micro_batch
    if lay.schedule == "interleaved" and lay.pp > 1 and m % lay.pp:
        ok = [b for b in divisors(per_dp) if (per_dp // b) % lay.pp == 0]
        fix = (f"micro_batch can be one of {choices(ok)}" if ok else
               f"make global_batch a multiple of dp*pp*micro_batch = {lay.dp * lay.pp * lay.micro_batch}")
        _fail(f"the interleaved schedule needs the micro-batch count ({m}) to be a multiple of "
              f"pp={lay.pp}; {fix}, or use schedule='1f1b'")
    if lay.schedule == "zb-h1" and lay.pp > 1 and m < lay.pp:
        ok = [b for b in divisors(per_dp) if per_dp // b >= lay.pp]
        fix = (f"micro_batch can be one of {choices(ok)}" if ok else
               f"make global_batch at least dp*pp*micro_batch = {lay.dp * lay.pp * lay.micro_batch}")
        _fail(f"zb-h1 needs at least pp={lay.pp} micro-batches, got {m}; {fix}, or use schedule='1f1b'")


def _check_context(model: ModelSpec, lay: LayoutSpec) -> None:
    s = model.seq_len
    shards = lay.cp * (lay.tp if lay.sequence_parallel else 1)
    if s % shards:
        what = "cp*tp" if lay.sequence_parallel and lay.tp > 1 else "cp"
        ok = [d for d in divisors(s) if d <= 64]
        _fail(f"seq_len={s} is not divisible by {what}={shards}; use a sequence length that is a "
              f"multiple of {shards}, or a degree among {choices(ok)}")
    if lay.cp > 1 and lay.cp_kind == "ulysses":
        for name, n in (("heads", model.heads), ("kv_heads", model.n_kv_heads)):
            if n % (lay.tp * lay.cp):
                ok = [c for c in divisors(n // math.gcd(n, lay.tp)) if (lay.tp * c) <= n and n % (lay.tp * c) == 0]
                _fail(f"Ulysses context parallelism splits heads over tp*cp, but {name}={n} is not "
                      f"divisible by tp*cp={lay.tp * lay.cp}; with tp={lay.tp} cp can be one of "
                      f"{choices(ok)}, or use cp_kind='allgather' or 'ring'")


def _check_experts(model: ModelSpec, lay: LayoutSpec) -> None:
    if lay.ep == 1:
        return
    if not model.is_moe:
        _fail(f"ep={lay.ep} needs a Mixture-of-Experts model (num_experts > 0); use ep=1")
    group = lay.dp * lay.cp
    if group % lay.ep:
        _fail(f"ep={lay.ep} must divide dp*cp={group}; ep can be one of "
              f"{choices(d for d in divisors(group) if model.num_experts % d == 0)}")
    if model.num_experts % lay.ep:
        _fail(f"ep={lay.ep} does not divide num_experts={model.num_experts}; ep can be one of "
              f"{choices(d for d in divisors(group) if model.num_experts % d == 0)}")

"""Layout validation and the rank <-> coordinate maps (pure functions, no processes).

Rank order, fastest-varying first: tp, cp, dp, pp (docs/architecture.md). Tensor-parallel ranks are
neighbours, like GPUs on one NVLink island. Expert-parallel groups are runs of `ep`
consecutive ranks of the flattened (dp, cp) group.

Hybrid sharding (HSDP, `layout.dp_shard`): the data-parallel index is replica x dp_shard +
position, so each ZeRO shard group (dp_shard x cp ranks of one replica, with their tp ranks)
is a run of neighbouring ranks, inside one node when it fits; the replicas of a shard sit
dp_shard x cp x tp ranks apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import Config, Layout, ModelConfig, TrainConfig, check_values, load_config
from .placement import V_SCHEDULES
from .precision import PrecisionError, PrecisionPolicy
from .volumes import ZERO3_GATHERS, local_kv_heads, vocab_rows_per_rank

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev")
CP_ALGORITHMS = ("allgather", "ring", "ulysses")
ZIGZAG_ALGORITHMS = ("ring",)  # context-parallel algorithms that balance the causal mask by zigzag segments
RECOMPUTE = ("none", "selective", "full")


class LayoutError(ValueError):
    """A layout that cannot run; the message names the problem and the values that would work."""


@dataclass(frozen=True)
class Coords:
    pp: int
    dp: int
    cp: int
    tp: int


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def rank_to_coords(rank: int, layout: Layout) -> Coords:
    tp = rank % layout.tp
    cp = (rank // layout.tp) % layout.cp
    dp = (rank // (layout.tp * layout.cp)) % layout.dp
    pp = rank // (layout.tp * layout.cp * layout.dp)
    return Coords(pp=pp, dp=dp, cp=cp, tp=tp)


def coords_to_rank(coords: Coords, layout: Layout) -> int:
    return ((coords.pp * layout.dp + coords.dp) * layout.cp + coords.cp) * layout.tp + coords.tp


def dp_cp_index(coords: Coords, layout: Layout) -> int:
    """Position of a rank in its flattened (dp, cp) group, cp fastest."""
    return coords.dp * layout.cp + coords.cp


def ep_index(coords: Coords, layout: Layout) -> int:
    """Rank inside the expert-parallel group (consecutive members of the dp x cp group)."""
    return dp_cp_index(coords, layout) % layout.ep


def edp_index(coords: Coords, layout: Layout) -> int:
    """Rank inside the expert-data-parallel group (replicas of the same experts)."""
    return dp_cp_index(coords, layout) // layout.ep


def replica_index(coords: Coords, layout: Layout) -> int:
    """Which replica of the ZeRO shard groups a rank belongs to (always 0 without HSDP)."""
    return coords.dp // layout.shard_degree


def shard_position(coords: Coords, layout: Layout) -> int:
    """Position of a rank inside its shard group of the flattened (dp, cp) group, cp fastest."""
    return (coords.dp % layout.shard_degree) * layout.cp + coords.cp


# The axes ZeRO shards over and replicates over, per data axis whose ranks hold copies.
HYBRID_AXES = {"dp_cp": ("dp_cp_shard", "dp_cp_rep"), "edp": ("edp_shard", "edp_rep")}


def is_hybrid(layout: Layout) -> bool:
    """Whether ZeRO shards over part of the data-parallel ranks and replicates over the rest."""
    return layout.zero > 0 and layout.replicate_degree > 1


@dataclass(frozen=True)
class ZeroGroups:
    """Sizes of the groups ZeRO shards over and of their replicas, for non-expert and expert
    parameters; the sizes of `group_ranks`' dp_cp_shard, dp_cp_rep, edp_shard and edp_rep."""

    dense_shard: int
    dense_replicas: int
    expert_shard: int
    expert_replicas: int


def zero_groups(dp: int, cp: int, ep: int, zero: int, dp_shard: int = 0) -> ZeroGroups:
    """For the runtime's Layout and the planner's LayoutSpec alike (plain degrees in, sizes out).

    Without hybrid sharding (zero = 0 or dp_shard in (0, dp)) states are sharded over all of
    dp x cp (experts over dp x cp / ep). With it, a shard group is dp_shard x cp ranks, and an
    expert's copies inside one shard group (none when an expert group spans whole shard groups)."""
    hybrid = zero > 0 and 0 < dp_shard < dp
    shard = (dp_shard if hybrid else dp) * cp
    dense_replicas = dp * cp // shard
    expert_shard = max(1, shard // ep)
    return ZeroGroups(shard, dense_replicas, expert_shard, dp * cp // ep // expert_shard)


def group_ranks(layout: Layout, axis: str) -> list[list[int]]:
    """Every group of global ranks along `axis` (pp, dp, cp, tp, dp_cp, ep, edp, pp_ends, and
    the hybrid-sharding axes dp_cp_shard, dp_cp_rep, edp_shard, edp_rep).

    `pp_ends` pairs the first and last pipeline ranks of each (dp, cp, tp) position (they
    both hold a tied embedding); middle pipeline ranks are groups of one.
    """
    groups: dict[tuple, list[int]] = {}
    for rank in range(layout.world_size):
        c = rank_to_coords(rank, layout)
        key = _group_key(c, layout, axis)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


def _group_key(c: Coords, layout: Layout, axis: str) -> tuple:
    if axis == "tp":
        return (c.pp, c.dp, c.cp)
    if axis == "cp":
        return (c.pp, c.dp, c.tp)
    if axis == "dp":
        return (c.pp, c.cp, c.tp)
    if axis == "pp":
        return (c.dp, c.cp, c.tp)
    if axis == "dp_cp":
        return (c.pp, c.tp)
    if axis == "ep":
        return (c.pp, c.tp, edp_index(c, layout))
    if axis == "edp":
        return (c.pp, c.tp, ep_index(c, layout))
    if axis == "pp_ends":
        end = c.pp in (0, layout.pp - 1)
        return (-1 if end else c.pp, c.dp, c.cp, c.tp)
    return _hybrid_group_key(c, layout, axis)


def _hybrid_group_key(c: Coords, layout: Layout, axis: str) -> tuple:
    """A shard group is the members of a data axis inside one replica; a replicate group is the
    members at the same place of every replica's shard group."""
    if axis == "dp_cp_shard":
        return (c.pp, c.tp, replica_index(c, layout))
    if axis == "dp_cp_rep":
        return (c.pp, c.tp, shard_position(c, layout))
    if axis == "edp_shard":
        return (c.pp, c.tp, ep_index(c, layout), replica_index(c, layout))
    if axis == "edp_rep":
        return (c.pp, c.tp, ep_index(c, layout), shard_position(c, layout) // layout.ep)
    raise ValueError(f"unknown axis {axis!r}")


# ----------------------------------------------------------------------------- validation


def _must_divide(what: str, n: int, degree_name: str, degree: int, total: str) -> None:
    if n % degree:
        options = ", ".join(str(d) for d in divisors(n))
        raise LayoutError(f"{degree_name}={degree} does not divide {n} {what}; use one of {options} ({total})")


def _check_choices(layout: Layout) -> None:
    for name in ("dp", "tp", "pp", "vpp", "ep", "cp"):
        if getattr(layout, name) < 1:
            raise LayoutError(f"layout.{name}={getattr(layout, name)} must be at least 1")
    if layout.zero not in (0, 1, 2, 3):
        raise LayoutError(f"layout.zero={layout.zero} is not a ZeRO stage; use 0, 1, 2 or 3")
    if layout.pp_schedule not in SCHEDULES:
        raise LayoutError(f"layout.pp_schedule='{layout.pp_schedule}' is unknown; use one of {', '.join(SCHEDULES)}")
    if layout.cp_algorithm not in CP_ALGORITHMS:
        raise LayoutError(
            f"layout.cp_algorithm='{layout.cp_algorithm}' is unknown; use one of {', '.join(CP_ALGORITHMS)}"
        )
    if layout.recompute not in RECOMPUTE:
        raise LayoutError(f"layout.recompute='{layout.recompute}' is unknown; use one of {', '.join(RECOMPUTE)}")
    if layout.micro_batch < 0 or layout.grad_accum < 0:
        raise LayoutError("layout.micro_batch and layout.grad_accum must be positive (or 0 to derive them)")
    if layout.bucket_mb <= 0:
        raise LayoutError(f"layout.bucket_mb={layout.bucket_mb} must be positive")


def _check_tensor_parallel(layout: Layout, model: ModelConfig, train: TrainConfig) -> None:
    tp = layout.tp
    _must_divide("attention heads", model.heads, "tp", tp, "tensor parallel splits attention by heads")
    kv = model.n_kv_heads
    if kv % tp and tp % kv:
        options = sorted(set(divisors(kv)) | {d for d in divisors(model.heads) if d % kv == 0})
        raise LayoutError(
            f"tp={tp} neither divides nor is a multiple of {kv} key/value heads; use one of "
            f"{', '.join(map(str, options))}"
        )
    _must_divide("FFN width (model.ffn_hidden)", model.ffn, "tp", tp, "the MLP is split by columns")
    if model.is_moe:
        _must_divide("expert FFN width", model.expert_ffn, "tp", tp, "each expert is split by columns")
    _check_vocab_split(model.vocab_size, tp)
    if layout.tp_overlap and tp == 1:
        raise LayoutError("layout.tp_overlap needs tp > 1; set layout.tp or turn it off")
    if layout.sequence_parallel:
        if tp == 1:
            raise LayoutError("layout.sequence_parallel needs tp > 1; set layout.tp or turn it off")
        local = train.seq_len // layout.cp
        if local % tp:
            step = tp * layout.cp
            below, above = (train.seq_len // step) * step, (train.seq_len // step + 1) * step
            near = ", ".join(str(v) for v in (below, above) if v > 0)
            fits = ", ".join(str(d) for d in divisors(local) if model.heads % d == 0 and d > 1)
            raise LayoutError(
                f"sequence parallel splits each sequence segment of {local} tokens over tp={tp}, which does not "
                f"divide it; use a seq_len that is a multiple of {step} (e.g. {near})"
                + (f", or tp in {fits}" if fits else "")
            )


def _check_vocab_split(vocab: int, tp: int) -> None:
    """The vocabulary is padded to a multiple of tp; every rank must own at least one real token."""
    width = vocab_rows_per_rank(vocab, tp)
    if vocab <= (tp - 1) * width:
        largest = max(d for d in range(1, tp) if vocab > (d - 1) * vocab_rows_per_rank(vocab, d))
        raise LayoutError(
            f"model.vocab_size={vocab} split over tp={tp} leaves rank {tp - 1} only padding "
            f"({width} rows each); use tp <= {largest} or a larger vocabulary"
        )


def _check_pipeline(layout: Layout, model: ModelConfig, num_micro: int) -> None:
    pp, vpp = layout.pp, layout.vpp
    check_chunk_schedule(layout.pp_schedule, vpp)
    chunks = pp * vpp
    if chunks > model.layers:
        raise LayoutError(
            f"pp={pp} x vpp={vpp} = {chunks} pipeline chunks but the model has only {model.layers} layers; "
            f"use pp x vpp <= {model.layers}"
        )
    if layout.pp_layers:
        if len(layout.pp_layers) != chunks:
            raise LayoutError(
                f"layout.pp_layers lists {len(layout.pp_layers)} stages but pp x vpp = {chunks}; give one count per chunk"
            )
        if sum(layout.pp_layers) != model.layers or min(layout.pp_layers) < 1:
            raise LayoutError(
                f"layout.pp_layers={list(layout.pp_layers)} must be positive and sum to the model's {model.layers} layers"
            )
    elif vpp > 1 and layout.pp_schedule == "interleaved" and model.layers % chunks:
        ok = [v for v in divisors(model.layers // pp) if model.layers % pp == 0] if model.layers % pp == 0 else []
        raise LayoutError(
            f"vpp={vpp} does not divide the layers per stage ({model.layers} layers over pp={pp}); "
            + (f"use vpp in {ok}" if ok else f"use a pp that divides {model.layers}")
            + " or give layout.pp_layers"
        )
    least = dualpipev_min_microbatches(pp)
    if layout.pp_schedule in V_SCHEDULES and model.tied_embeddings:
        raise LayoutError(
            "layout.pp_schedule='dualpipev' puts the embedding and the head in two chunks of pipeline rank 0, "
            "where a tied embedding is not supported; set model.tied_embeddings=false or use another pp_schedule"
        )
    if layout.pp_schedule in V_SCHEDULES and num_micro < least:
        raise LayoutError(
            f"the dualpipev schedule with pp={pp} needs at least 2 x pp - 1 = {least} micro-batches, got "
            f"{num_micro}; use grad_accum >= {least} (global_batch = dp x micro_batch x grad_accum)"
        )
    if layout.pp_schedule == "interleaved" and pp > 1 and num_micro % pp:
        raise LayoutError(
            f"the interleaved schedule needs a number of micro-batches that is a multiple of pp={pp}, got "
            f"{num_micro}; " + _interleaved_batching_advice(layout)
        )


def _interleaved_batching_advice(layout: Layout) -> str:
    """grad_accum values the batch allows (each a multiple of pp and a divisor of the sequences per
    data-parallel rank), or, when there is none, the global batches that would allow one."""
    per_rank = layout.micro_batch * layout.grad_accum
    ok = [m for m in divisors(per_rank) if m % layout.pp == 0]
    if ok:
        return (f"use grad_accum in {ok} with micro_batch = {per_rank} / grad_accum, or unset "
                "(global_batch = dp x micro_batch x grad_accum)")
    return (f"no grad_accum can: the {per_rank} sequences per data-parallel rank are not a multiple of pp={layout.pp}; "
            f"use a train.global_batch that is a multiple of dp x pp = {layout.dp * layout.pp}")


def dualpipev_min_microbatches(pp: int) -> int:
    """Fewest micro-batches DualPipeV schedules: rank 0 runs 2 pp - 1 forwards down the V
    before its first backward, so its steady state holds m - 2 pp + 1 >= 0 forward/backward
    pairs (rules.schedules.dualpipev)."""
    return 2 * pp - 1


def check_chunk_schedule(schedule: str, vpp: int, schedule_key: str = "layout.pp_schedule") -> None:
    """DualPipeV runs exactly two chunks per rank (the V); more than one chunk otherwise needs
    the interleaved schedule (every other table runs one chunk per rank); `schedule_key`
    names the setting in the message."""
    if schedule in V_SCHEDULES:
        if vpp != 2:
            raise LayoutError(
                f"{schedule_key}='{schedule}' places two chunks on each pipeline rank in a V; set vpp=2 (got vpp={vpp})"
            )
        return
    if vpp > 1 and schedule != "interleaved":
        raise LayoutError(
            f"vpp={vpp} needs {schedule_key}='interleaved' (got '{schedule}'); set {schedule_key}='interleaved' or vpp=1"
        )


def sequence_segments(algorithm: str, cp: int) -> int:
    """How many equal segments context parallelism cuts each sequence into: zigzag ring attention
    gives rank i segments i and 2cp - 1 - i of 2cp (equal causal work per rank), the others one of cp."""
    return 2 * cp if algorithm in ZIGZAG_ALGORITHMS else cp


def _check_experts(layout: Layout, model: ModelConfig) -> None:
    if layout.ep > 1 and not model.is_moe:
        raise LayoutError(f"ep={layout.ep} needs a Mixture-of-Experts model (model.num_experts > 0)")
    dp_cp = layout.dp * layout.cp
    if dp_cp % layout.ep:
        raise LayoutError(
            f"ep={layout.ep} must divide dp x cp = {dp_cp} (experts are sharded inside the data-parallel group); "
            f"use ep in {divisors(dp_cp)}"
        )
    if model.is_moe:
        _must_divide("experts", model.num_experts, "ep", layout.ep, "each rank holds whole experts")


def _check_context_parallel(layout: Layout, model: ModelConfig, train: TrainConfig) -> None:
    cp = layout.cp
    if cp == 1:
        return
    segments = sequence_segments(layout.cp_algorithm, cp)
    if train.seq_len % segments:
        ok = [s for s in range(segments, train.seq_len + 2 * segments, segments)][-3:]
        zigzag = segments == 2 * cp
        why = "zigzag ring attention cuts each sequence into 2 x cp segments" if zigzag else "cp splits the sequence"
        raise LayoutError(
            f"seq_len={train.seq_len} is not divisible by {segments} ({why}); use a multiple of {segments}, e.g. {ok}"
        )
    if layout.cp_algorithm == "ulysses":
        _check_ulysses_heads(layout, model)


def _check_ulysses_heads(layout: Layout, model: ModelConfig) -> None:
    """Ulysses moves whole heads: the heads left after tp must split over cp.

    Key/value heads may also be fewer than cp when cp is a multiple of them: each is then
    repeated before the all-to-all so that every rank receives the one its queries use.
    """
    cp = layout.cp
    local_heads = model.heads // layout.tp
    local_kv = local_kv_heads(model.n_kv_heads, layout.tp)
    kv_ok = local_kv % cp == 0 or cp % local_kv == 0
    if local_heads % cp or not kv_ok:
        options = [d for d in divisors(local_heads) if local_kv % d == 0 or d % local_kv == 0]
        raise LayoutError(
            f"Ulysses splits attention heads over cp: the heads left after tp={layout.tp} ({local_heads} query, "
            f"{local_kv} key/value) must be divisible by cp={cp} (key/value heads may also divide it); "
            f"use cp in {options} or cp_algorithm='ring' / 'allgather'"
        )


def _check_zero(layout: Layout) -> None:
    if layout.zero > 0 and layout.dp * layout.cp == 1:
        raise LayoutError(
            f"zero={layout.zero} shards over data-parallel ranks but dp x cp = 1; set layout.dp > 1 or zero = 0"
        )
    _check_hybrid(layout)
    _check_zero3_gather(layout)


def _check_zero3_gather(layout: Layout) -> None:
    if layout.zero3_gather not in ZERO3_GATHERS:
        raise LayoutError(f"layout.zero3_gather='{layout.zero3_gather}' is unknown; use one of {', '.join(ZERO3_GATHERS)}")
    if layout.zero3_gather != "micro_batch" and layout.zero != 3:
        raise LayoutError(f"layout.zero3_gather='{layout.zero3_gather}' chooses when ZeRO-3 gathers parameters "
                          f"but zero={layout.zero}; set layout.zero=3 or drop zero3_gather")


def _check_hybrid(layout: Layout) -> None:
    """layout.dp_shard: ZeRO shard groups of dp_shard (x cp) ranks, replicated dp / dp_shard times."""
    shard, dp = layout.dp_shard, layout.dp
    if shard == 0 or shard == dp:
        return
    if shard < 0 or dp % shard:
        raise LayoutError(
            f"layout.dp_shard={shard} does not divide dp={dp}; use one of {', '.join(map(str, divisors(dp)))} "
            "(dp = replicas x dp_shard), or 0 to shard over all of dp"
        )
    if layout.zero == 0:
        raise LayoutError(
            f"layout.dp_shard={shard} shards ZeRO state but zero=0; set layout.zero to 1, 2 or 3, or drop dp_shard"
        )
    group = shard * layout.cp
    if group == 1:
        raise LayoutError(
            f"layout.dp_shard=1 with cp=1 leaves one rank per shard group (nothing sharded); "
            f"use dp_shard in {[d for d in divisors(dp) if d > 1]}, or zero=0 for plain data parallel"
        )
    if layout.ep > 1 and group % layout.ep and layout.ep % group:
        raise LayoutError(
            f"ep={layout.ep} neither divides nor is a multiple of the shard group dp_shard x cp = {group} "
            f"(expert groups must lie inside one shard group or span whole ones); use dp_shard in "
            f"{[d for d in divisors(dp) if (d * layout.cp) % layout.ep == 0 or layout.ep % (d * layout.cp) == 0]}"
        )


def resolve_batching(layout: Layout, train: TrainConfig) -> Layout:
    """Fill in micro_batch and grad_accum so that dp x micro_batch x grad_accum = global_batch."""
    per_rank, rest = divmod(train.global_batch, layout.dp)
    if rest:
        raise LayoutError(
            f"global_batch={train.global_batch} does not split over dp={layout.dp}; use a multiple of {layout.dp}"
        )
    mb, acc = layout.micro_batch, layout.grad_accum
    if mb and acc:
        if mb * acc != per_rank:
            raise LayoutError(
                f"dp={layout.dp} x micro_batch={mb} x grad_accum={acc} = {layout.dp * mb * acc} but "
                f"global_batch={train.global_batch}; change one of them"
            )
    elif mb:
        if per_rank % mb:
            raise LayoutError(
                f"micro_batch={mb} does not divide the {per_rank} sequences per data-parallel rank; use one of "
                f"{divisors(per_rank)}"
            )
        acc = per_rank // mb
    elif acc:
        if per_rank % acc:
            raise LayoutError(
                f"grad_accum={acc} does not divide the {per_rank} sequences per data-parallel rank; use one of "
                f"{divisors(per_rank)}"
            )
        mb = per_rank // acc
    else:
        mb, acc = per_rank, 1
    return dataclasses.replace(layout, micro_batch=mb, grad_accum=acc)


def validate(config: Config, world_size: int | None = None) -> Config:
    """Check the layout against the model, training shape and world size; return it resolved.

    Raises LayoutError naming the problem and what would work, before any process starts.
    """
    layout, model, train = check_values(config).layout, config.model, config.train
    _check_choices(layout)
    _check_model(model)
    try:
        PrecisionPolicy.from_train(train)
    except PrecisionError as err:
        raise LayoutError(str(err)) from None
    if train.seq_len > model.max_seq_len:
        raise LayoutError(f"train.seq_len={train.seq_len} exceeds model.max_seq_len={model.max_seq_len}")
    if world_size is not None and world_size != layout.world_size:
        raise LayoutError(
            f"the layout needs pp x dp x cp x tp = {layout.pp}x{layout.dp}x{layout.cp}x{layout.tp} = "
            f"{layout.world_size} processes but {world_size} were started"
        )
    layout = resolve_batching(layout, train)
    _check_zero(layout)
    _check_tensor_parallel(layout, model, train)
    _check_pipeline(layout, model, layout.grad_accum)
    _check_experts(layout, model)
    _check_context_parallel(layout, model, train)
    return config.replace(layout=layout)


def _check_model(model: ModelConfig) -> None:
    if model.hidden % model.heads:
        raise LayoutError(f"model.hidden={model.hidden} is not divisible by model.heads={model.heads}")
    if model.head_dim % 2:
        raise LayoutError(f"head dimension {model.head_dim} must be even for rotary embeddings")
    if model.heads % model.n_kv_heads:
        raise LayoutError(
            f"model.heads={model.heads} is not a multiple of model.kv_heads={model.n_kv_heads}; use one of "
            f"{divisors(model.heads)}"
        )
    if model.is_moe:
        if not 1 <= model.top_k <= model.num_experts:
            raise LayoutError(f"model.top_k={model.top_k} must be between 1 and num_experts={model.num_experts}")
        if model.capacity_factor <= 0:
            raise LayoutError(
                f"model.capacity_factor={model.capacity_factor} must be > 0 (it caps tokens per expert); "
                "for no cap set model.dropless = true"
            )
        if model.router not in ("softmax", "sigmoid"):
            raise LayoutError(f"model.router='{model.router}' is unknown; use softmax or sigmoid")
        if model.moe_every < 1:
            raise LayoutError("model.moe_every must be at least 1")
        if model.bias_update_rate and model.router != "sigmoid":
            raise LayoutError(
                f"model.bias_update_rate={model.bias_update_rate} needs model.router='sigmoid' (auxiliary-loss-free "
                "balancing steers sigmoid scores); set the router or bias_update_rate = 0"
            )
    elif model.shared_experts or not model.dropless or model.bias_update_rate or model.router != "softmax":
        raise LayoutError(
            "MoE options (shared_experts, dropless, bias_update_rate, router) are set on a dense model; "
            "set model.num_experts > 0 or remove them"
        )


def parse_layout_string(text: str) -> dict[str, str]:
    """Parse "dp=2,tp=2,pp=2" into layout overrides; a name given twice is refused."""
    values: dict[str, str] = {}
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        if "=" not in part and values:  # most likely the rest of a list value, cut at its comma
            key = list(values)[-1]
            raise LayoutError(f"layout entry '{part}' has no name: commas separate --layout entries, so a list "
                              f"such as {key}={values[key]},{part} cannot go inside it; give it on its own "
                              f"as --layout.{key} {values[key]},{part}")
        if "=" not in part:
            raise LayoutError(f"layout entry '{part}' must look like name=value, e.g. dp=2")
        key, value = part.split("=", 1)
        if not key or not value:
            raise LayoutError(f"layout entry '{part}' must look like name=value, e.g. dp=2")
        if key in values:
            raise LayoutError(f"--layout gives {key} twice ({key}={values[key]} and {key}={value}); keep one")
        values[key] = value
    if not values:
        raise LayoutError(f"--layout '{text}' names no axis; give e.g. \"dp=2,tp=2\"")
    return values


def layout_overrides(layout: str | None) -> list[str]:
    """A --layout string as dotted overrides (none for no layout or "auto", which the planner fills)."""
    if not layout or layout == "auto":
        return []
    return [f"layout.{k}={v}" for k, v in parse_layout_string(layout).items()]


def config_from_args(config_name: str | None, layout: str | None, overrides: list[str]) -> Config:
    """The config of a command line: a preset or TOML path, a layout string, dotted overrides."""
    return load_config(config_name or "small", layout_overrides(layout) + list(overrides))

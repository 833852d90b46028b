"""Frozen descriptions of a model (`ModelSpec`) and a parallel layout (`LayoutSpec`).

`ModelSpec` covers two layer types:

* ``arch="gpt"``: the Megatron GPT layer analysed by Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models" (LayerNorm, biases, GeLU MLP of
  width ``ffn_hidden`` (default 4h), dropout, learned position embeddings, output layer
  tied to the input embedding).
* ``arch="llama"``: fivefold's own layer (RMSNorm, no biases, grouped-query attention with
  RoPE, SwiGLU MLP, optional Mixture-of-Experts MLP, untied head unless
  ``tied_embeddings``).

With ``kv_lora_rank > 0`` the llama layer's attention is multi-head latent attention
(DeepSeek-V2/V3, arXiv 2412.19437 Section 2.1.1), a planner-only shape: the runtime trains
grouped-query attention (`ModelSpec.runtime_gaps` says so).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

from ..rules.layout import CP_ALGORITHMS as CP_KINDS
from ..rules.layout import RECOMPUTE, SCHEDULES, LayoutError, ZeroGroups, check_chunk_schedule, zero_groups
from ..rules.volumes import ZERO3_GATHERS
from ..config import default_ffn_hidden
from . import params
from .errors import PlanError, UnknownNameError, choices

ARCHS = ("gpt", "llama")

_SCHEDULE_ALIASES = {
    "gpipe": "gpipe", "fill-drain": "gpipe", "1f1b": "1f1b", "pipedream-flush": "1f1b",
    "interleaved": "interleaved", "interleaved-1f1b": "interleaved", "vpp": "interleaved",
    "zb-h1": "zb-h1", "zbh1": "zb-h1", "zb": "zb-h1", "zero-bubble": "zb-h1",
    "dualpipev": "dualpipev", "dualpipe-v": "dualpipev",
}
# Schedules the planner costs before the runtime runs them, and the runtime schedule whose
# rules (devices, micro-batches, layer split, one chunk per rank) stand in for their validation.
# None at present: the runtime runs every schedule the planner costs (DualPipeV included).
PLANNER_SCHEDULES: dict[str, str] = {}
PLANNED_SCHEDULES = tuple(dict.fromkeys((*SCHEDULES, *PLANNER_SCHEDULES)))
_CP_ALIASES = {
    "allgather": "allgather", "all-gather": "allgather", "all_gather": "allgather",
    "ring": "ring", "ulysses": "ulysses", "all-to-all": "ulysses", "alltoall": "ulysses",
}


def _positive(owner: str, **values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlanError(f"{owner}.{name} must be a positive integer, got {v!r}")


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


# The deepest model `plan` answers for within about a minute on a laptop CPU (1,024 layers on 64
# devices); the stage balancing (rules/stages.py) grows with the square of the layers.
MAX_PLANNED_LAYERS = 1024


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer. Unset widths take the arch's default.

    Layer ``i`` is a Mixture-of-Experts layer iff ``num_experts > 0``,
    ``i >= first_dense_layers`` and ``i % moe_every == moe_every - 1``.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int = 2048
    ffn_hidden: int | None = None
    kv_heads: int | None = None
    arch: str = "gpt"
    num_experts: int = 0
    top_k: int = 1
    expert_ffn_hidden: int | None = None
    moe_every: int = 1
    shared_experts: int = 0
    tied_embeddings: bool = False
    first_dense_layers: int = 0
    dropless: bool = True  # MoE routing without capacity (no token dropped)
    # multi-head latent attention (planner only): low-rank query and key/value compression,
    # per-head widths of the position-free and rotary parts of q/k, and of v
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    # node-limited routing (DeepSeek-V3 Section 2.1.2): each token's experts lie on at most
    # this many nodes; 0 routes freely
    route_nodes: int = 0
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        _positive("ModelSpec", layers=self.layers, hidden=self.hidden, heads=self.heads,
                  vocab=self.vocab, seq_len=self.seq_len, top_k=self.top_k,
                  moe_every=self.moe_every)
        if self.layers > MAX_PLANNED_LAYERS:
            raise PlanError(f"ModelSpec.layers={self.layers:,} is more than the planner handles ({MAX_PLANNED_LAYERS:,}: it "
                            "balances pipeline stages layer by layer, in time quadratic in the layers; published "
                            f"models have under 200); plan a model of at most {MAX_PLANNED_LAYERS:,} layers")
        if self.arch not in ARCHS:
            raise UnknownNameError(f"ModelSpec.arch={self.arch!r} is unknown; use one of {choices(ARCHS)}")
        if self.hidden % self.heads:
            raise PlanError(f"hidden={self.hidden} is not divisible by heads={self.heads}; "
                            f"heads can be one of {choices(d for d in divisors(self.hidden) if d <= 1024)}")
        for name in ("ffn_hidden", "kv_heads", "expert_ffn_hidden"):
            v = getattr(self, name)
            if v is not None:
                _positive("ModelSpec", **{name: v})
        if self.heads % self.n_kv_heads:
            raise PlanError(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}; "
                            f"kv_heads can be one of {choices(divisors(self.heads))}")
        for name in ("num_experts", "shared_experts", "first_dense_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise PlanError(f"ModelSpec.{name} must be a non-negative integer, got {v!r}")
        if not isinstance(self.dropless, bool):
            raise PlanError(f"ModelSpec.dropless must be true or false, got {self.dropless!r}")
        if self.num_experts and self.top_k > self.num_experts:
            raise PlanError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}; "
                            f"use top_k <= {self.num_experts}")
        if self.first_dense_layers > self.layers:
            raise PlanError(f"first_dense_layers={self.first_dense_layers} exceeds layers={self.layers}")
        self._check_mla()
        if not isinstance(self.route_nodes, int) or self.route_nodes < 0:
            raise PlanError(f"ModelSpec.route_nodes must be a non-negative integer, got {self.route_nodes!r}")

    def _check_mla(self) -> None:
        widths = {"q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
                  "qk_nope_dim": self.qk_nope_dim, "qk_rope_dim": self.qk_rope_dim, "v_head_dim": self.v_head_dim}
        for name, v in widths.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise PlanError(f"ModelSpec.{name} must be a non-negative integer, got {v!r}")
        if self.kv_lora_rank and not (self.qk_nope_dim and self.qk_rope_dim and self.v_head_dim):
            raise PlanError("multi-head latent attention (kv_lora_rank > 0) needs qk_nope_dim, qk_rope_dim "
                            "and v_head_dim; set all three")

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention instead of grouped-query attention."""
        return self.kv_lora_rank > 0

    def runtime_gaps(self) -> tuple[str, ...]:
        """What of this shape ``fivefold train`` cannot train (the planner plans it anyway)."""
        gaps = []
        if self.arch == "gpt":
            gaps.append("the GPT layer (LayerNorm, biases, GeLU): the runtime trains the llama layer")
        if self.is_mla:
            gaps.append("multi-head latent attention: the runtime trains grouped-query attention")
        return tuple(gaps)

    # ---- derived widths -------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn(self) -> int:
        """Dense MLP width when unset: 4h for GPT, the runtime's rule for llama (`default_ffn_hidden`)."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return 4 * self.hidden if self.arch == "gpt" else default_ffn_hidden(self.hidden)

    @property
    def expert_ffn(self) -> int:
        return self.expert_ffn_hidden if self.expert_ffn_hidden is not None else self.ffn

    @property
    def is_moe(self) -> bool:
        return self.num_moe_layers > 0

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i >= self.first_dense_layers
                and i % self.moe_every == self.moe_every - 1)

    @cached_property
    def moe_layers(self) -> tuple[bool, ...]:
        """`is_moe_layer` for every layer (derived once; the spec is immutable)."""
        return tuple(self.is_moe_layer(i) for i in range(self.layers))

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    # ---- parameter counts (see params.py) ---------------------------------------------
    def num_params(self) -> int:
        """Total parameters (every expert counted)."""
        return params.total_params(self)

    def active_params(self) -> int:
        """Parameters used per token: top_k routed experts plus shared experts."""
        return params.active_params(self)

    @property
    def vocab_size(self) -> int:
        """The vocabulary under the runtime's name (`ModelConfig.vocab_size`), for the shared counts."""
        return self.vocab

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class LayoutSpec:
    """Parallel degrees and training-step options.

    ``world = pp * dp * cp * tp`` devices. ``ep`` divides ``dp * cp``. The global batch
    (in sequences) is split over ``dp`` into micro-batches of ``micro_batch`` sequences;
    each pipeline therefore runs ``global_batch / (dp * micro_batch)`` micro-batches.
    Schedules: ``gpipe``, ``1f1b``, ``interleaved`` (the only one that takes ``vpp > 1``
    model chunks per device) and ``zb-h1`` (zero-bubble H1). ``cp_kind``: ``allgather``
    (all-gather K/V), ``ring`` or ``ulysses``. ``pp_layers``: layers of each of the
    ``pp * vpp`` model chunks, as the runtime's ``layout.pp_layers`` (empty: the runtime's
    balanced split).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    vpp: int = 1
    micro_batch: int = 1
    global_batch: int = 1
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    recompute: str = "none"
    cp_kind: str = "allgather"
    pp_layers: tuple[int, ...] = ()
    dp_shard: int = 0  # hybrid sharding: ZeRO shard groups of dp_shard (x cp) ranks; 0: all of dp
    zero3_gather: str = "micro_batch"  # ZeRO-3 gathers per micro-batch, or once per step (`ZERO3_GATHERS`)
    # Planner only: tokens on the busiest expert-parallel rank over the mean (max / mean). 1.0,
    # balanced, by default; a run logs the per-expert figure as moe/<layer>/imbalance (an
    # upper bound of the per-rank one, which sums E / ep experts).
    expert_imbalance: float = 1.0

    def __post_init__(self) -> None:
        _positive("LayoutSpec", dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep,
                  vpp=self.vpp, micro_batch=self.micro_batch, global_batch=self.global_batch)
        if self.zero not in (0, 1, 2, 3):
            raise PlanError(f"LayoutSpec.zero={self.zero!r} is not a ZeRO stage; use 0, 1, 2 or 3")
        sched = _SCHEDULE_ALIASES.get(str(self.schedule).lower())
        if sched is None:
            raise UnknownNameError(f"schedule={self.schedule!r} is unknown; use one of {choices(PLANNED_SCHEDULES)}")
        object.__setattr__(self, "schedule", sched)
        if sched == "dualpipev" and self.vpp == 1:  # DualPipeV always holds two chunks per rank (a V)
            object.__setattr__(self, "vpp", 2)
        cp_kind = _CP_ALIASES.get(str(self.cp_kind).lower())
        if cp_kind is None:
            raise UnknownNameError(f"cp_kind={self.cp_kind!r} is unknown; use one of {choices(CP_KINDS)}")
        object.__setattr__(self, "cp_kind", cp_kind)
        if self.recompute not in RECOMPUTE:
            raise UnknownNameError(f"recompute={self.recompute!r} is unknown; use one of {choices(RECOMPUTE)}")
        if not isinstance(self.sequence_parallel, bool):
            raise PlanError(f"sequence_parallel must be True or False, got {self.sequence_parallel!r}")
        try:
            check_chunk_schedule(self.schedule, self.vpp, schedule_key="schedule")
        except LayoutError as err:
            raise PlanError(str(err)) from None
        object.__setattr__(self, "pp_layers", tuple(self.pp_layers))
        if self.dp_shard < 0 or (self.dp_shard and self.dp % self.dp_shard):
            raise PlanError(f"LayoutSpec.dp_shard={self.dp_shard} does not divide dp={self.dp}; use a divisor or 0")
        if not isinstance(self.expert_imbalance, (int, float)) or self.expert_imbalance < 1.0:
            raise PlanError(f"expert_imbalance={self.expert_imbalance!r} is max/mean tokens per expert-parallel rank; "
                            "use a number >= 1.0 (1.0: balanced)")
        if self.zero3_gather not in ZERO3_GATHERS:
            raise UnknownNameError(f"zero3_gather={self.zero3_gather!r} is unknown; use one of {choices(ZERO3_GATHERS)}")

    @property
    def zero_groups(self) -> ZeroGroups:
        """The ZeRO shard and replicate group sizes (`fivefold.rules.layout.zero_groups`)."""
        return zero_groups(self.dp, self.cp, self.ep, self.zero, self.dp_shard)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def runtime_schedule(self) -> str:
        """The runtime schedule that validates this layout: its own, or a planner-only
        schedule's stand-in (`PLANNER_SCHEDULES`) until the runtime runs it."""
        return self.schedule if self.schedule in SCHEDULES else PLANNER_SCHEDULES[self.schedule]

    def runtime_gaps(self) -> tuple[str, ...]:
        """What of this layout ``fivefold train`` cannot run (the planner costs it anyway)."""
        if self.pp > 1 and self.schedule not in SCHEDULES:
            return (f"the {self.schedule} pipeline schedule (planned with its published bubble and overlap)",)
        return ()

    def with_states(self, zero: int, recompute: str, zero3_gather: str | None = None) -> "LayoutSpec":
        """This layout with another ZeRO stage and recomputation, and ZeRO-3 gather policy when
        given (checked, without re-checking the other fields: a search derives thousands of these)."""
        if zero not in (0, 1, 2, 3) or recompute not in RECOMPUTE:
            raise PlanError(f"zero={zero!r}, recompute={recompute!r}: use zero 0-3 and one of {choices(RECOMPUTE)}")
        gather = self.zero3_gather if zero3_gather is None else zero3_gather
        if gather not in ZERO3_GATHERS:
            raise UnknownNameError(f"zero3_gather={gather!r} is unknown; use one of {choices(ZERO3_GATHERS)}")
        new = object.__new__(LayoutSpec)
        new.__dict__.update(self.__dict__, zero=zero, recompute=recompute, zero3_gather=gather)
        return new

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per pipeline per step: global_batch / (dp * micro_batch)."""
        return self.global_batch // (self.dp * self.micro_batch)

    def replace(self, **changes) -> "LayoutSpec":
        return dataclasses.replace(self, **changes)

    def short(self) -> str:
        """Compact one-line rendering, parseable by `parse_layout`."""
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        if self.zero_groups.dense_replicas > 1:
            parts.append(f"dp_shard={self.dp_shard}")
        if self.cp > 1:
            parts += [f"cp={self.cp}", f"cp_kind={self.cp_kind}"]
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        parts.append(f"zero={self.zero}")
        if self.zero == 3 and self.zero3_gather != "micro_batch":
            parts.append(f"zero3_gather={self.zero3_gather}")
        if self.pp > 1:
            parts.append(f"schedule={self.schedule}")
        if self.vpp > 1:
            parts.append(f"vpp={self.vpp}")
        if self.sequence_parallel:
            parts.append("sp=1")
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        parts.append(f"mb={self.micro_batch}")
        if self.expert_imbalance != 1.0:
            parts.append(f"imbalance={self.expert_imbalance:g}")
        return ",".join(parts)


_LAYOUT_KEYS = {
    "dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "zero": "zero", "vpp": "vpp",
    "mb": "micro_batch", "micro_batch": "micro_batch", "gb": "global_batch",
    "global_batch": "global_batch", "schedule": "schedule", "sp": "sequence_parallel",
    "sequence_parallel": "sequence_parallel", "recompute": "recompute", "cp_kind": "cp_kind",
    "dp_shard": "dp_shard", "zero3_gather": "zero3_gather",
    "imbalance": "expert_imbalance", "expert_imbalance": "expert_imbalance",
}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_layout(text: str, **defaults) -> LayoutSpec:
    """Parse ``"dp=2,tp=4,pp=2,zero=1,schedule=1f1b,sp=1,recompute=selective,mb=1"``.

    Keyword ``defaults`` (e.g. ``global_batch=512``) apply to keys the text omits.
    """
    values: dict = dict(defaults)
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = item.partition("=")
        key, raw = key.strip().lower(), raw.strip()
        if not sep or key not in _LAYOUT_KEYS:
            raise UnknownNameError(f"layout item {item!r} is not KEY=VALUE with KEY one of "
                                   f"{choices(sorted(_LAYOUT_KEYS))}")
        field_name = _LAYOUT_KEYS[key]
        if field_name in ("schedule", "recompute", "cp_kind", "zero3_gather"):
            values[field_name] = raw.lower()
        elif field_name == "sequence_parallel":
            if raw.lower() not in _TRUE | _FALSE:
                raise PlanError(f"layout item {item!r}: use sp=1 or sp=0")
            values[field_name] = raw.lower() in _TRUE
        elif field_name == "expert_imbalance":
            try:
                values[field_name] = float(raw)
            except ValueError:
                raise PlanError(f"layout item {item!r}: {key} must be a number >= 1.0") from None
        else:
            try:
                values[field_name] = int(raw)
            except ValueError:
                raise PlanError(f"layout item {item!r}: {key} must be an integer") from None
    if values.get("vpp", 1) > 1 and "schedule" not in values:
        values["schedule"] = "interleaved"
    return LayoutSpec(**values)

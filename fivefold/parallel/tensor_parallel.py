"""Tensor parallelism (Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al. 2022).

The model stays plain PyTorch. A *plan* -- data, module name -> style -- says what happens to
each module, and `apply_plan` carries it out from outside: linear layers are swapped for
column- or row-parallel ones (keeping the attribute name `weight`, so parameter names stay
those of the full model), regions get their entry and exit collectives as hooks, and every
sharded parameter records its `Placement`.

A tensor-parallel region (attention, MLP, MoE) is entered once -- its input made whole on
every tp rank -- and left once -- the partial sums of the row-parallel layer reduced:

                 without sequence parallel           with sequence parallel
    entry        copy_to: identity / all-reduce       all-gather / reduce-scatter (dim 1)
    exit         reduce_from: all-reduce / identity   reduce-scatter / all-gather (dim 1)

so a layer costs two all-reduces of b*s*h forward and two backward, or the same volume as
all-gathers and reduce-scatters. The entry sits on the region (not on each column-parallel
layer) so that q, k and v, or gate and up, share one collective.

Gradients that are partial on each tp rank are summed by grad finalizers (run by the
optimizer's `finish_grad_sync`, once per step): the norm weights under sequence parallel
(each rank saw only its tokens), the MoE router (each rank saw only its slice of the
experts' output), and key/value heads that several tp ranks hold when tp exceeds the
number of kv heads (each copy saw only its rank's query heads). A finalizer reads and
writes `p.grad`, so an optimizer must run them while `p.grad` holds this rank's gradient --
before or after its own data-parallel reduction, since the two sums commute. Each names its
parameters (`ParamFinalizer`): ZeRO-2/3 keep only those gradients full until it has run. Every sharded
parameter records its `Placement` (tp dropped from `replicated_over`, dp_cp kept; repeated
kv heads carry `extra["repeat"] = {"tp": tp / kv}`), so data parallel and ZeRO shard and
reduce them like any other parameter, and the grad norm counts each element once.

Overlap (`layout.tp_overlap`): in backward, a region's entry returns the input gradient
after a reduce-scatter (all-reduce without SP) that nothing in the region needs, while the
column layers' weight gradients dW = dy^T x need only their own x and dy. With overlap the
column layers hand (x, dy) to their region's entry instead of computing dW, and the entry
starts its collective asynchronously, computes the region's dW while it travels, then waits
(Megatron's asynchronous grad-input communication). Same operations, so the same bits; only
the order changes. The entry returns the weight gradients from its own backward (the column
weights are its inputs), so they are accumulated within the one backward pass like every
other gradient: data parallel's and ZeRO's bucket counting, ZeRO-3's freeing of a block's
gathered parameters once all its gradients are in, and the zero-bubble pipeline's B (which
then holds them for W) work unchanged. Under train.compile the deferred linears run eagerly
between the block's compiled graphs. Whether it pays depends on whether communication and
matmuls use different resources (`benchmarks/bench_tp.py --probe` measures it).

Design choices:
- MoE under sequence parallel gathers the tokens before the block and reduce-scatters after
  it, exactly like the dense MLP. The router then sees whole sequences on every rank, so
  capacity ordering and the per-sequence auxiliary statistics are those of the
  single-process model without any extra hook; the price is the router's (tiny, E x h)
  matmul repeated on every tp rank.
- The auxiliary MoE loss is computed on every tp rank (its value is reported from tp rank 0)
  but only tp rank 0 back-propagates it, so the summed router gradient counts it once.
- Under sequence parallel the column-parallel layers keep the gathered input for backward
  (as DTensor's plans do) instead of gathering it again in backward (Megatron): the backward
  pass then has no extra all-gather, at the cost of 2*b*s*h saved elements per layer that
  are not divided by tp (see `fivefold.tools.saved_activations`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Iterable, TypeVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import Config, ModelConfig
from .mesh import Axis, Mesh
from ..model import MoE, Transformer
from ..model.step import LOSS_CHUNK_ELEMENTS
from ..rules.volumes import padded_vocab
from . import comm
from .deferred import PendingWeightGrad, deferred_linear, weight_grad
from .protocols import ParamFinalizer
from .sharding import Placement, Split, get_placement, set_placement

SEQ_DIM = 1  # activations are (B, T, C): sequence parallel splits T

Style = str | tuple[str, ...]
ParamRef = tuple[nn.Module, str]


# ----------------------------------------------------------------------------- region collectives


def region_input(x: torch.Tensor, axis: Axis, layout: str) -> torch.Tensor:
    """Make a region's input whole on every tp rank (Megatron's f, or SP's all-gather)."""
    if layout == "replicated":
        return comm.copy_to(x, axis)
    if layout == "sequence":
        # The gather along dim 1 comes back as a strided view; one contiguous copy here spares
        # every column-parallel layer a copy of its own (and the memory each would save).
        return comm.all_gather_to_full(x, axis, SEQ_DIM).contiguous()
    if layout == "ready":  # an enclosing region already did it
        return x
    raise ValueError(f"unknown input layout {layout!r}")


def region_output(y: torch.Tensor, axis: Axis, layout: str) -> torch.Tensor:
    """Sum a region's partial outputs over tp (Megatron's g, or SP's reduce-scatter)."""
    if layout == "replicated":
        return comm.reduce_from(y, axis)
    if layout == "sequence":
        return comm.reduce_scatter_to_shard(y, axis, SEQ_DIM)
    if layout == "partial":  # an enclosing region reduces it together with other partial sums
        return y
    raise ValueError(f"unknown output layout {layout!r}")


class _BackwardOnFirstRank(torch.autograd.Function):
    """Forward: identity. Backward: the gradient on tp rank 0, zero elsewhere.

    For a value every tp rank computes whole (the MoE auxiliary loss) but whose gradient
    flows into tensors whose gradients are later summed over tp: it must count once.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.keep = axis.rank == 0
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad if ctx.keep else torch.zeros_like(grad)), None


def backward_on_first_rank(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x if axis.size == 1 else _BackwardOnFirstRank.apply(x, axis)


# ----------------------------------------------------------------------------- overlapped entry


@dataclass
class PendingWeightGrads:
    """The weight gradients a region's column-parallel layers leave for the region's entry.

    One per region (or per layer that enters on its own). Each column layer names its weight
    in `weights` when the plan is applied. Backward reaches the column layers of one
    micro-batch's region, then its entry: each layer leaves (weight, x, dy) in `items`
    (parallel/deferred.py), the entry computes them while its input gradient travels.
    """

    weights: list[ParamRef] = field(default_factory=list)
    items: list[PendingWeightGrad] = field(default_factory=list)

    def trainable_weights(self) -> list[torch.Tensor]:
        """The layers' weights that want a gradient, resolved now (materialisation and ZeRO
        replace parameter objects after the plan is applied)."""
        return [w for w in _resolve(self.weights) if w.requires_grad]

    def take(self, weights: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """dW = dy^T x for each of `weights` (summed over its uses), in the weight's dtype;
        the items are dropped."""
        grads: dict[int, torch.Tensor] = {}
        for item in self.items:
            dw = weight_grad(item).to(item.weight.dtype)
            key = id(item.weight)
            grads[key] = dw if key not in grads else grads[key] + dw
        self.items.clear()
        missing = [i for i, w in enumerate(weights) if id(w) not in grads]
        if missing or len(grads) != len(weights):
            raise RuntimeError(f"a tensor-parallel region's column layers left {len(grads)} weight gradients "
                               f"for {len(weights)} weights; every column layer of a region must run in its forward")
        return [grads[id(w)] for w in weights]


class _OverlappedEntry(torch.autograd.Function):
    """A region's entry whose backward overlaps the input gradient's collective with the
    column-parallel layers' weight-gradient matmuls (Megatron's asynchronous grad-input
    communication).

    Forward: all-gather along the sequence (sequence parallel) or identity; the region's
    column weights are inputs too (their values unused), so that the weight gradients leave
    this node's backward like any other gradient: autograd accumulates them within the same
    backward pass (data parallel's and ZeRO's hooks and end-of-backward callbacks see one
    backward, and a backward that asks for gradients, like the zero-bubble pipeline's B,
    gets them). Backward: start the reduce-scatter (or all-reduce) of dx asynchronously,
    compute the region's pending dW = dy^T x while it is on the wire, then wait. dW needs
    only the layers' own x and dy, never the reduced dx: that is the data dependence the
    overlap uses.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis, layout: str, pending: PendingWeightGrads, *weights: torch.Tensor):
        ctx.axis, ctx.layout, ctx.pending, ctx.weights = axis, layout, pending, weights
        if layout == "sequence":
            return comm.all_gather(x, axis, dim=SEQ_DIM).contiguous()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        axis = ctx.axis
        if ctx.layout == "sequence":  # reduce-scatter along dim 0 of (T, B, C): the sequence
            reduced, work = comm.reduce_scatter(grad.transpose(0, 1).contiguous(), axis, async_op=True)
        else:
            reduced = grad.contiguous().clone()
            work = comm.all_reduce(reduced, axis, async_op=True)
        weight_grads = ctx.pending.take(ctx.weights)
        ctx.weights = ()
        work.wait()
        if ctx.layout == "sequence":
            reduced = reduced.transpose(0, 1)
        return (reduced, None, None, None, *weight_grads)


def overlapped_region_input(x: torch.Tensor, axis: Axis, layout: str, pending: PendingWeightGrads) -> torch.Tensor:
    """`region_input` whose backward overlaps communication with `pending`'s weight gradients."""
    if layout == "ready" or axis.size == 1:
        return region_input(x, axis, layout)
    if layout not in ("replicated", "sequence"):
        raise ValueError(f"unknown input layout {layout!r}")
    return _OverlappedEntry.apply(x, axis, layout, pending, *pending.trainable_weights())


# ----------------------------------------------------------------------------- parallel layers

# Under train.compile a deferred linear cannot be part of a graph (its backward leaves work in
# a Python list): marked eager, dynamo breaks the graph there without first trying to trace it.
_eager_deferred_linear = torch.compiler.disable(deferred_linear)


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T: this rank holds a slice of the output features (rows of W).

    pending: with `layout.tp_overlap`, the weight gradient is left there for the (region's or
    this layer's own) overlapped entry to compute while the input gradient is communicated.
    """

    def __init__(self, in_features: int, out_local: int, axis: Axis, input_layout: str = "ready",
                 device: torch.device | str | None = None, pending: PendingWeightGrads | None = None) -> None:
        super().__init__()
        self.axis, self.input_layout, self.pending = axis, input_layout, pending
        self.weight = nn.Parameter(torch.empty(out_local, in_features, device=device))
        if pending is not None:
            pending.weights.append((self, "weight"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pending is None:
            return F.linear(region_input(x, self.axis, self.input_layout), self.weight)  # (B, T, out/tp)
        x = overlapped_region_input(x, self.axis, self.input_layout, self.pending)
        return _eager_deferred_linear(x, self.weight, self.pending.items)

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out_local={self.weight.shape[0]}, input={self.input_layout}"


class RowParallelLinear(nn.Module):
    """y = sum over tp of x_local W_local^T: this rank holds a slice of the input features."""

    def __init__(self, in_local: int, out_features: int, axis: Axis, output_layout: str = "replicated",
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.axis, self.output_layout = axis, output_layout
        self.weight = nn.Parameter(torch.empty(out_features, in_local, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return region_output(F.linear(x, self.weight), self.axis, self.output_layout)

    def extra_repr(self) -> str:
        return f"in_local={self.weight.shape[1]}, out={self.weight.shape[0]}, output={self.output_layout}"


class VocabParallelEmbedding(nn.Module):
    """Each rank owns rows [start, start + n) of the (padded) table; lookups elsewhere give 0.

    The partial embeddings are then summed over tp (all-reduce), or summed and split along
    the sequence (reduce-scatter) under sequence parallel.
    """

    def __init__(self, vocab_local: int, hidden: int, vocab_start: int, axis: Axis, output_layout: str,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.vocab_start, self.axis, self.output_layout = vocab_start, axis, output_layout
        self.weight = nn.Parameter(torch.empty(vocab_local, hidden, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start  # (B, T)
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, C)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return region_output(rows, self.axis, self.output_layout)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Sum of token cross-entropies from vocab-sharded logits; the full logits never exist.

    logits (N, V/tp) in their own dtype, targets (N,). The max and the sum of exponentials
    are reduced over tp (one all-reduce of the max, one of [sum exp, target logit]); padding
    columns (global index >= vocab_size) are set to -inf, so they get zero probability and
    zero gradient. The logits are widened to fp32 a chunk of `rows` rows at a time, in the
    forward and again in the backward (which recomputes the chunk's softmax from the saved
    row max and sum), so neither the fp32 slice nor its softmax exists whole.
    """

    @staticmethod
    def forward(ctx, logits, targets, axis: Axis, vocab_start: int, vocab_size: int, rows: int):
        width = logits.shape[-1]
        local_target = targets - vocab_start
        mine = (local_target >= 0) & (local_target < width)
        local_target = local_target.masked_fill(~mine, 0)
        widen = partial(_widened_chunk, vocab_start=vocab_start, vocab_size=vocab_size)
        row_max = torch.cat([widen(chunk).max(dim=-1).values for chunk in logits.split(rows)])  # (N,)
        comm.all_reduce(row_max, axis, op="max")
        parts = []
        for chunk, top, target in zip(logits.split(rows), row_max.split(rows), local_target.split(rows)):
            shifted = widen(chunk) - top.unsqueeze(-1)  # (rows, V/tp) fp32
            parts.append(torch.stack([shifted.exp().sum(dim=-1), shifted.gather(1, target.unsqueeze(1)).squeeze(1)]))
        sums = torch.cat(parts, dim=1)  # (2, N)
        sums[1].masked_fill_(~mine, 0.0)
        comm.all_reduce(sums, axis)
        losses = sums[0].log() - sums[1]  # (N,)
        ctx.save_for_backward(logits, local_target, mine, row_max, sums[0])
        ctx.widen, ctx.rows = widen, rows
        return losses.sum()

    @staticmethod
    def backward(ctx, grad):
        logits, local_target, mine, row_max, exp_sum = ctx.saved_tensors
        out = torch.empty_like(logits)  # in the logits' dtype, as autograd's cast would give
        chunks = zip(logits.split(ctx.rows), local_target.split(ctx.rows), mine.split(ctx.rows),
                     row_max.split(ctx.rows), exp_sum.split(ctx.rows), out.split(ctx.rows))
        for chunk, target, own, top, total, dest in chunks:
            softmax = (ctx.widen(chunk) - top.unsqueeze(-1)).exp_().div_(total.unsqueeze(-1))
            g = softmax * grad  # d loss / d logits = (softmax - one_hot(target)) * grad
            rows = torch.arange(g.shape[0], device=g.device)
            g[rows, target] -= own.to(g.dtype) * grad
            dest.copy_(g)
        return out, None, None, None, None, None


def _widened_chunk(chunk: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """A chunk of this rank's logits in fp32, its padding columns (if any) -inf."""
    chunk = chunk.float()
    width = chunk.shape[-1]
    if vocab_start + width <= vocab_size:
        return chunk
    columns = torch.arange(vocab_start, vocab_start + width, device=chunk.device)
    return chunk.masked_fill(columns >= vocab_size, float("-inf"))


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, axis: Axis, vocab_size: int,
    chunk_elements: int = LOSS_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """SUM of token losses; logits (..., V_padded/tp) are this rank's vocabulary slice."""
    width = logits.shape[-1]
    flat = logits.reshape(-1, width)
    rows = max(1, chunk_elements // width)
    return _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), axis, axis.rank * width, vocab_size, rows)


def vocab_parallel_loss(mesh: Mesh, config: Config) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """loss_fn(logits_local, targets) -> SUM of token CE, for the head's vocab-sharded logits."""
    axis, vocab = mesh.tp, config.model.vocab_size

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, axis, vocab)

    return loss


# ----------------------------------------------------------------------------- the plan (data)

ATTENTION_PLAN: dict[str, Style] = {
    "attn_norm": "norm",
    "attn": "region",
    "attn.wq": "colwise",
    "attn.wk": "colwise_kv",
    "attn.wv": "colwise_kv",
    "attn.wo": "rowwise",
}
MLP_PLAN: dict[str, Style] = {
    "mlp_norm": "norm",
    "mlp": "region",
    "mlp.gate": "colwise",
    "mlp.up": "colwise",
    "mlp.down": "rowwise",
}
MOE_PLAN: dict[str, Style] = {
    "mlp_norm": "norm",
    "mlp": "moe",  # region entry/exit, experts split by FFN columns, router gradient summed
    "mlp.shared.gate": "colwise",
    "mlp.shared.up": "colwise",
    "mlp.shared.down": "rowwise_partial",  # reduced with the routed experts' output at the exit
}


def tensor_parallel_plan(model: Transformer) -> dict[str, Style]:
    """Module name -> style for every module of `model` (a whole model or a pipeline chunk)."""
    plan: dict[str, Style] = {}
    if model.embed is not None:
        plan["embed"] = "vocab"
    for index, block in model.layers.items():
        parts = dict(ATTENTION_PLAN)
        parts.update(MOE_PLAN if isinstance(block.mlp, MoE) else MLP_PLAN)
        if isinstance(block.mlp, MoE) and block.mlp.shared is None:
            parts = {k: v for k, v in parts.items() if not k.startswith("mlp.shared")}
        plan.update({f"layers.{index}.{name}": style for name, style in parts.items()})
    if model.has_head:
        plan["norm"] = "norm" if model.head is not None else ("norm", "tied_head_input")
        if model.head is not None:
            plan["head"] = "vocab_colwise"
    return plan


# ----------------------------------------------------------------------------- applying a plan


@dataclass
class _Applier:
    """What applying a plan needs and collects: the tp axis, the model, the finalizer work."""

    model: nn.Module
    axis: Axis
    config: ModelConfig
    sequence_parallel: bool
    overlap: bool = False  # layout.tp_overlap: entries overlap dx's collective with the column layers' dW
    # Parameters are named by (module, attribute), not held: materialisation replaces the
    # meta parameter objects after the plan is applied.
    sum_over_tp: list[ParamRef] = field(default_factory=list)  # partial on every tp rank
    repeated: dict[int, list[ParamRef]] = field(default_factory=dict)  # repeat -> kv copies
    regions: dict[str, PendingWeightGrads] = field(default_factory=dict)  # overlapped region -> its pending dW

    @property
    def entry(self) -> str:
        return "sequence" if self.sequence_parallel else "replicated"

    def pending_for(self, name: str, input_layout: str) -> PendingWeightGrads | None:
        """Where column layer `name` leaves its weight gradient under overlap: its own entry's
        list, or that of the innermost overlapped region enclosing it; None without overlap."""
        if not self.overlap:
            return None
        if input_layout != "ready":
            return PendingWeightGrads()
        parent = name.rpartition(".")[0]
        while parent and parent not in self.regions:
            parent = parent.rpartition(".")[0]
        return self.regions.get(parent)

    def replace_module(self, name: str, new: nn.Module) -> None:
        parent, _, child = name.rpartition(".")
        setattr(self.model.get_submodule(parent) if parent else self.model, child, new)


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def _module_of(kind: type[ModuleT], name: str, module: nn.Module) -> ModuleT:
    """`module` as the kind of module its style rewrites; a plan naming another kind is an error."""
    if not isinstance(module, kind):
        raise TypeError(f"tensor-parallel plan: {name} is a {type(module).__name__}; "
                        f"its style rewrites {kind.__name__} modules only")
    return module


def _shard_placement(old: torch.Tensor, name: str, split: Split, padded: tuple[int, ...] | None = None,
                     repeat: int = 1) -> Placement:
    base = get_placement(old, name)
    if padded is not None:
        base = replace(base, padded_shape=padded)
    placement = base.with_split(split, drop_axis="tp")
    if repeat > 1:
        repeats = dict(placement.extra.get("repeat", {}), tp=repeat)
        placement = replace(placement, extra=dict(placement.extra, repeat=repeats))
    return placement


def _colwise(app: _Applier, name: str, linear: nn.Module, count: int | None = None, repeat: int = 1,
             input_layout: str = "ready", padded_rows: int | None = None) -> nn.Module:
    """Swap `linear` for a column-parallel layer holding part (rank // repeat) of `count` equal parts."""
    module = _module_of(nn.Linear, name, linear)
    t = app.axis.size
    count = count or t
    rows = padded_rows or module.weight.shape[0]
    index = app.axis.rank // repeat
    new = ColumnParallelLinear(module.weight.shape[1], rows // count, app.axis, input_layout, module.weight.device,
                               app.pending_for(name, input_layout))
    padded = (rows, module.weight.shape[1]) if padded_rows else None
    set_placement(new.weight, _shard_placement(module.weight, f"{name}.weight", Split(0, index, count), padded, repeat))
    if repeat > 1:
        app.repeated.setdefault(repeat, []).append((new, "weight"))
    app.replace_module(name, new)
    return new


def _style_colwise(app: _Applier, name: str, module: nn.Module) -> None:
    _colwise(app, name, module)


def _style_colwise_kv(app: _Applier, name: str, module: nn.Module) -> None:
    """Key/value projections: split by kv heads, each head repeated on tp / kv ranks if needed."""
    kv, t = app.config.n_kv_heads, app.axis.size
    if kv % t == 0:
        _colwise(app, name, module)
    else:  # tp is a multiple of kv (layout.py checks): rank r holds kv head r // (tp / kv)
        _colwise(app, name, module, count=kv, repeat=t // kv)


def _rowwise(app: _Applier, name: str, linear: nn.Module, output_layout: str) -> None:
    module = _module_of(nn.Linear, name, linear)
    t = app.axis.size
    out_features, in_features = module.weight.shape
    new = RowParallelLinear(in_features // t, out_features, app.axis, output_layout, module.weight.device)
    set_placement(new.weight, _shard_placement(module.weight, f"{name}.weight", Split(1, app.axis.rank, t)))
    app.replace_module(name, new)


def _style_rowwise(app: _Applier, name: str, module: nn.Module) -> None:
    _rowwise(app, name, module, app.entry)


def _style_rowwise_partial(app: _Applier, name: str, module: nn.Module) -> None:
    _rowwise(app, name, module, "partial")


def _style_region(app: _Applier, name: str, module: nn.Module) -> None:
    """Enter the region once: its input is copied (or gathered) before the column layers."""
    axis, layout = app.axis, app.entry
    if app.overlap:  # the region's column layers (styled after it) leave their dW here
        pending = app.regions[name] = PendingWeightGrads()

        def enter(_module: nn.Module, args: tuple) -> tuple:
            return (overlapped_region_input(args[0], axis, layout, pending),) + tuple(args[1:])
    else:

        def enter(_module: nn.Module, args: tuple) -> tuple:
            return (region_input(args[0], axis, layout),) + tuple(args[1:])

    module.register_forward_pre_hook(enter)


def _style_moe(app: _Applier, name: str, module: nn.Module) -> None:
    """A MoE block as one region: experts split by FFN columns, output reduced once at the exit."""
    moe = _module_of(MoE, name, module)
    _style_region(app, name, moe)
    axis, layout = app.axis, app.entry

    def leave(_module: nn.Module, _args: tuple, output: tuple) -> tuple:
        y, aux = output
        return region_output(y, axis, layout), backward_on_first_rank(aux, axis)

    moe.register_forward_hook(leave)
    _split_experts(app, name, moe.experts)
    app.sum_over_tp.append((moe.router.gate, "weight"))


def _split_experts(app: _Applier, name: str, experts: nn.Module) -> None:
    """gate, up (E, f, h) split along f; down (E, h, f) split along f: each expert is column/row parallel."""
    t, r = app.axis.size, app.axis.rank
    for attr, dim in (("gate", 1), ("up", 1), ("down", 2)):
        old = getattr(experts, attr)
        shape = list(old.shape)
        shape[dim] //= t
        new = nn.Parameter(torch.empty(shape, device=old.device))
        set_placement(new, _shard_placement(old, f"{name}.experts.{attr}", Split(dim, r, t)))
        setattr(experts, attr, new)


def _style_norm(app: _Applier, name: str, module: nn.Module) -> None:
    """Under sequence parallel a norm sees 1/tp of the tokens: its weight gradient is summed."""
    if app.sequence_parallel:
        app.sum_over_tp.append((module, "weight"))


def _style_vocab(app: _Applier, name: str, embedding: nn.Module) -> None:
    module = _module_of(nn.Embedding, name, embedding)
    t, r = app.axis.size, app.axis.rank
    vocab, hidden = module.weight.shape
    rows = padded_vocab(vocab, t)
    new = VocabParallelEmbedding(rows // t, hidden, r * (rows // t), app.axis, app.entry, module.weight.device)
    set_placement(new.weight, _shard_placement(module.weight, f"{name}.weight", Split(0, r, t), (rows, hidden)))
    app.replace_module(name, new)


def _style_vocab_colwise(app: _Applier, name: str, module: nn.Module) -> None:
    """The output head: column parallel over the padded vocabulary, entered on its own."""
    head = _module_of(nn.Linear, name, module)
    _colwise(app, name, head, input_layout=app.entry, padded_rows=padded_vocab(head.weight.shape[0], app.axis.size))


def _style_tied_head_input(app: _Applier, name: str, module: nn.Module) -> None:
    """A tied head has no module of its own: its input (the final norm's output) is entered here."""
    axis, layout = app.axis, app.entry
    module.register_forward_hook(lambda _m, _a, out: region_input(out, axis, layout))


STYLES: dict[str, Callable[[_Applier, str, nn.Module], None]] = {
    "colwise": _style_colwise,
    "colwise_kv": _style_colwise_kv,
    "rowwise": _style_rowwise,
    "rowwise_partial": _style_rowwise_partial,
    "region": _style_region,
    "moe": _style_moe,
    "norm": _style_norm,
    "vocab": _style_vocab,
    "vocab_colwise": _style_vocab_colwise,
    "tied_head_input": _style_tied_head_input,
}


def apply_plan(model: nn.Module, plan: dict[str, Style], axis: Axis, config: ModelConfig,
               sequence_parallel: bool, overlap: bool = False) -> list[ParamFinalizer]:
    """Apply `plan` (module name -> style) to `model` in place; return the gradient finalizers.

    A region is styled before its column layers (plan order), so they find its entry.
    """
    app = _Applier(model, axis, config, sequence_parallel, overlap)
    for name, style in plan.items():
        for one in (style,) if isinstance(style, str) else style:
            if one not in STYLES:
                raise ValueError(f"unknown tensor-parallel style {one!r} for {name}; use one of {', '.join(STYLES)}")
            STYLES[one](app, name, model.get_submodule(name))
    return _finalizers(app)


def apply_tensor_parallel(chunk: Transformer, mesh: Mesh, config: Config) -> list[ParamFinalizer]:
    """Tensor (and sequence) parallelism for one model chunk, built on the meta device."""
    layout = config.layout
    return apply_plan(chunk, tensor_parallel_plan(chunk), mesh.tp, config.model, layout.sequence_parallel,
                      layout.tp_overlap)


# ----------------------------------------------------------------------------- gradient finalizers


def _finalizers(app: _Applier) -> list[ParamFinalizer]:
    out: list[ParamFinalizer] = []
    axis = app.axis
    if app.sum_over_tp:
        refs = list(app.sum_over_tp)
        out.append(ParamFinalizer(partial(_sum_over_axis, refs, axis), partial(_resolve, refs)))
    for repeat, copies in app.repeated.items():
        refs = list(copies)
        out.append(ParamFinalizer(partial(_sum_over_repeats, refs, axis, repeat), partial(_resolve, refs)))
    return out


def _sum_over_axis(refs: list[ParamRef], axis: Axis) -> None:
    sum_grads_over_axis(_resolve(refs), axis)


def _sum_over_repeats(refs: list[ParamRef], axis: Axis, repeat: int) -> None:
    sum_grads_over_repeats(_resolve(refs), axis, repeat)


def _resolve(refs: list[ParamRef]) -> list[nn.Parameter]:
    return [getattr(module, attr) for module, attr in refs]


def _flat_grads(params: Iterable[nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def _write_back(params: Iterable[nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        value = flat[offset : offset + n].view_as(p)
        if p.grad is None:
            p.grad = value.clone()
        else:  # in place: data parallel keeps .grad as a view of its flat bucket
            p.grad.copy_(value)
        offset += n


@torch.no_grad()
def sum_grads_over_axis(params: list[nn.Parameter], axis: Axis) -> None:
    """Sum partial gradients over the axis (one all-reduce of all of them)."""
    if axis.size == 1 or not params:
        return
    flat = _flat_grads(params)
    comm.all_reduce(flat, axis)
    _write_back(params, flat)


@torch.no_grad()
def sum_grads_over_repeats(params: list[nn.Parameter], axis: Axis, repeat: int) -> None:
    """Sum the gradients of parameters held by `repeat` consecutive ranks (a repeated kv head), over those ranks only.

    One all-reduce over the whole axis of a (groups, n) buffer in which each rank fills the
    row of its group: rows of other groups stay zero, so every group gets its own sum.
    """
    groups, mine = axis.size // repeat, axis.rank // repeat
    flat = _flat_grads(params)
    buffer = flat.new_zeros(groups, flat.numel())
    buffer[mine] = flat
    comm.all_reduce(buffer, axis)
    _write_back(params, buffer[mine])

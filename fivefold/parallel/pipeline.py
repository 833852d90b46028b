"""Pipeline parallelism: the stage split and one executor for every schedule table.

Stage split
    The model is cut into pp x vpp virtual stages of consecutive layers; stage 0 also holds
    the embedding and the last stage the final norm, the head and the loss. Without an
    explicit `layout.pp_layers`, the cut minimises the most expensive stage under a cost
    estimate (multiply-adds per token of each block, plus the head on the last stage).
    Virtual stage s lives on pipeline rank s % pp as its chunk s // pp, so with vpp > 1 a rank
    holds vpp chunks that are not adjacent in the model; under DualPipeV's V placement rank r
    holds stages r and 2 pp - 1 - r (`rules.placement`, the one description of both).

Executor
    `PipelineRunner` walks this rank's list of a table from `schedules.py`: compute actions
    run on the local chunk, each run of communication actions is one batched
    point-to-point call whose receives are waited for only by the compute that consumes
    them (so a rank never waits on its neighbour for data it does not need yet). Where the
    operations go ahead of their place depends on the backend:
    - NCCL (any backend but gloo) runs a rank's batches one after another on one stream, and
      a send larger than its buffering waits for the peer's receive: every operation is
      posted at its place in the table, in the table's batches, where a send sits in the
      same batch as the receives it meets. The tables are checked under exactly those rules
      (`schedules.simulate`), and so is the order the runner issues
      (`rules.p2p_order.check_p2p_order`, tests/parallel/test_pipeline_p2p_order.py).
    - gloo runs each operation on its own, each with its own handle: one waiting for its
      peer holds up nothing else. There a send is posted as soon as its tensor exists (the
      peer's receive then never waits for this rank to finish a later compute) and the next
      receives from each peer are posted ahead too (RECVS_AHEAD; gloo's sender waits for
      the receive to be posted).
    A stage output is freed as soon as it has been sent (its autograd node stays, which is
    all backward needs) and backward starts from it with the gradient received from the
    next stage. Where the next stage is another chunk of the same rank (the tip of the V),
    the output is handed over in memory, detached, and the input gradient comes back the
    same way: the table has no action for those transfers.

Zero-bubble weight step
    Under a schedule with BACKWARD_INPUT / BACKWARD_WEIGHT actions (zb-h1) the runner
    installs, once at build time, a `WeightGradDeferral` on each chunk: hooks on every
    module owning a 2-D weight (attention and MLP projections, the router, the head, their
    tensor-parallel versions) run that module's forward under `DeferWeightGrads`, a
    torch-function mode that routes its bias-free `F.linear` on the module's weight through
    `deferred_linear` (parallel/deferred.py); the rest of the forward runs untouched. Its
    backward returns only the input gradient and leaves (input, output gradient) behind, so the input-gradient step
    (B) is a full backward minus those matmuls and frees the graph; the gradients of the
    other parameters (norms, embedding, expert weights) are computed in B but held, not
    accumulated. The weight step (W) does the deferred work, dW = dy^T x for each linear,
    and accumulates every gradient of the micro-batch through autograd, so each
    parameter's accumulation hook fires once per micro-batch, in W, as data parallel's
    bucket counting expects. From the second micro-batch on, a linear weight's dW goes
    straight into its .grad (one GEMM that adds, no temporary and no second pass to add it:
    1F1B's backward computes dW and then adds it) and autograd's accumulation gets an empty
    zero gradient, so that the hooks still fire. Past one block of the GEMM's inner dimension
    (512 rows of a micro-batch on MKL) the GEMM adds each block's partial product in turn, so
    .grad differs from 1F1B's in the last bits: the order of a reduction changes, and parity
    holds within the fp32 tolerance, not bit for bit. The model stays plain PyTorch. Under
    recompute=full nothing is deferred (the recomputed forward would not rebuild the
    deferred linears): B then computes every gradient and W has nothing left to do; the
    same under train.compile (a compiled block's backward cannot leave its matmuls behind).

Gradients and the loss
    Every micro-batch's loss is CE_sum / (global_batch x seq_len) + aux / global_batch, as in
    `train.forward_backward`, so the sum over micro-batches and data-parallel ranks is the
    single-process loss. Data-parallel reduction happens once per step: every action runs
    under the optimizer's `no_sync()` except the forward and the weight-gradient backward of
    each chunk's last micro-batch, which let the reduction start (and overlap) there.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..config import Config, ModelConfig
from .mesh import Mesh
from ..model import Transformer
from ..rules.precision import PrecisionPolicy
from ..rules.stages import balanced_counts, head_cost, layer_cost  # noqa: F401  (the split lives in stages.py)
from ..rules.stages import stage_layer_counts as split_counts
from ..rules.stages import stage_layer_ids as split_ids
from . import comm
from .deferred import PendingWeightGrad, deferred_linear, weight_grad
from .optim import TORCH_DTYPES
from .protocols import ParamFinalizer, TrainingOptimizer
from ..rules.placement import Placement, placement_of, rank_chunk_of, stage_of
from ..rules.schedules import Action, ActionKind, build_schedule, group_steps
from ..model.step import autocast_for, sequence_scale, token_scale
from .sharding import get_placement, set_placement

TIED_AXIS = "pp_ends"  # the first and last pipeline ranks, which both hold the tied embedding
SEND_KINDS = (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)
RECV_KINDS = (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)
# Receives kept posted ahead per peer (one stage-boundary buffer each). gloo's sender waits
# until the receiver has posted its receive: one posted at its consumer costs a round trip
# between the two processes' transfer threads (0.3-0.7 ms idle, more on busy cores, on the
# critical path of 1F1B's steady state); one posted ahead finds the data there (~0.03 ms).
RECVS_AHEAD = 2


# ------------------------------------------------------------------------------ stage split


def stage_layer_counts(config: Config) -> list[int]:
    """Layers of each virtual stage: `layout.pp_layers` if given, else the balanced cut."""
    layout = config.layout
    return split_counts(config.model, config.train.seq_len, layout.pp, layout.vpp, layout.pp_layers)


def stage_layer_ids(config: Config) -> list[list[int]]:
    """Global layer indices of every virtual stage, in model order."""
    return split_ids(stage_layer_counts(config))


def build_stage_chunks(config: Config, mesh: Mesh) -> list[Transformer]:
    """This rank's model chunks, on the meta device: chunk c is the virtual stage
    `rules.placement.stage_of` names under the schedule's placement."""
    layout = config.layout
    ids = stage_layer_ids(config)
    last = len(ids) - 1
    placement = placement_of(layout.pp_schedule)
    chunks = []
    for c in range(layout.vpp):
        stage = stage_of(mesh.pp.rank, c, layout.pp, placement)
        with torch.device("meta"):
            chunk = Transformer(config.model, layer_ids=ids[stage], with_embedding=stage == 0, with_head=stage == last)
        chunks.append(chunk)
    mark_tied_copies(chunks, config.model)
    return chunks


def tied_copies(chunks: list[Transformer], model: ModelConfig) -> list[torch.Tensor]:
    """The local copies of a tied embedding: embed.weight on stage 0, head.weight on the last."""
    if not model.tied_embeddings:
        return []
    held = [chunk.embed.weight for chunk in chunks if chunk.embed is not None]
    return held + [chunk.head.weight for chunk in chunks if chunk.head is not None]


def mark_tied_copies(chunks: list[Transformer], model: ModelConfig) -> None:
    """Both copies are the one full tensor embed.weight, replicated over the pp ends.

    Idempotent, and keeps whatever split another strategy (vocab-parallel tp) recorded.
    """
    for param in tied_copies(chunks, model):
        placement = get_placement(param, "embed.weight")
        over = placement.replicated_over + (() if TIED_AXIS in placement.replicated_over else (TIED_AXIS,))
        set_placement(param, replace(placement, name="embed.weight", replicated_over=over))


def tied_gradient_finalizer(chunks: list[Transformer], mesh: Mesh, model: ModelConfig) -> ParamFinalizer | None:
    """Sum the gradients of the two tied copies over the first and last pipeline ranks.

    Built once the chunks are materialised (it holds their parameters)."""
    copies = tied_copies(chunks, model)
    if not copies or mesh[TIED_AXIS].size == 1:
        return None

    def finalize() -> None:
        for param in copies:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            comm.all_reduce(param.grad, mesh[TIED_AXIS])

    return ParamFinalizer(finalize, lambda: list(copies))


# ------------------------------------------------------------------ deferred weight gradients


class DeferWeightGrads(TorchFunctionMode):
    """While active, `F.linear(x, W)` with W one of `weights` defers W's gradient to `pending`
    and records id(W) in `deferred`."""

    def __init__(self, weights: set[int], pending: list[PendingWeightGrad], deferred: set[int] | None = None) -> None:
        super().__init__()
        self.weights, self.pending = weights, pending
        self.deferred: set[int] = set() if deferred is None else deferred  # ids of the weights routed here

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and self._deferrable(*args, **kwargs):
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            self.deferred.add(id(weight))
            return deferred_linear(x, weight, self.pending)
        return func(*args, **kwargs)

    def _deferrable(self, x, weight, bias=None) -> bool:
        return bias is None and torch.is_grad_enabled() and weight.requires_grad and id(weight) in self.weights


class WeightGradDeferral:
    """Routes the weight gradients of one chunk's linear layers to the weight step (W).

    Installed once, when the runner is built for a schedule with a W step, as hooks on
    every module that owns a 2-D weight; they do nothing outside `collect`, so evaluation
    and any other use of the chunk run the plain modules.

    A bias-free `nn.Linear` (attention and MLP projections, the router, the head) runs
    natively: a forward hook keeps its input x and hooks its output for dy. The weight's
    gradient is then simply not computed in B, which asks autograd only for the input
    gradient and the other parameters' gradients (autograd skips the weight half of each
    matmul's backward that nobody asked for). Other modules owning a 2-D weight (the
    tensor-parallel linears, whose matmul input is not the module's input under sequence
    parallelism) run their own forward under `DeferWeightGrads`. No other operation of the
    forward passes through Python (a mode around the whole forward intercepted every one,
    which cost ~10% of the forward).
    """

    def __init__(self, chunk: torch.nn.Module) -> None:
        self.weights = {id(p) for p in chunk.parameters() if p.requires_grad}
        self._target: tuple[list[PendingWeightGrad], set[int]] | None = None  # set by `collect`
        self._modes: list[DeferWeightGrads | None] = []  # one entry per module forward in progress
        for module in chunk.modules():
            weight = module._parameters.get("weight")
            if weight is None or weight.ndim != 2 or not weight.requires_grad:
                continue
            if isinstance(module, torch.nn.Linear) and module.bias is None:
                module.register_forward_hook(self._keep_input_and_output_grad)
            else:
                module.register_forward_pre_hook(self._enter)
                module.register_forward_hook(self._exit, always_call=True)

    @contextlib.contextmanager
    def collect(self, pending: list[PendingWeightGrad]) -> Iterator[set[int]]:
        """Defer inside: (x, dy) pairs go to `pending`; yields the ids of the deferred weights.

        The caller's backward must not ask for the deferred weights' gradients (B asks
        `torch.autograd.grad` for the others only); W computes them from `pending`.
        """
        deferred: set[int] = set()
        self._target = (pending, deferred)
        try:
            yield deferred
        finally:
            self._target = None

    def _keep_input_and_output_grad(self, module: torch.nn.Linear, args, output: torch.Tensor) -> None:
        if self._target is None or not (torch.is_grad_enabled() and output.requires_grad):
            return
        pending, deferred = self._target
        weight, x = module.weight, args[0]
        deferred.add(id(weight))
        output.register_hook(lambda dy: pending.append(PendingWeightGrad(weight, x, dy)))

    def _enter(self, module: torch.nn.Module, args) -> None:
        mode = None
        if self._target is not None and torch.is_grad_enabled():
            mode = DeferWeightGrads(self.weights, *self._target)
            mode.__enter__()
        self._modes.append(mode)

    def _exit(self, module: torch.nn.Module, args, output) -> None:
        mode = self._modes.pop()
        if mode is not None:
            mode.__exit__(None, None, None)


class _GradientLink(torch.autograd.Function):
    """One link of the weight step's chain: identity on `link` whose backward hands
    `param` the gradient `compute()` makes at that moment.

    Autograd runs a parameter's accumulation as soon as its gradient is ready (before the
    next link), so the weight step holds one weight gradient at a time instead of all of
    them: materialising every dW of a chunk at once made the allocator grow and trim the
    heap by that much per micro-batch, and the page faults cost ~20% of the step's W time.
    """

    @staticmethod
    def forward(ctx, link: torch.Tensor, param: torch.Tensor, compute):
        ctx.compute = compute
        return link.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad if ctx.needs_input_grad[0] else None, ctx.compute(), None


def _takes_in_place(param: torch.Tensor, items: list[PendingWeightGrad]) -> bool:
    """Whether `param.grad` can take every dy^T x of `items` in place: it holds an earlier
    micro-batch's gradient, dense, in the dtype of each x and dy."""
    grad = param.grad
    if grad is None or grad.layout != torch.strided or not grad.is_contiguous():
        return False
    return all(item.input.dtype == item.output_grad.dtype == grad.dtype for item in items)


def _no_further_gradient(param: torch.Tensor) -> torch.Tensor:
    """A zero gradient with no elements (sparse), for a parameter whose gradient W already
    added in place: autograd's accumulation and its hooks (data parallel's bucket
    counting) still run once per micro-batch, as for any other parameter, at no cost."""
    indices = torch.empty((param.ndim, 0), dtype=torch.long, device=param.device)
    values = torch.empty(0, dtype=param.dtype, device=param.device)
    return torch.sparse_coo_tensor(indices, values, param.shape, check_invariants=False, is_coalesced=True)


def _weight_gradient(param: torch.Tensor, items: list[PendingWeightGrad], held: torch.Tensor | None):
    """A function computing `param`'s whole gradient of one micro-batch: what B held plus
    dy^T x of each deferred use of it; it drops (x, dy) as it goes.

    A weight only deferred uses reach, whose .grad already holds an earlier micro-batch's
    gradient, takes each dy^T x in place as one GEMM that adds into .grad (beta = 1):
    no dW temporary, and no second pass that reads it and .grad again to add them.
    """

    def compute() -> torch.Tensor | None:
        if held is None and items and _takes_in_place(param, items):
            assert param.grad is not None  # _takes_in_place: an earlier micro-batch's gradient is there
            while items:
                item = items.pop(0)
                dy, x = item.output_grad, item.input
                param.grad.addmm_(dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
            return _no_further_gradient(param)
        grad = held
        while items:
            dw = weight_grad(items.pop(0)).to(param.dtype)
            grad = dw if grad is None else dw + grad
        return grad

    return compute


def apply_deferred_weight_grads(pending: list[PendingWeightGrad], held: dict | None = None,
                                order: list[torch.Tensor] | None = None) -> None:
    """The weight step: every deferred dW = dy^T x, plus the gradients B `held` (id ->
    (parameter, gradient)), accumulated into the parameters by one autograd call, so a
    backward-end callback (ZeRO's per-backward reduction) sees one backward.

    Parameters are accumulated in `order` (the chunk's parameters; those absent follow in
    the order they were deferred), each gradient computed just before its accumulation.
    """
    uses: dict[int, list[PendingWeightGrad]] = {}
    params: dict[int, torch.Tensor] = {}
    for item in pending:
        uses.setdefault(id(item.weight), []).append(item)
        params[id(item.weight)] = item.weight
    held = held or {}
    params.update({key: param for key, (param, _) in held.items()})
    ranked = [id(p) for p in (order or []) if id(p) in params]
    keys = ranked + [key for key in params if key not in set(ranked)]
    pending.clear()
    if not keys:
        return
    link = torch.zeros(())
    for key in reversed(keys):  # the last link built runs first
        grad = held[key][1] if key in held else None
        link = _GradientLink.apply(link, params[key], _weight_gradient(params[key], uses.get(key, []), grad))
    held.clear()
    uses.clear()
    torch.autograd.backward([link], [torch.zeros(())])


# ---------------------------------------------------------------------------------- runner


def forward_only(actions: list[Action]) -> list[Action]:
    """A rank's list without backward work: what evaluation runs.

    Dropping the backward computes and gradient transfers keeps the one global order of
    the remaining transfers, so the shorter table cannot deadlock either.
    """
    keep = (ActionKind.FORWARD, ActionKind.SEND_ACT, ActionKind.RECV_ACT)
    return [a for a in actions if a.kind in keep]


def release_storage(tensor: torch.Tensor) -> None:
    """Free a sent stage output but keep its autograd node.

    The data becomes one element broadcast to the old shape, so `torch.autograd.backward`
    still accepts it with a gradient of the real shape. Safe because nothing in autograd
    saved this tensor: a chunk ends with a residual addition.
    """
    tensor.data = torch.empty((), dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)


@dataclass
class _Unit:
    """One (micro-batch, chunk) between its forward and the end of its backward."""

    input: torch.Tensor | None  # received activation (requires grad); None on stage 0
    heads: list[torch.Tensor]  # what backward starts from: the stage output or the loss, then aux
    output: torch.Tensor | None  # the stage output to send; None on the last stage
    saved_bytes: int = 0
    output_grads: list | None = None
    pending_weight_grads: list[PendingWeightGrad] = field(default_factory=list)  # B leaves them for W
    deferred: set[int] = field(default_factory=set)  # ids of the weights whose gradient W computes
    held_grads: dict = field(default_factory=dict)  # id -> (parameter, gradient) computed by B for W


@dataclass
class _StepState:
    """Buffers of one run of a table, keyed by (micro-batch, chunk)."""

    micro_batches: list
    loss_sum: torch.Tensor
    aux_sum: torch.Tensor
    units: dict = field(default_factory=dict)
    acts: dict = field(default_factory=dict)  # received activations
    grads: dict = field(default_factory=dict)  # received output gradients
    input_grads: dict = field(default_factory=dict)  # gradients to send back
    pending_sends: list = field(default_factory=list)  # (work, output to free or None)
    unposted_sends: dict = field(default_factory=dict)  # peer -> this run's sends not posted yet, in list order
    unposted_recvs: dict = field(default_factory=dict)  # peer -> this run's receives not posted yet, in list order
    recv_peers: dict = field(default_factory=dict)  # (receive kind, micro-batch, chunk) posted, not consumed -> peer
    arrivals: dict = field(default_factory=dict)  # (receive kind, micro-batch, chunk) -> work in flight
    live_bytes: int = 0
    peak_bytes: int = 0
    peak_units: int = 0


@dataclass
class StepMemory:
    """Activation memory of this rank's last step: units alive at once and their saved bytes."""

    peak_units: int
    peak_saved_bytes: int  # 0 unless `measure_memory` was set


class StepRecorder(Protocol):
    """What the runner reports while it runs a step (observe/timeline.py's `Timeline` is one)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def record(self, kind: str, microbatch: int, chunk: int) -> contextlib.AbstractContextManager: ...


Recorder = TypeVar("Recorder", bound=StepRecorder)


class PipelineRunner:
    """Runs this rank's list of the configured schedule for one step (or evaluation).

    `optimizer` is asked only for `no_sync()` (gradient reductions wait for the last backward
    of each chunk); `loss_fn` turns the last stage's output into the summed token loss.
    """

    def __init__(
        self, config: Config, mesh: Mesh, chunks: list[Transformer], optimizer: TrainingOptimizer,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device,
    ) -> None:
        layout = config.layout
        self.config, self.mesh, self.chunks = config, mesh, chunks
        self.optimizer, self.loss_fn, self.device = optimizer, loss_fn, device
        self.pp, self.vpp, self.rank = layout.pp, layout.vpp, mesh.pp.rank
        self.placement: Placement = placement_of(layout.pp_schedule)
        self.num_microbatches = layout.grad_accum
        self.last_stage = layout.pp * layout.vpp - 1
        row = build_schedule(layout.pp_schedule, layout.pp, layout.grad_accum, layout.vpp)[self.rank]
        self.steps = group_steps(row)
        self.eval_steps = group_steps(forward_only(row))
        self.synced = _synced_actions(row, per_chunk=self.placement == "loop")
        # What stages exchange is the residual stream: fp32 under autocast over fp32 weights,
        # bf16 with bf16 weights (as in the single process, which never widens it)
        self.boundary_dtype = TORCH_DTYPES[PrecisionPolicy.from_train(config.train).residual]
        self.sp_factor = layout.tp if layout.sequence_parallel else 1
        # Only where operations run independently may they leave the table's batches (see the module docstring)
        independent = _operations_run_independently(mesh.pp.group)
        self.sends_ahead = independent
        self.recvs_ahead = RECVS_AHEAD if independent else 0
        self.params: list[list[torch.Tensor]] = [
            [p for p in chunk.parameters() if p.requires_grad] for chunk in self.chunks
        ]
        # Full recomputation replays a block's forward inside backward, where the deferral
        # does not collect: nothing would be deferred, so W is then empty (B does all). So too
        # under train.compile: a compiled block's backward is one node that computes its
        # weight gradients with its input gradient.
        self.split_weight_grads = (
            any(a.kind is ActionKind.BACKWARD_WEIGHT for a in row) and layout.recompute != "full" and not config.train.compile
        )
        self.params_reversed = [params[::-1] for params in self.params]  # W accumulates as backward would
        self.deferrals = [WeightGradDeferral(chunk) for chunk in self.chunks] if self.split_weight_grads else []
        self.recorder: StepRecorder | None = None  # set by `recording`
        self.measure_memory = False
        self.memory = StepMemory(0, 0)
        mark_tied_copies(self.chunks, config.model)  # parallelize() registers tied_gradient_finalizer

    # ----------------------------------------------------------------- public entry points

    @contextlib.contextmanager
    def recording(self, recorder: Recorder) -> Iterator[Recorder]:
        """Report every step run inside to `recorder` (a timeline: each compute and transfer)."""
        self.recorder = recorder
        try:
            yield recorder
        finally:
            self.recorder = None

    def run(self, micro_batches: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of every micro-batch. Returns this rank's (CE sum, aux sum)."""
        st = self._start(micro_batches)
        self._execute(self.steps, st, training=True)
        self._finish(st)
        return st.loss_sum, st.aux_sum  # on the device: the step reads them once, after reporting

    @torch.no_grad()
    def evaluate(self, micro_batches: list) -> torch.Tensor:
        """Forward only; returns the CE sum on the last stage (zero elsewhere)."""
        st = self._start(micro_batches)
        self._execute(self.eval_steps, st, training=False)
        self._finish(st)
        return st.loss_sum

    # -------------------------------------------------------------------------- execution

    def _start(self, micro_batches: list) -> _StepState:
        if len(micro_batches) != self.num_microbatches:
            raise ValueError(
                f"the pipeline schedule was built for {self.num_microbatches} micro-batches "
                f"(layout.grad_accum), got {len(micro_batches)}"
            )
        device = self.device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        if self.recorder is not None:
            comm.all_reduce(torch.zeros(1, device=device), self.mesh.pp)  # line the stages up: a common time zero
            self.recorder.start()
        return _StepState(list(micro_batches), zero.clone(), zero.clone())

    def _finish(self, st: _StepState) -> None:
        with self._record("comm", Action(ActionKind.SEND_ACT, -1)):
            self._complete_sends(st, wait=True)
        if self.recorder is not None:
            self.recorder.stop()
        left = {k: len(v) for k, v in (("units", st.units), ("acts", st.acts), ("grads", st.grads),
                                       ("input_grads", st.input_grads), ("arrivals", st.arrivals),
                                       ("posted receives", st.recv_peers)) if v}
        if left:
            raise RuntimeError(f"pipeline rank {self.rank}: buffers left after the schedule: {left}")
        self.memory = StepMemory(st.peak_units, st.peak_bytes)

    def _execute(self, steps: list[tuple[Action, ...]], st: _StepState, training: bool) -> None:
        st.unposted_sends = _sends_by_peer(steps) if self.sends_ahead else {}
        st.unposted_recvs = _by_peer(steps, RECV_KINDS) if self.recvs_ahead else {}
        self._post_ahead(st, training)
        for step in steps:
            first = step[0]
            if first.kind.is_comm:
                with self._record("comm", first):
                    self._communicate(step, st, training)
                continue
            self._await_input(first, st)
            with self._record(first.kind.value, first), self._sync_context(first, training):
                if first.kind is ActionKind.FORWARD:
                    self._forward(first, st, training)
                else:
                    self._backward(first, st)
            self._post_ahead(st, training, first)

    def _post_ahead(self, st: _StepState, training: bool, after: Action = Action(ActionKind.SEND_ACT, -1)) -> None:
        """Post the sends and receives that can go ahead of their place in the list."""
        ready = self._ready_sends(st, training) + self._early_recvs(st)
        if ready:
            with self._record("comm", after):
                self._communicate(ready, st, training)

    def _ready_sends(self, st: _StepState, training: bool) -> tuple[Action, ...]:
        """Sends that can be posted now, ahead of their place in the list: per peer, the
        leading run of the sends not posted yet whose tensors exist.

        A table places a send where both ends meet in its planned timeline, which can be a
        compute or two after the tensor exists; posting it at once lets the transfer start
        as soon as the peer posts its receive, so a late sender never holds up the peer's
        next compute. Sends to one peer keep their list order (point-to-point messages
        match first-in first-out). Only on gloo (`sends_ahead`), where a send runs on its
        own and blocks nothing else, so posting one earlier can only make a receive complete
        earlier: the table's deadlock freedom holds. Under NCCL a send in a batch of its own
        holds up every later batch of its rank until the peer's receive runs, and the peer may
        be waiting on one of those (1F1B, pp=2: rank 0's next activation against rank 1's
        gradient): there every send stays in the batch the table gives it.
        """
        ready: list[Action] = []
        for queue in st.unposted_sends.values():
            for a in queue:
                key = (a.microbatch, a.chunk)
                exists = key in st.units if a.kind is ActionKind.SEND_ACT else key in st.input_grads
                if not exists:
                    break
                ready.append(a)
        return tuple(ready)

    def _early_recvs(self, st: _StepState) -> tuple[Action, ...]:
        """Receives that can be posted now, ahead of their place: per peer, the next ones in
        list order while fewer than `recvs_ahead` posted ones wait for their consumer.

        Receives from a peer keep their list order (the n-th matches the peer's n-th send);
        posting one never blocks and each is still waited for only by its consumer, so the
        table's deadlock freedom holds. Only on gloo (`recvs_ahead` > 0), where every
        operation runs on its own: under NCCL a receive in a batch of its own would hold up
        the rank's later batches, and its one handle would be waited for at once, too early.
        """
        ready: list[Action] = []
        for peer, queue in st.unposted_recvs.items():
            waiting = sum(1 for p in st.recv_peers.values() if p == peer)
            ready += list(queue)[: max(0, self.recvs_ahead - waiting)]
        return tuple(ready)

    def _await_input(self, action: Action, st: _StepState) -> None:
        """Wait for the receive this compute consumes, if it is still in flight."""
        kind = ActionKind.RECV_ACT if action.kind is ActionKind.FORWARD else ActionKind.RECV_GRAD
        st.recv_peers.pop((kind, action.microbatch, action.chunk), None)
        work = st.arrivals.pop((kind, action.microbatch, action.chunk), None)
        if work is not None:
            with self._record("comm", action):
                work.wait()

    def _record(self, kind: str, action: Action) -> contextlib.AbstractContextManager:
        if self.recorder is None:
            return contextlib.nullcontext()
        return self.recorder.record(kind, action.microbatch, action.chunk)

    def _sync_context(self, action: Action, training: bool) -> contextlib.AbstractContextManager:
        if not training or (action.kind, action.microbatch, action.chunk) in self.synced:
            return contextlib.nullcontext()
        return self.optimizer.no_sync()

    # --------------------------------------------------------------------------- compute

    def _forward(self, action: Action, st: _StepState, training: bool) -> None:
        key, chunk = (action.microbatch, action.chunk), self.chunks[action.chunk]
        stage = stage_of(self.rank, action.chunk, self.pp, self.placement)
        batch = st.micro_batches[action.microbatch]
        x = batch.inputs if stage == 0 else st.acts.pop(key)
        if stage > 0 and training:
            x.requires_grad_()
        device = self.device
        train = self.config.train
        pending: list[PendingWeightGrad] = []
        deferral = self._deferral(action.chunk, pending, training)
        with self._count_saved(chunk) as saved, autocast_for(self.config, device), deferral as deferred:
            out, aux = chunk(x, batch.positions, batch.documents)
            ce = self.loss_fn(out, batch.targets) if stage == self.last_stage else None
        if ce is not None:
            st.loss_sum += ce.detach().double()
        if aux is not None:
            st.aux_sum += aux.detach().double()
        local_next = self._local_chunk(stage + 1) if ce is None else None
        if not training:
            if local_next is not None:
                st.acts[(action.microbatch, local_next)] = out.to(self.boundary_dtype)
            elif ce is None:
                st.units[key] = _Unit(None, [], out.to(self.boundary_dtype))
            return
        aux_loss = [aux * sequence_scale(train)] if aux is not None else []
        if ce is not None:
            loss = ce * token_scale(train)
            heads, output = [loss + aux_loss[0] if aux_loss else loss], None
        else:
            output = out.to(self.boundary_dtype)
            heads = [output] + aux_loss
            if local_next is not None:  # no message: the next chunk's input is this output, detached
                st.acts[(action.microbatch, local_next)] = output.detach()
        st.units[key] = _Unit(x if stage > 0 else None, heads, output, saved[0], pending_weight_grads=pending,
                              deferred=deferred or set())
        st.live_bytes += saved[0]
        st.peak_bytes = max(st.peak_bytes, st.live_bytes)
        st.peak_units = max(st.peak_units, len(st.units))

    def _backward(self, action: Action, st: _StepState) -> None:
        key = (action.microbatch, action.chunk)
        unit = st.units[key]
        if unit.output_grads is None:
            unit.output_grads = [st.grads.pop(key, None)] + [None] * (len(unit.heads) - 1)
        if action.kind is ActionKind.BACKWARD_INPUT:
            self._input_step(unit, action.chunk, st, key)
            return
        if action.kind is ActionKind.BACKWARD_WEIGHT:  # B already freed the graph: only the deferred matmuls
            apply_deferred_weight_grads(unit.pending_weight_grads, unit.held_grads, self.params_reversed[action.chunk])
        else:
            torch.autograd.backward(unit.heads, unit.output_grads)
            if unit.input is not None:
                self._hand_back(key, unit.input.grad, st)
        del st.units[key]
        st.live_bytes -= unit.saved_bytes

    def _input_step(self, unit: _Unit, chunk: int, st: _StepState, key: tuple[int, int]) -> None:
        """B: the input gradient, and the gradients of the parameters W does not compute, held."""
        others = [p for p in self.params[chunk] if id(p) not in unit.deferred]
        inputs = ([unit.input] if unit.input is not None else []) + others
        grads = torch.autograd.grad(unit.heads, inputs, unit.output_grads, allow_unused=True)
        if unit.input is not None:
            self._hand_back(key, grads[0], st)
            grads = grads[1:]
        unit.held_grads = {id(p): (p, g) for p, g in zip(others, grads) if g is not None}
        unit.heads = []  # the graph is freed; W needs only what B left behind

    def _local_chunk(self, stage: int) -> int | None:
        """This rank's chunk holding `stage`, or None where another rank holds it (or no
        such stage exists)."""
        if not 0 <= stage <= self.last_stage:
            return None
        rank, chunk = rank_chunk_of(stage, self.pp, self.placement)
        return chunk if rank == self.rank else None

    def _hand_back(self, key: tuple[int, int], input_grad: torch.Tensor, st: _StepState) -> None:
        """Keep a chunk's input gradient for its SEND_GRAD, or give it straight to the chunk of
        this rank that produced the input, as the output gradient its backward waits for."""
        microbatch, chunk = key
        local_prev = self._local_chunk(stage_of(self.rank, chunk, self.pp, self.placement) - 1)
        if local_prev is None:
            st.input_grads[key] = input_grad
        else:
            st.grads[(microbatch, local_prev)] = input_grad

    def _deferral(self, chunk: int, pending: list[PendingWeightGrad], training: bool):
        if not (training and self.deferrals):
            return contextlib.nullcontext()
        return self.deferrals[chunk].collect(pending)

    @contextlib.contextmanager
    def _count_saved(self, chunk: Transformer) -> Iterator[list[int]]:
        """Bytes autograd saves for backward during a forward (parameters excluded)."""
        total = [0]
        if not self.measure_memory or not torch.is_grad_enabled():
            yield total
            return
        weights = {p.data_ptr() for p in chunk.parameters()}
        seen: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in weights and ptr not in seen:
                seen.add(ptr)
                total[0] += storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield total

    # --------------------------------------------------------------------- communication

    def _boundary(self, st: _StepState, microbatch: int) -> torch.Tensor:
        """An empty stage-boundary tensor (b, t, hidden); sequence parallel splits t over tp."""
        inputs = st.micro_batches[microbatch].inputs  # (b, t) on every rank
        b, t = inputs.shape
        return torch.empty((b, t // self.sp_factor, self.config.model.hidden), dtype=self.boundary_dtype,
                           device=inputs.device)

    def _communicate(self, step: tuple[Action, ...], st: _StepState, training: bool) -> None:
        """Post one batch. Sends complete in the background (this rank moves on; under NCCL
        the batch's stream waits for the peer's matching receive, which the table puts in a
        batch of the peer's that meets this one), and a sent output is freed once its send is done.
        A receive is waited for just before the compute that consumes it (`_await_input`),
        not here: the table may place it a compute or two early (where both ends meet in the
        planned timeline), and waiting there would make a rank wait for its neighbour's
        jitter on data it does not need yet."""
        sends: list[tuple[torch.Tensor, int]] = []
        recvs: list[tuple[torch.Tensor, int]] = []
        sent_outputs: list[torch.Tensor | None] = []
        arriving: list[tuple[ActionKind, int, int]] = []
        for a in step:
            key, peer = (a.microbatch, a.chunk), a.peer
            assert peer is not None, f"{a} names no peer"  # every communication action of a table does
            unposted = st.unposted_sends if a.kind in SEND_KINDS else st.unposted_recvs
            if peer in unposted:
                queue = unposted[peer]
                if not queue or queue[0] != a:
                    continue  # posted ahead of its place (`_ready_sends`, `_early_recvs`)
                queue.popleft()
            if a.kind is ActionKind.SEND_ACT:
                unit = st.units[key] if training else st.units.pop(key)
                sends.append((unit.output.detach(), peer))
                sent_outputs.append(unit.output if training else None)
            elif a.kind is ActionKind.SEND_GRAD:
                sends.append((st.input_grads.pop(key), peer))
                sent_outputs.append(None)
            else:
                buffer = self._boundary(st, a.microbatch)
                (st.acts if a.kind is ActionKind.RECV_ACT else st.grads)[key] = buffer
                st.recv_peers[(a.kind, *key)] = peer
                recvs.append((buffer, peer))
                arriving.append((a.kind, *key))
        works = comm.send_recv(self.mesh.pp, sends, recvs)
        if len(works) != len(sends) + len(recvs):  # one handle for a coalesced batch (NCCL)
            st.pending_sends += [(work, None) for work in works]
            self._complete_sends(st, wait=True)
            for output in filter(None, sent_outputs):
                release_storage(output)
            return
        st.pending_sends += list(zip(works[: len(sends)], sent_outputs))
        st.arrivals.update(zip(arriving, works[len(sends) :]))
        self._complete_sends(st, wait=False)

    def _complete_sends(self, st: _StepState, wait: bool) -> None:
        """Free the outputs whose sends are done (all of them, waiting, when `wait`)."""
        pending = []
        for work, output in st.pending_sends:
            if wait:
                work.wait()
            elif not work.is_completed():
                pending.append((work, output))
                continue
            if output is not None:
                release_storage(output)
        st.pending_sends = pending


def _sends_by_peer(steps: list[tuple[Action, ...]]) -> dict[int, deque[Action]]:
    """The send actions of a rank's steps, per peer, in list order."""
    return _by_peer(steps, SEND_KINDS)


def _by_peer(steps: list[tuple[Action, ...]], kinds: tuple[ActionKind, ...]) -> dict[int, deque[Action]]:
    """The communication actions of `kinds` in a rank's steps, per peer, in list order."""
    out: dict[int, deque[Action]] = {}
    for step in steps:
        for a in step:
            if a.kind in kinds and a.peer is not None:
                out.setdefault(a.peer, deque()).append(a)
    return out


def _synced_actions(row: list[Action], per_chunk: bool = True) -> set[tuple[ActionKind, int, int]]:
    """Actions that run outside `no_sync`: per chunk, the forward and the weight-gradient
    backward of the last micro-batch whose weight gradient is computed.

    With `per_chunk` False only the row's very last weight-gradient backward is synced (the
    forwards stay per chunk). Data-parallel buckets span the chunks of a rank and count the
    gradients that arrive; under the V placement the two chunks' last weight steps are
    interleaved with each other's earlier ones, so a bucket's count lines up with whole
    micro-batches only once the rank's last weight step is done.
    """
    last: dict[int, Action] = {}
    final: Action | None = None
    for a in row:
        if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
            last[a.chunk] = final = a
    synced = set()
    for chunk, a in last.items():
        if per_chunk or a is final:
            synced.add((a.kind, a.microbatch, chunk))
        synced.add((ActionKind.FORWARD, a.microbatch, chunk))
    return synced


def _operations_run_independently(group) -> bool:
    """Whether the point-to-point operations of a batch on `group` each run on their own,
    with a handle each (gloo), rather than as one coalesced group that runs after the
    rank's earlier groups and returns one handle (NCCL and any other backend)."""
    return group is not None and torch.distributed.get_backend(group) == "gloo"

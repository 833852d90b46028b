"""Mixture-of-Experts block: router, SwiGLU experts, optional shared experts (plain PyTorch).

Layout-independent definitions, so every parallel layout reproduces the single-process model:
- Capacity is per sequence: each expert accepts at most ceil(capacity_factor * T * k / E)
  token-slots of one sequence, by priority: all first choices before second choices, and
  within a choice rank, earlier positions first (GShard's order).
- The auxiliary losses are per sequence and then summed over sequences; the training loop
  divides by the global batch. Load balance (Switch Transformer / GShard):
  E * sum_e f_e * P_e, with f_e the fraction of the sequence's k*T assignments routed to
  expert e and P_e the mean router probability of e. Router z-loss (ST-MoE): mean over
  tokens of logsumexp(logits)^2.

Parallel layouts plug in through two attributes, set from outside:
- `dispatcher`: takes the kept token-slots' rows grouped by expert and returns the experts'
  outputs in the same order (expert parallel swaps it for one that runs them where they live);
- `token_stats_reduce`: sums per-sequence statistics over the ranks that hold other tokens
  of the same sequences (context and sequence parallel set it).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from .mlp import MLP

# Buffer names, written once: every module that finds these buffers by name uses them.
EXPERT_BIAS = "expert_bias"  # the router's balancing bias: model state, checkpointed
TOKENS_PER_EXPERT = "tokens_per_expert"  # token-slots routed to each expert this step
DROPPED_SLOTS = "dropped_slots"  # token-slots over capacity this step
ROUTING_COUNTERS = (TOKENS_PER_EXPERT, DROPPED_SLOTS)  # per-step statistics the loop reads and resets: not state


class Experts(nn.Module):
    """E SwiGLU experts with stacked weights: gate, up (E, f, h) and down (E, h, f).

    `kernel` picks how the groups of rows are multiplied; all give the same values:
    "grouped" (torch._grouped_mm, one call per matrix), "padded" (pad every group to the
    largest and use one batched matmul), "loop" (one matmul per expert), or "auto" (grouped
    where torch supports it for these tensors, else loop). benchmarks/bench_ep.py compares them.
    """

    KERNELS = ("auto", "grouped", "padded", "loop")

    def __init__(self, num_experts: int, hidden: int, ffn: int, kernel: str = "auto") -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.up = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        if kernel not in self.KERNELS:
            raise ValueError(f"expert kernel {kernel!r} is unknown; use one of {self.KERNELS}")
        self.kernel = kernel

    @property
    def num_local(self) -> int:
        return self.gate.shape[0]

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """tokens (N, h) grouped by expert, counts[e] rows each; returns (N, h)."""
        kernel = self.kernel
        compute_dtype = autocast_dtype(tokens.device)
        if kernel == "auto":
            kernel = "grouped" if self._grouped_runs(tokens, compute_dtype) else "loop"
        if kernel == "grouped":
            if compute_dtype is not None:
                return self._grouped_cast(tokens, counts, compute_dtype)
            return self._grouped(tokens, counts)
        if kernel == "padded":
            return self._padded(tokens, counts)
        return self._loop(tokens, counts)

    def _grouped_runs(self, tokens: torch.Tensor, compute_dtype: torch.dtype | None) -> bool:
        """Inside autocast the inputs are cast to its dtype (`_grouped_cast`); outside, the
        tokens and weights must already share one dtype."""
        if compute_dtype is None and tokens.dtype != self.gate.dtype:
            return False
        return grouped_mm_supported(tokens.device, compute_dtype or tokens.dtype, self.gate.shape)

    def _loop(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outputs = []
        start = 0
        for e, n in enumerate(counts):
            x = tokens[start : start + n]  # (n, h)
            start += n
            h = F.silu(x @ self.gate[e].t()) * (x @ self.up[e].t())  # (n, f)
            outputs.append(h @ self.down[e].t())  # (n, h)
        if not outputs:
            return tokens.new_zeros(0, tokens.shape[-1])
        return torch.cat(outputs, dim=0)

    def _grouped(
        self, tokens: torch.Tensor, counts: list[int], weights: tuple[torch.Tensor, ...] | None = None
    ) -> torch.Tensor:
        gate_w, up_w, down_w = weights or (self.gate, self.up, self.down)
        # offs[e] is the end row of group e; the weights are used transposed, as views.
        offs = torch.tensor(counts, dtype=torch.int64, device=tokens.device).cumsum(0).to(torch.int32)
        gate = torch._grouped_mm(tokens, gate_w.transpose(1, 2), offs=offs)  # (N, f)
        up = torch._grouped_mm(tokens, up_w.transpose(1, 2), offs=offs)  # (N, f)
        return torch._grouped_mm(F.silu(gate) * up, down_w.transpose(1, 2), offs=offs)  # (N, h)

    def _grouped_cast(self, tokens: torch.Tensor, counts: list[int], dtype: torch.dtype) -> torch.Tensor:
        """The grouped kernel inside an autocast region: autocast does not cast _grouped_mm's
        inputs, so they are cast here, at the experts' boundary, as autocast casts a matmul's
        (fp32 master weights to the compute dtype, their gradients back to fp32 through the
        casts' backward), and the kernel runs with autocast off."""
        weights = tuple(w.to(dtype) for w in (self.gate, self.up, self.down))
        with torch.autocast(tokens.device.type, enabled=False):
            return self._grouped(tokens.to(dtype), counts, weights)

    def _padded(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        E, width = len(counts), max(counts, default=0)
        if width == 0:
            return tokens.new_zeros(0, tokens.shape[-1])
        # row r of group e sits at padded position e * width + r
        counts_t = torch.tensor(counts, device=tokens.device)
        starts = counts_t.cumsum(0) - counts_t
        group = torch.repeat_interleave(torch.arange(E, device=tokens.device), counts_t)
        slot = group * width + torch.arange(tokens.shape[0], device=tokens.device) - starts[group]
        padded = tokens.new_zeros(E * width, tokens.shape[-1]).index_copy(0, slot, tokens).view(E, width, -1)
        h = F.silu(padded @ self.gate.transpose(1, 2)) * (padded @ self.up.transpose(1, 2))  # (E, W, f)
        out = (h @ self.down.transpose(1, 2)).reshape(E * width, -1)  # (E*W, h)
        return out.index_select(0, slot)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes matmuls in on `device`, or None outside autocast."""
    if device.type not in ("cpu", "cuda"):  # before asking autocast, which knows no other devices
        return None
    if not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, weight_shape: torch.Size) -> bool:
    """Whether torch._grouped_mm runs for experts computing in `dtype` on `device`: it needs
    rows aligned to 16 bytes, and on CUDA bf16 (the CPU kernel takes fp32 and bf16)."""
    if device.type not in ("cpu", "cuda") or not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda" and dtype != torch.bfloat16:
        return False
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    align = 16 // dtype.itemsize
    return weight_shape[1] % align == 0 and weight_shape[2] % align == 0


def sort_slots_by_expert(expert_ids: torch.Tensor, keep: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order the kept token-slots by expert (stable, so ties keep slot order).

    expert_ids, keep: (S,) flattened slots. Returns (order (S_kept,), counts (E,)).
    """
    kept = torch.nonzero(keep, as_tuple=False).squeeze(1)
    order = kept[torch.argsort(expert_ids[kept], stable=True)]
    counts = torch.bincount(expert_ids[kept], minlength=num_experts)
    return order, counts


class _ScatterRows(torch.autograd.Function):
    """out[index[i]] = rows[i] (or +=, into zeros) in a new (num_rows, h) tensor; backward gathers
    the gradient's rows by the same index. Autograd's index_add/index_copy would also keep `rows`
    alive for backward (for their shape only); this keeps the index alone."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, index: torch.Tensor, num_rows: int, accumulate: bool) -> torch.Tensor:
        ctx.save_for_backward(index)
        if accumulate:
            return rows.new_zeros(num_rows, rows.shape[-1]).index_add_(0, index, rows)
        return rows.new_empty(num_rows, rows.shape[-1]).index_copy_(0, index, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None, None


def scatter_rows(rows: torch.Tensor, index: torch.Tensor, num_rows: int, accumulate: bool = False) -> torch.Tensor:
    """Rows (S, h) to rows `index` of a new (num_rows, h) tensor: summed into zeros with
    `accumulate`, else copied (then `index` must cover every row: a permutation)."""
    return _ScatterRows.apply(rows, index, num_rows, accumulate)


def combine_slots(rows: torch.Tensor, order: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y[t] = sum over token t's kept slots of router weight * expert output.

    rows (S_kept, h): the outputs of the kept slots `order` (flat slot ids, token * k + choice),
    `tokens` = order // k; weights (N, k). Dropped slots add nothing, so only kept rows are
    weighted and summed; a token's slots are added in expert order (a layout-independent order).
    """
    w = weights.reshape(-1).index_select(0, order).to(rows.dtype)  # (S_kept,)
    return scatter_rows(rows * w[:, None], tokens, weights.shape[0], accumulate=True)


class LocalDispatcher(nn.Module):
    """Single-device dispatch: the rows are already grouped by expert; run the experts."""

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        """rows (S_kept, h) grouped by expert, counts (E,) rows each. Returns their outputs."""
        return experts(rows, counts.tolist())


def capacity_keep(
    expert_ids: torch.Tensor, num_experts: int, capacity: int, offsets: torch.Tensor | None = None
) -> torch.Tensor:
    """Which token-slots an expert accepts under a per-sequence capacity.

    expert_ids (B, T, k). Priority: choice rank first, then position. `offsets` (B, k, E), or per
    token (B, T, k, E) when a rank's tokens are not one contiguous run of the sequence, are
    slots of higher priority held elsewhere (other sequence segments); by default the earlier
    choice ranks of the same tokens. Returns keep (B, T, k) bool.
    """
    B, T, k = expert_ids.shape
    one_hot = F.one_hot(expert_ids, num_experts)  # (B, T, k, E)
    per_choice = one_hot.sum(dim=1)  # (B, k, E)
    if offsets is None:
        offsets = per_choice.cumsum(dim=1) - per_choice  # earlier choice ranks
    if offsets.dim() == 3:  # the same offsets for every token
        offsets = offsets[:, None, :, :]
    # position of each slot in its expert's queue: earlier tokens of the same choice rank + offset
    earlier = one_hot.cumsum(dim=1) - one_hot  # (B, T, k, E)
    queue_pos = earlier + offsets
    queue_pos = (queue_pos * one_hot).sum(-1)  # (B, T, k)
    return queue_pos < capacity


class Router(nn.Module):
    """Scores every token against every expert and picks the top k."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, kind: str, renormalize: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.top_k, self.kind, self.renormalize = top_k, kind, renormalize
        # Auxiliary-loss-free balancing (DeepSeek-V3): a bias that steers selection only.
        self.expert_bias: torch.Tensor
        self.register_buffer(EXPERT_BIAS, torch.zeros(num_experts), persistent=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, h) -> logits (B,T,E) fp32, probs (B,T,E), expert_ids (B,T,k), weights (B,T,k)."""
        logits = self.gate(x).float()
        if self.kind == "sigmoid":
            scores = torch.sigmoid(logits)
            _, ids = torch.topk(scores + self.expert_bias, self.top_k, dim=-1)
            weights = scores.gather(-1, ids)
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
            probs = scores / scores.sum(-1, keepdim=True)
        else:
            probs = torch.softmax(logits, dim=-1)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            if self.renormalize:
                weights = weights / weights.sum(-1, keepdim=True)
        return logits, probs, ids, weights

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor, rate: float) -> None:
        """Raise the bias of under-loaded experts and lower it for over-loaded ones."""
        load = tokens_per_expert.float()
        self.expert_bias += rate * torch.sign(load.mean() - load)


class MoE(nn.Module):
    """Routed SwiGLU experts (plus optional shared experts) in place of the dense MLP."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        expert_ffn: int,
        shared_experts: int = 0,
        router: str = "softmax",
        renormalize: bool = True,
        dropless: bool = True,
        capacity_factor: float = 1.25,
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.dropless, self.capacity_factor = dropless, capacity_factor
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.router = Router(hidden, num_experts, top_k, router, renormalize)
        self.experts = Experts(num_experts, hidden, expert_ffn)
        self.shared = MLP(hidden, expert_ffn * shared_experts) if shared_experts else None
        self.dispatcher: nn.Module = LocalDispatcher()
        self.token_stats_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.capacity_offsets: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Per-step statistics, summed over micro-batches; the training loop reads and resets them.
        self.counting = True  # False while a recomputed forward routes the same tokens again
        self.tokens_per_expert: torch.Tensor
        self.dropped_slots: torch.Tensor
        self.register_buffer(TOKENS_PER_EXPERT, torch.zeros(num_experts), persistent=False)
        self.register_buffer(DROPPED_SLOTS, torch.zeros(()), persistent=False)

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.token_stats_reduce is None else self.token_stats_reduce(t)

    def _aux_loss(self, logits: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sum over this micro-batch's sequences of the weighted per-sequence auxiliary losses."""
        E, k = self.num_experts, self.top_k
        B, T = logits.shape[0], logits.shape[1]
        # (B, E) assignments per sequence; a scatter, not one_hot, which reads min and max to the host on CPU
        counts = logits.new_zeros(B, E).scatter_add_(1, ids.reshape(B, -1), logits.new_ones(B, T * k))
        stats = torch.cat(
            [
                counts,
                probs.sum(dim=1),  # (B, E)
                torch.logsumexp(logits, dim=-1).pow(2).sum(dim=1, keepdim=True),  # (B, 1)
                torch.full((B, 1), float(T), device=logits.device),
            ],
            dim=1,
        )
        stats = self._reduce(stats)  # sums over the ranks holding the rest of each sequence
        counts, prob_sum = stats[:, :E], stats[:, E : 2 * E]
        z_sum, tokens = stats[:, 2 * E], stats[:, 2 * E + 1]
        f = counts / (tokens[:, None] * k)
        p = prob_sum / tokens[:, None]
        balance = E * (f * p).sum(dim=1)  # (B,)
        z = z_sum / tokens  # (B,)
        return (self.aux_loss_coef * balance + self.z_loss_coef * z).sum()

    def _tokens_per_sequence(self, T: int, device: torch.device) -> int:
        """Tokens of each whole sequence: T, or summed over the ranks holding its other parts
        (a host read, so only capacity, which needs it on the host, asks)."""
        if self.token_stats_reduce is None:
            return T
        return int(self._reduce(torch.full((1, 1), float(T), device=device)).item())

    def _keep_mask(self, ids: torch.Tensor) -> torch.Tensor:
        if self.dropless:
            return torch.ones_like(ids, dtype=torch.bool)
        tokens_per_sequence = self._tokens_per_sequence(ids.shape[1], ids.device)
        capacity = math.ceil(self.capacity_factor * tokens_per_sequence * self.top_k / self.num_experts)
        offsets = self.capacity_offsets(ids) if self.capacity_offsets is not None else None
        return capacity_keep(ids, self.num_experts, capacity, offsets)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, h) -> (y (B, T, h), summed auxiliary loss of this micro-batch's sequences)."""
        B, T, h = x.shape
        logits, probs, ids, weights = self.router(x)
        keep = self._keep_mask(ids)
        order, counts = sort_slots_by_expert(ids.reshape(-1), keep.reshape(-1), self.num_experts)
        tokens = order // self.top_k
        rows = self.dispatcher(x.reshape(B * T, h).index_select(0, tokens), counts, self.experts)
        y = combine_slots(rows, order, tokens, weights.reshape(B * T, -1)).view(B, T, h)
        if self.shared is not None:
            y = y + self.shared(x)
        if self.counting:
            with torch.no_grad():
                self.tokens_per_expert += torch.bincount(ids.reshape(-1), minlength=self.num_experts).float()
                self.dropped_slots += (~keep).sum().float()
        return y, self._aux_loss(logits, probs, ids)


@contextlib.contextmanager
def routing_uncounted(module: nn.Module) -> Iterator[None]:
    """Inside, the MoE layers under `module` and their dispatchers (whatever has a `counting`
    flag) route without adding to their per-step counters: full recomputation runs a block's
    forward again in its backward, routing the same token-slots a second time."""
    counters = [m for m in module.modules() if getattr(m, "counting", False)]
    for m in counters:
        setattr(m, "counting", False)  # noqa: B010 (nn.Module types its attributes as tensors or modules)
    try:
        yield
    finally:
        for m in counters:
            setattr(m, "counting", True)  # noqa: B010

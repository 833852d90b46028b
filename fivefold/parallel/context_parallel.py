"""Context parallelism: the sequence of every sample is split over the cp ranks.

Only attention mixes tokens, so it is the only layer that communicates; everything else
(norms, MLP, head, loss) runs on the rank's own tokens. Each rank keeps the global
positions of its tokens: RoPE uses them (`MicroBatch.positions`) and so does the causal
mask, which stays exact across segments. Three attention algorithms (`layout.cp_algorithm`):

- "allgather": every rank gathers K and V of the whole sequence and attends with its own
  queries; the backward reduce-scatters dK and dV. Contiguous segments.
- "ring": K/V blocks travel around the ring by point-to-point while the current block is
  computed; partial results merge with the log-sum-exp rule (online softmax), the backward
  recomputes block scores and sends the dK/dV accumulators around the ring. Memory per rank
  is O(s/cp): a rank holds a few K/V-sized blocks at a time and never an s x s score matrix
  (on CPU each block runs in the fused flash-attention kernel, which tiles the scores too).
  Zigzag segments (rank i holds segments i and 2cp-1-i of 2cp) give every rank the same
  causal work at every ring step.
- "ulysses": an all-to-all turns sequence-split Q/K/V into head-split Q/K/V of the whole
  sequence, attention runs locally, and an all-to-all turns the output back.

Packed documents (`data.document_mask`): every core receives the document index of every
token of the whole sequences (B, T). All-gather and Ulysses run the single-process path
(`document_causal_attention`: each document's queries on that document's keys with the causal
kernel, no mask of any size). The ring builds the mask of each K/V block it holds (Tq x Tk,
never s x s), passes it to the fused CPU kernel, and skips a block in which no query sees any key.

Grouped-query attention: K/V keep their own heads in every core and are never repeated to
the query heads: SDPA takes them with `enable_gqa` and the fused CPU kernel of the ring
reads each shared head for its query heads (its backward sums the group's gradients). Only
Ulysses, when the K/V heads do not split over cp, repeats them up to cp before its
all-to-all, so that every rank receives the one head its queries use.

Gradients of replicated parameters are summed over dp x cp by the data-parallel optimizer:
each rank's loss is its own tokens' CE sum over the tokens of the global batch.
"""

from __future__ import annotations

import contextlib

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import Config
from ..rules.layout import ZIGZAG_ALGORITHMS
from ..rules.layout import sequence_segments
from .mesh import Axis, Mesh
from ..model.attention import (
    document_causal_attention,
    document_causal_mask,
    grouped_query_attention,
    positions_in_documents,
)
from ..model.llama import Block, Transformer
from ..model.moe import MoE
from ..model.step import MicroBatch
from . import comm
from .protocols import ParamFinalizer


# ----------------------------------------------------------------------------- sequence layout (pure)


def local_segments(algorithm: str, cp: int, rank: int) -> list[int]:
    """Global indices of the segments rank `rank` holds, in local order (always increasing)."""
    if algorithm in ZIGZAG_ALGORITHMS:
        return [rank, 2 * cp - 1 - rank]
    return [rank]


def local_positions(algorithm: str, cp: int, rank: int, seq_len: int) -> torch.Tensor:
    """Global positions (T/cp,) of this rank's tokens, in local order."""
    size = seq_len // sequence_segments(algorithm, cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in local_segments(algorithm, cp, rank)])


def sequence_sharder(mesh: Mesh, config: Config) -> Callable:
    """fn(inputs (b, T), targets (b, T)) -> MicroBatch of this cp rank's tokens and positions."""

    algorithm, cp, rank = config.layout.cp_algorithm, mesh.cp.size, mesh.cp.rank

    def shard(inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None) -> MicroBatch:
        positions = local_positions(algorithm, cp, rank, inputs.shape[1]).to(inputs.device)
        if documents is None:
            return MicroBatch(inputs[:, positions], targets[:, positions], positions)
        # RoPE restarts at each document; the cores keep every token's document to mask with.
        in_document = positions_in_documents(documents)[:, positions]
        return MicroBatch(inputs[:, positions], targets[:, positions], in_document, documents, positions)

    return shard


# ----------------------------------------------------------------------------- block attention math


def _group_heads(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, Hq, T, d) -> (B, Hkv, rep, T, d): query heads grouped by the key/value head they use."""
    B, Hq, T, d = q.shape
    return q.reshape(B, kv_heads, Hq // kv_heads, T, d)


def _fused_cpu(q: torch.Tensor) -> bool:
    """CPU has a fused flash-attention kernel that returns the log-sum-exp and takes it back."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean visibility mask as the fused kernel takes it: 0 where visible, -inf elsewhere."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, Hq, Tq, d) on one K/V block (B, Hkv, Tk, d).

    causal: the block is the queries' own (same positions, mask j > i). mask: boolean
    (B, 1, Tq, Tk) visibility instead (packed documents); a query that sees no key of the
    block gets output 0 and log-sum-exp -inf, so merging the block leaves it unchanged.
    Returns the block's normalised output (B, Hq, Tq, d) and its log-sum-exp (B, Hq, Tq).
    """
    if not _fused_cpu(q):
        return block_forward_reference(q, k, v, causal, mask)
    # The kernel takes grouped K/V heads as they are (query head i reads K/V head i // rep)
    # and strided views of the ring's K|V buffer: no copy of K/V at all.
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.contiguous(), k, v, 0.0, causal, attn_mask=_additive(mask, q.dtype)
    )
    if mask is not None:  # the kernel reports lse 0 for a query that sees nothing
        blind = ~mask.any(dim=-1)  # (B, 1, Tq)
        out, lse = out.masked_fill(blind[..., None], 0.0), lse.masked_fill(blind, float("-inf"))
    return out, lse


def block_forward_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_forward` in plain tensor operations (any device): materialises the block's scores."""
    B, Hq, Tq, d = q.shape
    scores = _block_scores(q, k, causal, mask)  # (B, Hkv, rep, Tq, Tk)
    lse = torch.logsumexp(scores, dim=-1)
    finite_lse = lse.masked_fill(lse.isinf(), 0.0)  # a query that sees nothing: probabilities 0, not NaN
    probs = torch.exp(scores - finite_lse[..., None])
    out = probs @ v[:, :, None]  # (B, Hkv, rep, Tq, d)
    return out.reshape(B, Hq, Tq, d), lse.reshape(B, Hq, Tq)


def _block_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, mask: torch.Tensor | None = None) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (_group_heads(q, k.shape[1]) @ k[:, :, None].transpose(-1, -2)) * scale  # (B, Hkv, rep, Tq, Tk)
    if causal:
        Tq, Tk = scores.shape[-2:]
        future = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).triu_(1)
        scores = scores.masked_fill(future, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))  # (B, 1, 1, Tq, Tk) over heads
    return scores


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's (output, lse) into the running ones, in place (online softmax)."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse)[..., None]).add_(block_out * torch.exp(block_lse - new_lse)[..., None])
    lse.copy_(new_lse)


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of the gradients, given the final output and lse of the queries.

    Returns dq (B, Hq, Tq, d), dk, dv (B, Hkv, Tk, d).
    """
    if not _fused_cpu(q):
        delta = (grad_out * out).sum(dim=-1)
        return block_backward_reference(q, k, v, grad_out, lse, delta, causal, mask)
    # Grouped K/V as they are: the kernel sums each K/V head's gradient over its query heads.
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q.contiguous(), k, v, out, lse, 0.0, causal,
        attn_mask=_additive(mask, q.dtype),
    )


def block_backward_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block's contribution, from the final output's lse and delta = rowsum(dO * O).

    Returns dq (B, Hq, Tq, d), dk, dv (B, Hkv, Tk, d).
    """
    B, Hq, Tq, d = q.shape
    Hkv = k.shape[1]
    scale = 1.0 / math.sqrt(d)
    scores = _block_scores(q, k, causal, mask)  # (B, Hkv, rep, Tq, Tk)
    probs = torch.exp(scores - _group_heads(lse[..., None], Hkv))  # the final softmax restricted to this block
    grad_out5 = _group_heads(grad_out, Hkv)  # (B, Hkv, rep, Tq, d)
    dv = (probs.transpose(-1, -2) @ grad_out5).sum(dim=2)  # (B, Hkv, Tk, d)
    dprobs = grad_out5 @ v[:, :, None].transpose(-1, -2)  # (B, Hkv, rep, Tq, Tk)
    dscores = probs * (dprobs - _group_heads(delta[..., None], Hkv)) * scale
    dq = (dscores @ k[:, :, None]).reshape(B, Hq, Tq, d)
    dk = (dscores.transpose(-1, -2) @ _group_heads(q, Hkv)).sum(dim=2)
    return dq, dk, dv


# ----------------------------------------------------------------------------- ring attention


def zigzag_block(source: int, rank: int, local_len: int) -> tuple[slice, slice, bool]:
    """Which queries attend to which keys when rank `rank` holds the K/V block of rank `source`.

    Local tokens are the segments (rank, 2cp-1-rank). Own block: causal. A block from an
    earlier rank: every query sees its first segment only. From a later rank: only the second
    query segment sees it, whole. Every case is half the block pair: balanced work.
    Returns (query rows, key rows, causal).
    """
    half = local_len // 2
    if source == rank:
        return slice(None), slice(None), True
    if source < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def _exchange(axis: Axis, send: torch.Tensor, op_name: str) -> tuple[torch.Tensor, list]:
    """Post: send `send` to the next rank, receive the same shape from the previous one."""
    if axis.size == 1:  # a ring of one: the block comes back to its owner
        return send, []
    recv = torch.empty_like(send)
    n, r = axis.size, axis.rank
    works = comm.send_recv(axis, sends=[(send, (r + 1) % n)], recvs=[(recv, (r - 1) % n)], op_name=op_name)
    return recv, works


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast disabled; a no-op on devices autocast does not know (the meta device of dry runs)."""
    if device_type in ("cpu", "cuda"):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class _RingAttention(torch.autograd.Function):
    """Causal ring attention over zigzag segments; q (B, Hq, T, d), k, v (B, Hkv, T, d) local.

    The blocks are computed and merged in fp32 (16-bit inputs are cast up), but K/V circulate
    in their own dtype and each block is cast up where it is used: the cast is exact, so this
    halves a 16-bit ring's traffic and its saved K/V without changing a value. q is saved in
    its own dtype too and cast up again in backward; the output (which the backward reads) and
    the dK/dV accumulators are fp32.
    """

    @staticmethod
    def forward(ctx, q, k, v, axis: Axis, documents: torch.Tensor | None = None):
        kv = torch.cat([k, v], dim=1).contiguous()  # (B, 2Hkv, T, d), in k's dtype
        with _autocast_off(q.device.type):
            out, lse = _ring_forward(q.to(_compute_dtype(q)), kv, axis, documents)
        ctx.axis, ctx.documents = axis, documents
        ctx.save_for_backward(q, kv, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, out, lse = ctx.saved_tensors
        q = q.to(out.dtype)
        with _autocast_off(q.device.type):
            dq, dkv = _ring_backward(q, kv, out, lse, grad_out.to(q.dtype), ctx.axis, ctx.documents)
        Hkv = kv.shape[1] // 2
        dk, dv = dkv.split(Hkv, dim=1)
        return dq.to(grad_out.dtype), dk.to(grad_out.dtype), dv.to(grad_out.dtype), None, None


def ring_block_mask(
    documents: torch.Tensor | None, source: int, rank: int, cp: int, rows: slice, cols: slice
) -> torch.Tensor | None:
    """Visibility (B, 1, Tq, Tk) of block `source`'s keys for this rank's queries with packed documents.

    documents: (B, T) document index of every token of the whole sequences. The block's
    causal structure comes from the zigzag layout; the mask adds "same document". None
    without documents (the block's `causal` flag says everything).
    """
    if documents is None:
        return None
    seq_len = documents.shape[1]
    q_pos = local_positions("ring", cp, rank, seq_len).to(documents.device)[rows]
    k_pos = local_positions("ring", cp, source, seq_len).to(documents.device)[cols]
    return document_causal_mask(documents[:, q_pos], documents[:, k_pos], q_pos, k_pos)


def _ring_block(documents: torch.Tensor | None, source: int, rank: int, cp: int, local_len: int):
    """(rows, cols, causal, mask, skip) of one ring step; skip: no query sees any key of the block."""
    rows, cols, causal = zigzag_block(source, rank, local_len)
    mask = ring_block_mask(documents, source, rank, cp, rows, cols)
    if mask is None:
        return rows, cols, causal, None, False
    return rows, cols, False, mask, not bool(mask.any())  # the mask holds the causal part too


def _ring_forward(
    q: torch.Tensor, kv: torch.Tensor, axis: Axis, documents: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    n, r, T = axis.size, axis.rank, q.shape[2]
    Hkv = kv.shape[1] // 2
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=q.dtype, device=q.device)
    current = kv
    for step in range(n):
        # Post the next block's transfer first, so it travels while this one is computed.
        incoming, works = _exchange(axis, current, "ring_kv") if step < n - 1 else (current, [])
        rows, cols, causal, mask, skip = _ring_block(documents, (r - step) % n, r, n, T)
        if not skip:  # a block wholly in other documents contributes nothing: not computed
            block = current[:, :, cols].to(q.dtype)
            k, v = block[:, :Hkv], block[:, Hkv:]
            block_out, block_lse = block_forward(q[:, :, rows], k, v, causal, mask)
            merge_block(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        _wait(works)
        current = incoming
    return out, lse


def _ring_backward(
    q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, axis: Axis,
    documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V blocks circulate as in the forward; each block's dK/dV accumulator travels with it.

    At step s this rank holds block r-s and the accumulator of that block; after the last
    step the accumulator that arrives is this rank's own, complete.
    """
    n, r, T = axis.size, axis.rank, q.shape[2]
    Hkv = kv.shape[1] // 2
    dq = torch.zeros_like(q)
    current = kv
    acc_in: torch.Tensor | None = None  # the accumulator that arrived last step; none at the first
    acc_works: list = []
    for step in range(n):
        incoming, kv_works = _exchange(axis, current, "ring_kv") if step < n - 1 else (current, [])
        rows, cols, causal, mask, skip = _ring_block(documents, (r - step) % n, r, n, T)
        contribution = torch.zeros_like(kv, dtype=q.dtype)  # (B, 2Hkv, T, d) in the compute dtype
        if not skip:
            block = current[:, :, cols].to(q.dtype)
            dq_b, dk_b, dv_b = block_backward(
                q[:, :, rows], block[:, :Hkv], block[:, Hkv:],
                grad_out[:, :, rows].contiguous(), out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(),
                causal, mask,
            )
            dq[:, :, rows] += dq_b
            contribution[:, :Hkv, cols] = dk_b
            contribution[:, Hkv:, cols] = dv_b
        _wait(acc_works)  # the accumulator of the block held now (posted last step)
        acc = contribution if acc_in is None else acc_in + contribution
        acc_in, acc_works = _exchange(axis, acc, "ring_dkv")
        _wait(kv_works)
        current = incoming
    _wait(acc_works)
    assert acc_in is not None  # n >= 1 steps each post an accumulator
    return dq, acc_in


class RingAttentionCore(nn.Module):
    """Drop-in AttentionCore for zigzag-sharded sequences (see `zigzag_block`)."""

    def __init__(self, axis: Axis) -> None:
        super().__init__()
        self.axis = axis

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        return _RingAttention.apply(q, k, v, self.axis, documents)


# ----------------------------------------------------------------------------- all-gather K/V


class AllGatherKVCore(nn.Module):
    """Gather K/V of the whole sequence (contiguous segments); attend with the local queries."""

    def __init__(self, axis: Axis) -> None:
        super().__init__()
        self.axis = axis

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        n, T, Hkv = self.axis.size, q.shape[2], k.shape[1]
        kv = torch.cat([k, v], dim=1)  # (B, 2Hkv, T, d): one collective for both
        kv = comm.all_gather_to_full(kv, self.axis, dim=2)  # (B, 2Hkv, n*T, d); backward: reduce-scatter
        k, v = kv[:, :Hkv], kv[:, Hkv:]  # K/V grouped, not repeated
        if documents is not None:  # per document, no (T, n*T) mask
            return document_causal_attention(q, k, v, documents, query_start=self.axis.rank * T)
        q_pos = torch.arange(self.axis.rank * T, (self.axis.rank + 1) * T, device=q.device)
        k_pos = torch.arange(n * T, device=q.device)
        visible = q_pos[:, None] >= k_pos[None, :]  # (T, n*T) exact causal mask in global positions
        return grouped_query_attention(q, k, v, visible)


# ----------------------------------------------------------------------------- Ulysses


def _expand_kv_for_ulysses(k: torch.Tensor, cp: int) -> torch.Tensor:
    """Fewer key/value heads than cp: repeat each so that every rank receives the one it needs."""
    Hkv = k.shape[1]
    if Hkv % cp == 0:
        return k
    if cp % Hkv:
        raise ValueError(f"Ulysses: {Hkv} key/value heads neither divisible by nor dividing cp={cp}")
    return k.repeat_interleave(cp // Hkv, dim=1)


def _seq_to_heads(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """(B, H, T/cp, d) sequence-split -> (B, H/cp, T, d) head-split, via one all-to-all."""
    B, H, T, d = x.shape
    n = axis.size
    x = x.reshape(B, n, H // n, T, d).transpose(0, 1)  # (n, B, H/n, T, d): block i goes to rank i
    x = comm.all_to_all_autograd(x, axis)  # (n, B, H/n, T, d): block i is rank i's segment
    return x.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * T, d)


def _heads_to_seq(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """(B, H/cp, T, d) head-split -> (B, H, T/cp, d) sequence-split."""
    B, h, T, d = x.shape
    n = axis.size
    x = x.reshape(B, h, n, T // n, d).permute(2, 0, 1, 3, 4)  # (n, B, h, T/n, d): segment i goes to rank i
    x = comm.all_to_all_autograd(x, axis)  # block i holds head group i
    return x.transpose(0, 1).reshape(B, n * h, T // n, d)


class UlyssesCore(nn.Module):
    """All-to-all to head-split full sequences, plain causal attention, all-to-all back."""

    def __init__(self, axis: Axis) -> None:
        super().__init__()
        self.axis = axis

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        n = self.axis.size
        B, Hq, T, d = q.shape
        k, v = _expand_kv_for_ulysses(k, n), _expand_kv_for_ulysses(v, n)
        hq, hkv = Hq // n, k.shape[1] // n
        # One all-to-all for q, k and v: group the heads each rank receives together.
        qkv = torch.cat([t.reshape(B, n, -1, T, d) for t in (q, k, v)], dim=2)  # (B, n, hq+2hkv, T, d)
        qkv = _seq_to_heads(qkv.reshape(B, -1, T, d), self.axis)  # (B, hq+2hkv, n*T, d)
        q, k, v = qkv.split([hq, hkv, hkv], dim=1)
        if documents is None:
            y = grouped_query_attention(q, k, v)  # (B, hq, n*T, d): whole sequences, positions in order
        else:
            y = document_causal_attention(q, k, v, documents)  # the single-process path, on a head group
        return _heads_to_seq(y, self.axis)


def saved_activation_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward of `fn()` (its activations)."""
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


# ----------------------------------------------------------------------------- MoE hooks


def capacity_slot_offsets(
    global_counts: torch.Tensor, segments: list[int], segment_len: int
) -> torch.Tensor:
    """Per-slot count of higher-priority slots to the same expert that the local cumsum misses.

    global_counts (G, B, k, E): slots per (sequence segment, sequence, choice rank, expert), for
    all G segments of the sequence. `capacity_keep` adds, for each local slot, the same-choice
    slots of earlier local tokens; this returns the rest of the GShard priority order:
    every slot of an earlier choice rank, plus same-choice slots of earlier segments held
    elsewhere. Returns (B, len(segments) * segment_len, k, E).
    """
    total = global_counts.sum(dim=0)  # (B, k, E)
    earlier_choices = total.cumsum(dim=1) - total
    earlier_segments = global_counts.cumsum(dim=0) - global_counts  # (G, B, k, E)
    counted_locally = torch.zeros_like(total)
    pieces = []
    for g in segments:
        offset = earlier_choices + earlier_segments[g] - counted_locally  # (B, k, E)
        pieces.append(offset[:, None].expand(-1, segment_len, -1, -1))
        counted_locally = counted_locally + global_counts[g]
    return torch.cat(pieces, dim=1)


def make_capacity_offsets(
    axis: Axis, algorithm: str, num_experts: int, local_len: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """MoE hook: per-slot capacity offsets from every cp rank's per-segment expert counts."""
    n, rank = axis.size, axis.rank
    mine = local_segments(algorithm, n, rank)
    order = [c for r in range(n) for c in local_segments(algorithm, n, r)]  # segment index of each gathered row

    def offsets(expert_ids: torch.Tensor) -> torch.Tensor:  # (B, T, k)
        T = expert_ids.shape[1]
        if T != local_len:  # e.g. tokens further split by sequence parallel: priorities would be wrong
            raise NotImplementedError(
                f"context-parallel capacity offsets expect the rank's {local_len} tokens per sequence, got {T}"
            )
        segment_len = T // len(mine)
        one_hot = F.one_hot(expert_ids, num_experts)  # (B, T, k, E)
        counts = torch.stack([one_hot[:, i * segment_len : (i + 1) * segment_len].sum(1) for i in range(len(mine))])
        gathered = comm.all_gather(counts, axis, dim=0)  # (n * m, B, k, E) in rank order
        by_segment = torch.empty_like(gathered)
        by_segment[torch.tensor(order)] = gathered
        return capacity_slot_offsets(by_segment, mine, segment_len)

    return offsets


def _compose(first: Callable | None, then: Callable) -> Callable:
    return then if first is None else (lambda t: then(first(t)))


def _install_moe_hooks(moe: MoE, mesh: Mesh, algorithm: str, local_len: int) -> None:
    """Per-sequence statistics and capacity priorities span the cp ranks holding the sequence.

    Every cp rank adds the same auxiliary loss, computed from the summed statistics, to its own
    loss, and gradients are then summed over dp x cp. So the statistics' backward is the
    identity (reduce_from): the sum over ranks of each rank's own share of the derivative is
    the derivative of the one auxiliary loss.
    """
    cp = mesh.cp
    moe.token_stats_reduce = _compose(moe.token_stats_reduce, lambda t: comm.reduce_from(t, cp))
    if moe.capacity_offsets is not None:
        raise NotImplementedError("context parallel cannot yet combine its capacity offsets with another strategy's")
    moe.capacity_offsets = make_capacity_offsets(cp, algorithm, moe.num_experts, local_len)


# ----------------------------------------------------------------------------- entry point

CORES = {"allgather": AllGatherKVCore, "ring": RingAttentionCore, "ulysses": UlyssesCore}


def apply_context_parallel(chunk: Transformer, mesh: Mesh, config: Config) -> list[ParamFinalizer]:
    """Swap every attention core for the distributed one; make MoE statistics span the sequence."""
    algorithm = config.layout.cp_algorithm
    if algorithm not in CORES:
        raise ValueError(f"unknown cp algorithm {algorithm!r}; use one of {', '.join(CORES)}")
    for block in chunk.layers.values():
        assert isinstance(block, Block)  # every layer is; the check tells the type checker
        block.attn.core = CORES[algorithm](mesh.cp)
        if isinstance(block.mlp, MoE):
            _install_moe_hooks(block.mlp, mesh, algorithm, config.train.seq_len // mesh.cp.size)
    return []

"""Rotary position embedding and grouped-query causal attention (plain PyTorch)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables `apply_rope` takes: cos and signed sin, (T, head_dim), or (B, T, head_dim)
    for per-sequence positions (B, T).

    "Rotate half" pairs dimension i with i + d/2: (x1, x2) -> x * cos + (-x2, x1) * sin. The
    signed sin table is (-sin, sin) over the two halves, so that (-x2, x1) * sin is
    (x2, x1) * signed sin, and (x2, x1) is a roll of x by d/2: one pass over x where neg and
    cat take two, in the forward and in the backward alike. Negating is exact, so the results
    are bit for bit those of x * cos + rotate_half(x) * sin.

    Positions are passed in, not assumed to be 0..T-1, so a rank holding a segment of a longer
    sequence (context parallel) rotates its tokens by their global positions, and packed
    documents can restart at position 0 each.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq  # (..., T, d/2)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, d) by the tables of `rope_tables`, (T, d) or per sequence (B, T, d)."""
    if cos.dim() == 3:  # one table per sequence: broadcast over the heads
        cos, signed_sin = cos[:, None], signed_sin[:, None]
    rolled = x.roll(x.shape[-1] // 2, dims=-1)  # (x2, x1)
    # In place on the two new products (autograd saves the tables, not them): two buffers, not four.
    return (x * cos.to(x.dtype)).add_(rolled.mul_(signed_sin.to(x.dtype)))


def document_causal_mask(query_docs: torch.Tensor, key_docs: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """Boolean (B, 1, Tq, Tk): key j is visible to query i when it is not later and in the same document.

    query_docs (B, Tq), key_docs (B, Tk): document index of each token; query_pos (Tq,),
    key_pos (Tk,): the tokens' indices in the whole sequence (causality).
    """
    same = query_docs[:, :, None] == key_docs[:, None, :]  # (B, Tq, Tk)
    causal = query_pos[:, None] >= key_pos[None, :]  # (Tq, Tk)
    return (same & causal)[:, None]


def positions_in_documents(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) position of every token inside its document: 0 at each document's first token."""
    T = documents.shape[1]
    index = torch.arange(T, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values  # start of each token's document
    return index - first


# Grouped-query attention hands SDPA K/V with fewer heads than Q (`enable_gqa`). On CUDA only
# the flash kernel and the math kernel accept that (torch's documentation of
# `scaled_dot_product_attention`, 2.11-2.14), and flash takes fp16/bf16 without a mask. Anywhere
# else on CUDA — fp32 (TF32) runs, or a boolean mask — SDPA would take the math kernel, which
# materialises and saves the (B, H, Tq, Tk) probabilities: O(s^2) memory. Repeating K/V up to
# the query heads first lets the memory-efficient kernel run instead (fp32 and masks
# supported), which saves K/V at query-head size but nothing of size s^2. On the CPU the fused
# flash kernel takes grouped heads, fp32 and masks alike, so K/V stay grouped there.


def keeps_grouped_kv(device_type: str, dtype: torch.dtype, masked: bool) -> bool:
    """Whether SDPA gets K/V with their own (grouped) heads: else they are repeated to the
    query heads first (see the comment above)."""
    if device_type != "cuda":
        return True
    return dtype in (torch.float16, torch.bfloat16) and not masked


def grouped_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """SDPA of q (B, Hq, Tq, d) on k, v (B, Hkv, Tk, d), Hkv dividing Hq: causal, or `mask`.

    Each key/value head serves Hq/Hkv consecutive query heads. SDPA's `enable_gqa` maps
    them inside the kernel (the CPU flash kernel reads the shared head, its backward sums
    the group's gradients), so K/V are neither copied to query-head size nor saved at it.
    Where no fused kernel takes grouped heads (CUDA in fp32 or with a mask:
    `keeps_grouped_kv`) they are repeated first.
    """
    gqa = q.shape[1] != k.shape[1]
    if gqa and not keeps_grouped_kv(q.device.type, q.dtype, mask is not None):
        # no fused kernel takes grouped heads here: repeat them, so SDPA avoids the math kernel's s x s
        group = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), False
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def document_boundaries(documents: torch.Tensor) -> list[list[int]]:
    """Per sequence of documents (B, T): the start of every document, then T.

    The boundaries size the per-document pieces, so they are read to the host: one transfer
    per call, data-dependent by nature (on CPU a plain copy, on CUDA a device sync).
    """
    B, T = documents.shape
    rows, starts = (documents[:, 1:] != documents[:, :-1]).nonzero(as_tuple=True)
    bounds: list[list[int]] = [[0] for _ in range(B)]
    for row, start in zip(rows.tolist(), starts.tolist()):
        bounds[row].append(start + 1)
    return [b + [T] for b in bounds]


def _document_pieces(bounds: list[int], query_start: int, query_end: int) -> list[tuple[int, int]]:
    """(document start, query start) of each document holding queries in [query_start, query_end).

    The pieces tile the query range in order; a piece's queries end where the next begins.
    """
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > query_start and start < query_end:
            pieces.append((start, max(start, query_start)))
    return pieces


def _row_document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], query_start: int
) -> torch.Tensor:
    """One sequence: q (Hq, Tq, d) at positions [query_start, query_start + Tq), k, v (Hkv, Tk, d) from 0."""
    query_end = query_start + q.shape[1]
    pieces = _document_pieces(bounds, query_start, query_end)
    query_ends = [lo for _, lo in pieces[1:]] + [query_end]
    # One split per tensor (its backward is one concatenation), not a slice per document.
    q_parts = q.split([hi - lo for (_, lo), hi in zip(pieces, query_ends)], dim=1)
    key_cuts = [pieces[0][0]] + query_ends  # a document's keys run from its start to its last query
    key_sizes = [key_cuts[0]] + [b - a for a, b in zip(key_cuts[:-1], key_cuts[1:])] + [k.shape[1] - query_end]
    k_parts, v_parts = k.split(key_sizes, dim=1)[1:-1], v.split(key_sizes, dim=1)[1:-1]
    outs = []
    for (doc_start, lo), q_part, k_part, v_part in zip(pieces, q_parts, k_parts, v_parts):
        earlier = lo - doc_start  # keys of this document before the first query (held by other ranks' queries)
        if earlier:  # causal alignment at the bottom right: queries of zeros in front, dropped after
            q_part = torch.cat([q_part.new_zeros(q_part.shape[0], earlier, q_part.shape[2]), q_part], dim=1)
        out = grouped_query_attention(q_part[None], k_part[None], v_part[None])[0]
        outs.append(out[:, earlier:])
    return torch.cat(outs, dim=1)


def document_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor, query_start: int = 0
) -> torch.Tensor:
    """Causal attention that stays inside packed documents, without a (Tq, Tk) mask.

    q (B, Hq, Tq, d): the tokens at positions [query_start, query_start + Tq) of the sequences;
    k, v (B, Hkv, Tk, d): the tokens at positions [0, Tk), Tk >= query_start + Tq;
    documents (B, T): document index of every token of the whole sequences.

    Variable-length attention: each document's queries run the causal SDPA kernel on that
    document's keys alone, so with the fused kernels (flash on CPU and CUDA, memory-efficient
    on CUDA) nothing the size of Tq x Tk exists and memory grows linearly with the sequence.
    A boolean mask instead sends SDPA to a kernel that takes the mask as a (Tq, Tk) tensor
    (on CPU converted to float, on CUDA with GQA the math kernel's full scores). FlexAttention
    would also avoid the mask, but on CPU it runs only under torch.compile (70 s for a first
    forward on this project's 2-core test machine) and torch 2.13 has no backward for it there
    (benchmarks/bench_docmask.py); SDPA's kernels need neither, on every device. The queries of a document that starts before
    `query_start` (all-gather context parallel) are padded at the front with zeros, which
    aligns the causal diagonal at the bottom right; the padding's outputs are dropped, and
    its zero output gradient adds exact zeros to dK and dV.
    """
    bounds = document_boundaries(documents)
    rows = [
        _row_document_attention(q[b], k[b], v[b], bounds[b], query_start) for b in range(q.shape[0])
    ]
    return torch.stack(rows)


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d)) v with a causal mask, for q (B, Hq, T, d) and k, v (B, Hkv, T, d).

    documents (B, T), when given, holds the document index of every token of the sequences
    (packed documents): attention then also stays inside each document.
    A module of its own so that context parallelism can swap in a distributed version and
    selective recomputation can recompute exactly this part.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        if documents is None:
            return grouped_query_attention(q, k, v)
        return document_causal_attention(q, k, v, documents)


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads; no biases, as in Llama."""

    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.core: nn.Module = AttentionCore()  # context parallel swaps in its own
        self.recompute_core = False  # selective recomputation: keep no attention internals

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """documents: (B, T_full) document index of every token of the whole sequences, or None."""
        d = self.head_dim
        q = self.wq(x)  # (B, T, Hq*d) -- T may grow here under sequence parallel
        k = self.wk(x)
        v = self.wv(x)
        B, T = q.shape[0], q.shape[1]
        q = q.view(B, T, -1, d).transpose(1, 2)  # (B, Hq, T, d)
        k = k.view(B, T, -1, d).transpose(1, 2)  # (B, Hkv, T, d)
        v = v.view(B, T, -1, d).transpose(1, 2)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.recompute_core and torch.is_grad_enabled():
            y = checkpoint(self.core, q, k, v, documents, use_reentrant=False)
        else:
            y = self.core(q, k, v, documents)  # (B, Hq, T, d)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.wo(y)

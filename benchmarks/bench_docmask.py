"""Document-masked attention: per-document causal kernels against a materialised boolean mask.

One attention layer's core (the `tiny` preset's heads: 8 query heads on 2 K/V heads of 8
dimensions), forward + backward, on sequences of packed documents of random length (1 to
`--max-document` tokens). Cases, alternating in one process per sequence length
(fivefold.tools.bench):

- `masked`: SDPA with the boolean (B, 1, T, T) same-document causal mask, what fivefold ran
  before (`document_causal_mask`; it stays the tests' oracle);
- `documents`: fivefold's `document_causal_attention` (each document's causal SDPA, no mask);
- `flex` (`--flex`): torch's FlexAttention with a block mask, compiled with torch.compile
  (on CPU FlexAttention runs only compiled). Its first forward (the compilation) and a second
  one are timed apart; it joins the alternation only where its backward runs (torch 2.13 has
  no FlexAttention backward on CPU).

Reported per length: median seconds per call, the rise of resident memory during a call above
the size at its start (`step_rise_mb`: what forward + backward allocate, measured with
glibc's mmap threshold fixed so freed blocks leave the process), and the largest output
difference from `masked`.

    OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/bench_docmask.py --lengths 2048,8192,32768
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run directly from a checkout

from fivefold.model.attention import (  # noqa: E402
    document_causal_attention,
    document_causal_mask,
    grouped_query_attention,
)
from fivefold.tools.bench import Comparison, alternate, compare, print_table, write_json  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 8  # the tiny preset's attention


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fivefold bench docmask", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,8192,32768", help="comma-separated sequence lengths")
    p.add_argument("--masked-up-to", type=int, default=8192,
                   help="longest length the masked case runs at (38 s per call at 8192 on one thread)")
    p.add_argument("--max-document", type=int, default=1024, help="longest document, tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--flex", action="store_true", help="add FlexAttention (torch.compile) as a case")
    p.add_argument("--out", default="bench_results/docmask.json")
    return p.parse_args(argv)


def packed_documents(T: int, max_document: int, gen: torch.Generator) -> torch.Tensor:
    """(1, T) document index of every token: documents of 1..max_document tokens back to back."""
    lengths = torch.randint(1, max_document + 1, (T,), generator=gen)
    return torch.repeat_interleave(torch.arange(T), lengths)[:T][None]


def masked_core(q, k, v, documents):
    pos = torch.arange(q.shape[2])
    return grouped_query_attention(q, k, v, document_causal_mask(documents, documents, pos, pos))


def flex_core(documents: torch.Tensor) -> tuple[Callable, float]:
    """FlexAttention with the same-document causal block mask, compiled; and the seconds the
    block mask took to build."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    docs = documents[0]

    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (docs[q_idx] == docs[kv_idx])

    start = time.perf_counter()
    T = docs.shape[0]
    block_mask = create_block_mask(same_document_causal, None, None, T, T, device="cpu")
    built = time.perf_counter() - start
    compiled = torch.compile(flex_attention)
    return (lambda q, k, v, _docs: compiled(q, k, v, block_mask=block_mask, enable_gqa=True)), built


def flex_cost(flex: Callable, q, k, v, documents, grad) -> dict:
    """Seconds of FlexAttention's first forward (its compilation) and of a second one; whether
    its backward runs here (torch 2.13 has none on CPU: the error's first line)."""
    times = []
    with torch.no_grad():
        for _ in range(2):
            start = time.perf_counter()
            flex(q, k, v, documents)
            times.append(time.perf_counter() - start)
    try:
        step_of(flex, q, k, v, documents, grad)()
        backward = "ok"
    except NotImplementedError as error:
        backward = str(error).splitlines()[0]
    return {"flex_first_forward_s": times[0], "flex_forward_s": times[1], "flex_backward": backward}


def step_of(core: Callable, q, k, v, documents, grad) -> Callable[[], None]:
    def step() -> None:
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        core(*inputs, documents).backward(grad)

    return step


def compare_length(T: int, args: argparse.Namespace) -> Comparison:
    """Every case at length T; the baseline is `masked` where it runs, else `documents`."""
    gen = torch.Generator().manual_seed(T)
    documents = packed_documents(T, args.max_document, gen)
    q, k, v, grad = (torch.randn(1, h, T, HEAD_DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS, HEADS))
    cores: dict[str, Callable] = {"documents": document_causal_attention}
    if T <= args.masked_up_to:
        cores["masked"] = masked_core
    meta: dict = {"length": T, "documents": int(documents[0, -1]) + 1, "heads": HEADS, "kv_heads": KV_HEADS,
                  "head_dim": HEAD_DIM, "threads": torch.get_num_threads()}
    if args.flex:
        flex, meta["flex_block_mask_s"] = flex_core(documents)
        meta.update(flex_cost(flex, q, k, v, documents, grad))
        if meta["flex_backward"] == "ok":
            cores["flex"] = flex
    with torch.no_grad():
        reference = cores.get("masked", document_causal_attention)(q, k, v, documents)
        meta["max_difference"] = {n: (c(q, k, v, documents) - reference).abs().max().item() for n, c in cores.items()}
    steps = {n: step_of(c, q, k, v, documents, grad) for n, c in cores.items()}
    for step in steps.values():  # one-time set-up (thread pools, kernels' buffers) is no case's cost
        step()
    results = alternate(steps, args.warmup, args.rounds)
    baseline = "masked" if "masked" in cores else "documents"
    return compare(f"document-masked attention, T={T}: forward + backward", results, baseline, meta)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    comparisons = []
    for T in (int(x) for x in args.lengths.split(",")):
        comparison = compare_length(T, args)
        comparisons.append(comparison)
        print_table(comparison)
        rises = {n: round(c.extra["step_rise_mb"], 1) for n, c in comparison.cases.items()}
        print(f"  T={T}: {comparison.meta['documents']} documents; call's memory rise MB {rises}; "
              f"largest difference from the baseline {comparison.meta['max_difference']}")
        if args.flex:
            m = comparison.meta
            print(f"  flex: block mask {m['flex_block_mask_s']:.2f} s, first forward (compile) "
                  f"{m['flex_first_forward_s']:.1f} s, then {m['flex_forward_s']:.3f} s; backward: {m['flex_backward']}")
    print(f"wrote {write_json(comparisons, args.out)}")


if __name__ == "__main__":
    main()

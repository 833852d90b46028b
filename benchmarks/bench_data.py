"""Prepared data: preparation tokens/s, loader against training tokens/s, start-up and memory against corpus size.

Three measurements, each side by side in one run (fivefold.tools.bench):

1. prepare: a synthetic .jsonl corpus prepared with one worker and with every core
   (`fivefold data prepare`); tokens/s of each and their ratio.
2. loader vs training: one rank's rows of a step read from a prepared dataset (with document
   ids) against one training step of a preset on the same batch size, alternating; the loader
   must be far faster than training.
3. corpus size sweep: token shards synthesised directly with numpy (1M .. --max-tokens tokens,
   documents of ~1000 tokens), each opened in a fresh process that builds the training
   sampler and reads --steps steps: start-up seconds and the memory the data adds to the
   process: private (RssAnon) memory, which must not grow with the corpus, and mapped shard
   pages (RssFile, reclaimable page cache, growing with the windows read). The first
   open of a corpus hashes every shard (reported apart); later opens reuse the checked sums.

    python benchmarks/bench_data.py --max-tokens 1000000000
    fivefold bench data --max-tokens 100000000 --preset tiny
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run directly from a checkout

from fivefold.tools.bench import alternate  # noqa: E402
from fivefold.data.indexed import FORMAT, MANIFEST, sha256_of, shard_name  # noqa: E402

WORDS = "the of and to in is was for that with as on by at from his her they this which be".split()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fivefold bench data", description=__doc__.split("\n\n")[0])
    p.add_argument("--prepare-mb", type=float, default=20, help="size of the synthetic text corpus to prepare")
    p.add_argument("--max-tokens", type=int, default=1_000_000_000, help="largest corpus of the size sweep")
    p.add_argument("--preset", default="small", help="model trained in the loader-vs-training comparison")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="steps read per probe of the size sweep")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir", default=None, help="where corpora are written (default: a temporary folder)")
    p.add_argument("--sizes-only", action="store_true", help="only the corpus size sweep")
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # internal: one start-up probe
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- 1. preparation


def synthetic_jsonl(path: Path, megabytes: float) -> None:
    rng = random.Random(0)
    written = 0
    with open(path, "w") as f:
        while written < megabytes * 1e6:
            line = json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(20, 400)))}) + "\n"
            f.write(line)
            written += len(line)


def bench_prepare(work: Path, megabytes: float, rounds: int) -> dict:
    from fivefold.data.prepare import prepare

    inputs = work / "text"
    inputs.mkdir(exist_ok=True)
    for i in range(8):  # 8 files: 8 units that workers can share
        synthetic_jsonl(inputs / f"part{i}.jsonl", megabytes / 8)
    cores = os.cpu_count() or 1
    results: dict[str, list[float]] = {"1 worker": [], f"{cores} workers": []}
    tokens = 0
    for r in range(rounds):
        for name, workers in (("1 worker", 1), (f"{cores} workers", cores))[:: 1 if r % 2 == 0 else -1]:
            out = work / f"prepared-{workers}"
            result = prepare([str(inputs)], out, workers=workers, overwrite=True)
            results[name].append(result.tokens_per_s)
            tokens = result.tokens
    medians = {k: statistics.median(v) for k, v in results.items()}
    return {"tokens": tokens, "tokens_per_s": medians, "parallel_speedup": medians[f"{cores} workers"] / medians["1 worker"]}


# ----------------------------------------------------------------------------- 2. loader vs training


def bench_loader_vs_training(work: Path, preset: str, seq_len: int, global_batch: int, rounds: int) -> dict:
    import torch

    from fivefold.config import load_config
    from fivefold.rules.layout import validate
    from fivefold.data.loader import open_training_data
    from fivefold.parallel.mesh import Mesh
    from fivefold.train import build, train_step

    config = load_config(preset, [f"data.source={work / 'prepared-1'}", "data.document_mask=true",
                                  f"train.seq_len={seq_len}", f"train.global_batch={global_batch}"])
    config = validate(config)
    _, sampler = open_training_data(config)
    model = build(config, Mesh.single(config.layout), torch.device("cpu"))
    step = {"n": 0}

    def load() -> None:
        sampler.local_rows_at(step["n"], 0, 1)
        step["n"] += 1

    def train() -> None:
        train_step(model, sampler, step["n"])

    results = alternate({"loader": load, "train_step": train}, warmup=1, rounds=rounds)
    tokens = seq_len * global_batch
    rates = {name: tokens / r.median for name, r in results.items()}
    return {"preset": preset, "tokens_per_step": tokens, "tokens_per_s": rates,
            "loader_over_training": rates["loader"] / rates["train_step"]}


# ----------------------------------------------------------------------------- 3. corpus size sweep


def synthetic_shards(root: Path, tokens: int, shard_tokens: int = 250_000_000, doc_len: int = 1000) -> float:
    """A prepared dataset of `tokens` uint16 tokens written directly; returns seconds to hash it once."""
    root.mkdir(parents=True, exist_ok=True)
    shards = []
    for index, start in enumerate(range(0, tokens, shard_tokens)):
        count = min(shard_tokens, tokens - start)
        name = shard_name(index)
        with open(root / f"{name}.bin", "wb") as f:
            for a in range(0, count, 1 << 24):  # 16M tokens at a time: bounded memory while writing
                n = min(1 << 24, count - a)
                ((np.arange(start + a, start + a + n, dtype=np.int64) * 2654435761) % 255 + 1).astype(np.uint16).tofile(f)
        ends = np.arange(doc_len, count + doc_len, doc_len, dtype=np.int64)
        ends[-1] = count
        ends.tofile(root / f"{name}.idx")
        shards.append({"name": name, "tokens": count, "documents": len(ends)})
    start = time.perf_counter()
    for shard in shards:
        shard["sha256_bin"] = sha256_of(root / f"{shard['name']}.bin")
        shard["sha256_idx"] = sha256_of(root / f"{shard['name']}.idx")
    hashing = time.perf_counter() - start
    manifest = {"format": FORMAT, "tokenizer": {"kind": "bytes", "sha256": "", "vocab_size": 256, "bos_id": None, "eos_id": 0, "path": ""},
                "dtype": "uint16", "tokens": tokens, "documents": sum(s["documents"] for s in shards), "inputs": [], "shards": shards}
    (root / MANIFEST).write_text(json.dumps(manifest))
    return hashing


def probe(root: str, args: argparse.Namespace) -> None:
    """In a fresh process: start-up time and the memory the data adds, printed as JSON."""
    import torch  # noqa: F401  (imported before measuring: it is not the data's cost)

    from fivefold.config import load_config
    from fivefold.data.loader import open_training_data

    before = resident_mb()
    start = time.perf_counter()
    config = load_config("tiny", [f"data.source={root}", "data.document_mask=true", f"train.seq_len={args.seq_len}",
                                  f"train.global_batch={args.global_batch}", "data.val_fraction=0.01"])
    _, sampler = open_training_data(config)
    sampler.local_rows_at(0, 0, 1)
    startup = time.perf_counter() - start
    for step in range(1, args.steps):
        sampler.local_rows_at(step * 9973, 0, 1)  # steps spread over the whole corpus
    after = resident_mb()
    print(json.dumps({"startup_s": startup, "private_mb": after["RssAnon"] - before["RssAnon"],
                      "mapped_mb": after["RssFile"] - before["RssFile"]}))


def resident_mb() -> dict[str, float]:
    """Resident memory now (Linux /proc), in MB: RssAnon (the process's own) and RssFile (mapped file pages).

    Mapped pages of the shards are page cache: shared, dropped by the kernel under pressure, and
    proportional to the windows read (the kernel maps whole page-cache folios, up to 2 MB each
    on recent kernels), not to the corpus.
    """
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 1024
    if len(fields) != 2:
        raise RuntimeError("no RssAnon/RssFile in /proc/self/status: the size sweep measures memory on Linux only")
    return fields


def bench_sizes(work: Path, args: argparse.Namespace) -> list[dict]:
    sizes = [s for s in (1_000_000, 10_000_000, 100_000_000, 1_000_000_000, 10_000_000_000) if s <= args.max_tokens]
    rows = []
    for tokens in sizes:
        root = work / f"synthetic-{tokens}"
        hashing = synthetic_shards(root, tokens)
        first = _run_probe(root, args)  # the first open checks every shard's sha256
        rows.append({"tokens": tokens, "first_open_s": first["startup_s"], "hash_s": hashing, "probes": []})
    for r in range(args.rounds):  # later opens, sizes in rotating order
        for row in rows[r % len(rows):] + rows[: r % len(rows)]:
            row["probes"].append(_run_probe(work / f"synthetic-{row['tokens']}", args))
    for row in rows:
        row["startup_s"] = statistics.median(p["startup_s"] for p in row["probes"])
        row["private_mb"] = statistics.median(p["private_mb"] for p in row["probes"])
        row["mapped_mb"] = statistics.median(p["mapped_mb"] for p in row["probes"])
    return rows


def _run_probe(root: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--probe", str(root), "--seq-len", str(args.seq_len),
           "--global-batch", str(args.global_batch), "--steps", str(args.steps)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe:
        probe(args.probe, args)
        return 0
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        prep, loader = {}, {}
        if not args.sizes_only:
            prep = bench_prepare(work, args.prepare_mb, args.rounds)
            print(f"prepare: {prep['tokens']:,} tokens; " + ", ".join(f"{k}: {v:,.0f} tokens/s" for k, v in prep["tokens_per_s"].items())
                  + f"; parallel/serial {prep['parallel_speedup']:.2f}x")
            loader = bench_loader_vs_training(work, args.preset, args.seq_len, args.global_batch, args.rounds)
            rates = loader["tokens_per_s"]
            print(f"loader {rates['loader']:,.0f} tokens/s vs training ({args.preset}) {rates['train_step']:,.0f} tokens/s: "
                  f"loader/training {loader['loader_over_training']:,.0f}x")
        sizes = bench_sizes(work, args)
        print(f"{'corpus tokens':>15} {'first open s':>13} {'start-up s':>11} {'private MB':>11} {'mapped MB':>10}"
              f"  (medians of {args.rounds} fresh processes, {args.steps} steps read)")
        for row in sizes:
            print(f"{row['tokens']:>15,} {row['first_open_s']:>13.2f} {row['startup_s']:>11.3f} "
                  f"{row['private_mb']:>11.1f} {row['mapped_mb']:>10.1f}")
    path = Path("bench_results") / "data.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"prepare": prep, "loader": loader, "sizes": sizes, "args": vars(args)}, indent=2))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

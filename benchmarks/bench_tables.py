"""Micro-benchmark: vectorised block tables + slot mapping vs per-request loop versions.

What it measures: one engine step's table building for B requests with 4k-token contexts,
``prepare_block_tables`` + ``prepare_slot_mapping`` (kvskill.runtime.tables) against two
straightforward implementations written here:

* ``loop_python``: per request, pad its block list and compute each token's slot with
  Python ints (``ids[pos // bs] * bs + pos % bs``), then one ``torch.tensor`` at the end;
* ``loop_torch``: per request, tensor ops for that request's tokens, then ``torch.cat``.

Two step shapes: decode (one new token per request at position 4096) and prefill (4096 new
tokens per request). Block ids are a seeded random permutation (non-sequential). Every
variant's output is checked against the vectorised one before timing. Variants are timed in
interleaved rounds in one process, one torch thread by default; ``*_ratio`` is loop time /
vectorised time over the best round of each (> 1: vectorised faster), ``*_median_ratio`` the
same over medians.

Each run measures twice: in this process (default glibc allocator: the multi-megabyte [T]
temporaries of big steps are unmapped on free and page-faulted back on the next call), and in
a child process whose glibc keeps freed memory (``RETAINED_HEAP_ENV``), which is what a
long-running engine with steady step sizes sees. Both sets go into one JSON file.

Run: ``.venv/bin/python benchmarks/bench_tables.py [--out benchmarks/results/bench_tables.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from kvskill.runtime.tables import (
    prepare_block_tables,
    prepare_slot_mapping,
    prepare_token_positions,
)

CONTEXT = 4096
BLOCK_SIZE = 128
BATCHES = (1, 64, 256)
REPO_ROOT = Path(__file__).resolve().parent.parent


def make_case(batch: int, prefill: bool, seed: int = 0) -> dict:
    """Block ids per request and the step's (computed, new) token counts."""
    blocks_per_request = -(-(CONTEXT + 1) // BLOCK_SIZE)
    gen = torch.Generator().manual_seed(seed)
    ids = (torch.randperm(batch * blocks_per_request, generator=gen) + 1).view(batch, -1)
    computed = [0 if prefill else CONTEXT] * batch
    new = [CONTEXT if prefill else 1] * batch
    return {"block_ids": ids.tolist(), "computed": computed, "new": new}


def vectorised(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    table = prepare_block_tables(case["block_ids"])
    request_index, positions = prepare_token_positions(
        torch.tensor(case["computed"]), torch.tensor(case["new"]), dtype=torch.int32
    )
    return table, prepare_slot_mapping(table, request_index, positions, BLOCK_SIZE)


def loop_python(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in case["block_ids"])
    rows, slots = [], []
    for ids, start, num_new in zip(case["block_ids"], case["computed"], case["new"], strict=True):
        rows.append(list(ids) + [0] * (width - len(ids)))
        for pos in range(start, start + num_new):
            slots.append(ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    return torch.tensor(rows, dtype=torch.int32), torch.tensor(slots, dtype=torch.int64)


def loop_torch(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in case["block_ids"])
    table = torch.zeros((len(case["block_ids"]), width), dtype=torch.int32)
    parts = []
    for b, (ids, start, num_new) in enumerate(
        zip(case["block_ids"], case["computed"], case["new"], strict=True)
    ):
        table[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(start, start + num_new)
        parts.append(table[b, pos // BLOCK_SIZE].to(torch.int64) * BLOCK_SIZE + pos % BLOCK_SIZE)
    return table, torch.cat(parts)


def interleaved_times(variants: dict, case: dict, budget_s: float) -> tuple[dict, int]:
    """Wall times of each variant, timed in rounds (A, B, C, A, B, C, ...).

    Interleaving spreads background load over all variants alike. On a shared machine a
    run is sometimes descheduled for a whole time slice (~10 ms), which can move even the
    median of sub-millisecond cases, so both the best and the median time are returned.
    """
    one_round = 0.0
    for fn in variants.values():  # warm-up, and the cost of one round
        start = time.perf_counter()
        fn(case)
        one_round += time.perf_counter() - start
    rounds = int(max(3, min(200, budget_s * len(variants) / max(one_round, 1e-7))))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn(case)
            times[name].append(time.perf_counter() - start)
    return times, rounds


def environment() -> dict:
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip()
            or None
        )
    except OSError:
        commit = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "git_commit": commit,
    }


def run(budget_s: float) -> dict:
    rows = []
    for step in ("decode", "prefill"):
        for batch in BATCHES:
            case = make_case(batch, prefill=step == "prefill")
            ref_table, ref_slots = vectorised(case)
            variants = {
                "vectorised": vectorised,
                "loop_python": loop_python,
                "loop_torch": loop_torch,
            }
            for name, fn in variants.items():
                table, slots = fn(case)
                assert torch.equal(table, ref_table) and torch.equal(slots, ref_slots), name
            times, rounds = interleaved_times(variants, case, budget_s)
            best = {name: min(t) for name, t in times.items()}
            median = {name: statistics.median(t) for name, t in times.items()}
            row = {
                "step": step,
                "batch": batch,
                "num_tokens": int(ref_slots.numel()),
                "rounds": rounds,
            }
            for name in variants:
                row[f"{name}_best_s"] = best[name]
                row[f"{name}_median_s"] = median[name]
                if name != "vectorised":
                    row[f"{name}_ratio"] = best[name] / best["vectorised"]
                    row[f"{name}_median_ratio"] = median[name] / median["vectorised"]
            fast = best["vectorised"]
            rows.append(row)
            print(
                f"{step:7s} B={batch:3d} T={row['num_tokens']:7d}  vectorised "
                f"{fast * 1e3:8.3f} ms  loop_python x{row['loop_python_ratio']:6.1f}  "
                f"loop_torch x{row['loop_torch_ratio']:6.1f}",
                file=sys.stderr,
            )
    return {
        "benchmark": "bench_tables",
        "context_tokens": CONTEXT,
        "block_size": BLOCK_SIZE,
        "ratio": "loop time / vectorised time: *_ratio from best times, *_median_ratio from medians, interleaved rounds in one process",
        "rows": rows,
        "environment": environment(),
    }


#: glibc settings that keep freed memory in the process heap: large [T] temporaries are then
#: reused instead of being unmapped and page-faulted back in on every call, which is what a
#: long-running engine with steady step sizes sees.
RETAINED_HEAP_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
    "MALLOC_TOP_PAD_": str(1 << 28),
}


def _run_retained_heap(args: argparse.Namespace) -> dict:
    """Run the same measurement in a child process started with ``RETAINED_HEAP_ENV``."""
    child_out = args.out.with_suffix(".retained_heap.tmp")
    cmd = [sys.executable, __file__, "--single", "--out", str(child_out)]
    cmd += ["--budget-s", str(args.budget_s), "--threads", str(args.threads)]
    subprocess.run(cmd, env={**os.environ, **RETAINED_HEAP_ENV}, check=True)
    try:
        return json.loads(child_out.read_text())
    finally:
        child_out.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "benchmarks/results/bench_tables.json"
    )
    parser.add_argument("--budget-s", type=float, default=0.5, help="time per variant and case")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads; 1 by default because these are latency-bound small ops "
        "and a shared machine makes multi-thread timings of them mostly scheduler noise",
    )
    parser.add_argument(
        "--single", action="store_true", help="only this process's allocator settings"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.single:
        result = run(args.budget_s)
    else:
        print("default allocator:", file=sys.stderr)
        result = {
            "benchmark": "bench_tables",
            "default_allocator": run(args.budget_s),
        }
        print(f"retained heap ({' '.join(RETAINED_HEAP_ENV)}):", file=sys.stderr)
        result["retained_heap"] = _run_retained_heap(args)
        result["retained_heap"]["allocator_env"] = RETAINED_HEAP_ENV
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

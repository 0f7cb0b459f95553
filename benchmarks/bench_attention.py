"""Micro-benchmark: paged decode attention of the reference operator vs dense SDPA.

What it measures: one decode step (one query token per request) of
``npu_fused_infer_attention_score`` from ``kvskill.runtime.ops.reference`` exactly as converted
models call it (TND query, 3-D paged cache ``[num_blocks, block_size, KVN*D]``, random
non-sequential block tables, ``sparse_mode=3`` with the 2048 causal tile, cumulative q lengths,
per-request kv lengths), against ``torch.nn.functional.scaled_dot_product_attention`` on the
same keys and values already gathered into dense ``[B, KVN, S, D]`` tensors (GQA through
``enable_gqa``). SDPA on pre-gathered data is the floor on this machine: it skips the block
gather, the mask and the layout work the operator must do.

Cases: batch 1 / 16 / 64 x context 512 / 4096, 8 query heads, 2 kv heads, head dim 64, block
size 128, fp32 (the dtype ``kvskill verify`` runs in on CPU). Every case first checks the two
outputs agree (max abs diff <= 1e-4). Times are medians over repeats in the same process;
``ratio`` = reference time / SDPA time (1.0 = as fast as the floor). ``gather_ms`` is the time
of the operator's block gather alone (``index_select`` of every request's K and V blocks into
reused buffers), to show where the gap comes from. One torch
thread by default (``--threads``), so that other load on a small machine disturbs both sides
alike.

Run: ``.venv/bin/python benchmarks/bench_attention.py [--out benchmarks/results/bench_attention.json]``
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
import torch.nn.functional as F
from kvskill.runtime.ops import reference as npu

REPO_ROOT = Path(__file__).resolve().parent.parent
BATCHES = (1, 16, 64)
CONTEXTS = (512, 4096)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 64, 128
SCALE = HEAD_DIM**-0.5
CAUSAL_TILE = torch.ones(2048, 2048, dtype=torch.bool).triu(diagonal=1)


def make_case(batch: int, context: int, seed: int = 0) -> dict:
    """A paged cache holding ``context`` tokens per request, plus the same data dense."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-context // BLOCK_SIZE)
    num_blocks = 1 + batch * blocks
    hidden = NUM_KV_HEADS * HEAD_DIM
    key_cache = torch.randn(num_blocks, BLOCK_SIZE, hidden, generator=gen)
    value_cache = torch.randn(num_blocks, BLOCK_SIZE, hidden, generator=gen)
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, blocks).int()
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen)

    def dense(cache: torch.Tensor) -> torch.Tensor:
        rows = cache[table.long()].view(batch, blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        return rows[:, :context].transpose(1, 2).contiguous()

    return {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_table": table,
        "kv_lens": [context] * batch,
        "cu_q": list(range(1, batch + 1)),
        "dense_k": dense(key_cache),
        "dense_v": dense(value_cache),
    }


def reference_op(case: dict) -> torch.Tensor:
    out, _ = npu.npu_fused_infer_attention_score(
        case["query"],
        case["key_cache"],
        case["value_cache"],
        num_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        input_layout="TND",
        scale=SCALE,
        atten_mask=CAUSAL_TILE,
        sparse_mode=3,
        block_table=case["block_table"],
        block_size=BLOCK_SIZE,
        actual_seq_lengths=case["cu_q"],
        actual_seq_lengths_kv=case["kv_lens"],
    )
    return out


def sdpa_dense(case: dict) -> torch.Tensor:
    q = case["query"].unsqueeze(2)  # [B, N, 1, D]
    out = F.scaled_dot_product_attention(
        q, case["dense_k"], case["dense_v"], scale=SCALE, enable_gqa=True
    )
    return out.squeeze(2)  # [B, N, D]


def gather_only(case: dict) -> torch.Tensor:
    """The operator's block gather alone: K and V blocks into reused buffers."""
    ids = case["block_table"].long().view(-1)
    if "gather_buf" not in case:
        case["gather_buf"] = [
            c.new_empty(ids.numel(), *c.shape[1:]) for c in (case["key_cache"], case["value_cache"])
        ]
    for cache, buf in zip(
        (case["key_cache"], case["value_cache"]), case["gather_buf"], strict=True
    ):
        torch.index_select(cache, 0, ids, out=buf)
    return case["gather_buf"]


def median_seconds(fn, case: dict, budget_s: float) -> tuple[float, int]:
    fn(case)  # warm up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 50):
        t0 = time.perf_counter()
        fn(case)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def environment() -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "git_commit": commit or None,
    }


def run(budget_s: float) -> dict:
    rows = []
    for context in CONTEXTS:
        for batch in BATCHES:
            case = make_case(batch, context)
            diff = float((reference_op(case) - sdpa_dense(case)).abs().max())
            if diff > 1e-4:
                raise AssertionError(f"outputs differ by {diff} at batch {batch}, ctx {context}")
            ref_s, ref_n = median_seconds(reference_op, case, budget_s)
            sdpa_s, sdpa_n = median_seconds(sdpa_dense, case, budget_s)
            gather_s, _ = median_seconds(gather_only, case, budget_s / 2)
            row = {
                "batch": batch,
                "context": context,
                "reference_ms": round(ref_s * 1e3, 3),
                "sdpa_dense_ms": round(sdpa_s * 1e3, 3),
                "ratio": round(ref_s / sdpa_s, 2),
                "gather_ms": round(gather_s * 1e3, 3),
                "repeats": [ref_n, sdpa_n],
                "max_abs_diff": diff,
            }
            rows.append(row)
            print(
                f"batch {batch:3d} ctx {context:5d}: reference {row['reference_ms']:9.3f} ms  "
                f"sdpa(dense) {row['sdpa_dense_ms']:9.3f} ms  ratio {row['ratio']:6.2f}  "
                f"(gather {row['gather_ms']:.3f} ms)",
                file=sys.stderr,
            )
            del case
    return {
        "benchmark": "bench_attention",
        "what": "paged decode attention, reference FA v1 (TND, 3-D paged KV, sparse_mode 3) "
        "vs SDPA on the same KV pre-gathered dense; ratio = reference / sdpa",
        "shape": {
            "num_heads": NUM_HEADS,
            "num_key_value_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": "float32",
        },
        "results": rows,
        "environment": environment(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "bench_attention.json"
    )
    parser.add_argument("--budget-s", type=float, default=1.5, help="timing budget per variant")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = run(args.budget_s)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

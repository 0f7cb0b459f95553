"""Run ``kvskill analyze`` over every causal-LM model type of the installed transformers.

Reports the outcome per model type (plan / refused / crash), the time per model, and the
ratio between the first (cold: libcst parse) and a second (warm: parse cached) pass measured
in the same run. Nothing is downloaded: configs are transformers' defaults.

    .venv/bin/python benchmarks/bench_analyzer_corpus.py [--limit N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvskill.analyzer.corpus import analyze_one, corpus_model_types  # noqa: E402


def _pass(types: list[str]) -> list:
    return [analyze_one(t) for t in types]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="Only the first N model types.")
    parser.add_argument("--json", type=Path, default=None, help="Write the results here.")
    args = parser.parse_args()
    types = corpus_model_types()[: args.limit]
    # Warm imports (transformers' auto mappings) so the first model does not pay for them.
    start = time.perf_counter()
    analyze_one("llama")
    import_seconds = time.perf_counter() - start
    cold_start, cold_cpu_start = time.perf_counter(), time.process_time()
    cold = _pass(types)
    cold_total = time.perf_counter() - cold_start
    cold_cpu = time.process_time() - cold_cpu_start
    warm_start = time.perf_counter()
    warm = _pass(types)
    warm_total = time.perf_counter() - warm_start
    counts = Counter(r.outcome for r in cold)
    seconds = [r.seconds for r in cold]
    print(f"{'model_type':<32} {'outcome':<8} {'cold s':>7} {'warm s':>7}  detail")
    for c, w in sorted(zip(cold, warm, strict=True), key=lambda p: -p[0].seconds):
        detail = (
            f"{c.kv_mode} {c.attention} {'+'.join(c.attn_types)}"
            if c.outcome == "plan"
            else (c.message or "")[:70]
        )
        print(f"{c.model_type:<32} {c.outcome:<8} {c.seconds:7.3f} {w.seconds:7.3f}  {detail}")
    print()
    print(f"model types: {len(types)}  outcomes: {dict(counts)}")
    print(f"first call (imports + llama): {import_seconds:.2f} s")
    print(
        f"cold pass: {cold_total:.2f} s total, median {statistics.median(seconds):.3f} s, "
        f"max {max(seconds):.3f} s per model; {cold_cpu:.2f} s of CPU"
    )
    print(f"warm pass: {warm_total:.2f} s total; cold/warm ratio {cold_total / warm_total:.1f}x")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "counts": dict(counts),
                    "cold_total_s": cold_total,
                    "cold_cpu_s": cold_cpu,
                    "warm_total_s": warm_total,
                    "results": [
                        {**r.__dict__, "warm_seconds": w.seconds}
                        for r, w in zip(cold, warm, strict=True)
                    ],
                },
                indent=2,
            ),
            encoding="utf-8",
        )
    return 1 if counts.get("crash") else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Run every benchmark in benchmarks/ (what `make bench` does); each writes its own results.

The micro-benchmarks (`bench_*.py`, found by name) run first with their defaults, then the
serving benchmark (`serve_bench.py`). Each runs in its own process with a time limit, one at a
time, so they never compete for the cores. A failing benchmark does not stop the others; the
exit code is 1 when any failed.

    .venv/bin/python benchmarks/run_all.py                   # everything (what make bench runs)
    .venv/bin/python benchmarks/run_all.py --only bench_tables,serve_bench
    .venv/bin/python benchmarks/run_all.py --serve-args "--workloads W1 --threads 1"
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: What `make bench` asks of the serving benchmark (its default model/thread pairs). The
#: one-request-at-a-time baseline is by far the slowest system (every token is its own
#: forward), so it gets one timed run after its warm-up; every other system gets the median of
#: three. This keeps `make bench` within 15 minutes on 2 cores.
SERVE_DEFAULT_ARGS = ["--repeats", "3", "--repeats-sequential", "1"]


def discover() -> list[str]:
    """Micro-benchmarks in name order, then the serving benchmark."""
    micro = sorted(p.stem for p in HERE.glob("bench_*.py"))
    return [*micro, "serve_bench"]


def run(name: str, args: list[str], timeout_s: float) -> tuple[bool, float, str]:
    cmd = [sys.executable, str(HERE / f"{name}.py"), *args]
    print(f"[run_all] {' '.join(shlex.quote(c) for c in cmd[1:])}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, timeout=timeout_s, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return False, time.perf_counter() - started, f"timed out after {timeout_s:.0f} s"
    elapsed = time.perf_counter() - started
    return proc.returncode == 0, elapsed, f"exit {proc.returncode}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated benchmark names")
    parser.add_argument("--skip", default="", help="comma-separated benchmark names")
    parser.add_argument(
        "--serve-args",
        default=None,
        help="arguments for serve_bench.py instead of the make-bench defaults",
    )
    parser.add_argument("--timeout", type=float, default=2400.0, help="seconds per benchmark")
    args = parser.parse_args(argv)

    names = discover()
    only = {n for n in args.only.split(",") if n}
    skip = {n for n in args.skip.split(",") if n}
    unknown = (only | skip) - set(names)
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {sorted(unknown)}; found: {', '.join(names)}")
    names = [n for n in names if (not only or n in only) and n not in skip]

    started = time.perf_counter()
    summary = []
    for name in names:
        if name != "serve_bench":
            summary.append((name, *run(name, [], args.timeout)))
            continue
        serve_args = SERVE_DEFAULT_ARGS if args.serve_args is None else shlex.split(args.serve_args)
        summary.append((name, *run(name, serve_args, args.timeout)))

    total = time.perf_counter() - started
    print(f"\n[run_all] {len(summary)} run(s) in {total:.0f} s", file=sys.stderr)
    for name, ok, elapsed, status in summary:
        print(
            f"  {'ok  ' if ok else 'FAIL'} {name:<24} {elapsed:7.1f} s  {status}", file=sys.stderr
        )
    return 0 if all(ok for _, ok, _, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())

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
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

#: What `make bench` may take on the 2-core reference machine; the summary says when a run
#: went over (most often because other work shared the cores: see the load averages).
BUDGET_S = 15 * 60

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
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=RESULTS,
        help="where the serving benchmark and this run's durations (run_all.json) go",
    )
    args = parser.parse_args(argv)

    names = discover()
    only = {n for n in args.only.split(",") if n}
    skip = {n for n in args.skip.split(",") if n}
    unknown = (only | skip) - set(names)
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {sorted(unknown)}; found: {', '.join(names)}")
    names = [n for n in names if (not only or n in only) and n not in skip]

    started = time.perf_counter()
    started_at = dt.datetime.now(dt.timezone.utc)
    load_before = _load_average()
    summary = []
    for name in names:
        if name != "serve_bench":
            summary.append((name, *run(name, [], args.timeout)))
            continue
        serve_args = SERVE_DEFAULT_ARGS if args.serve_args is None else shlex.split(args.serve_args)
        if args.results_dir != RESULTS:
            serve_args = [*serve_args, "--out-dir", str(args.results_dir)]
        summary.append((name, *run(name, serve_args, args.timeout)))

    total = time.perf_counter() - started
    load_after = _load_average()
    print(
        f"\n[run_all] {len(summary)} run(s) in {total:.0f} s ({total / 60:.1f} min; budget "
        f"{BUDGET_S / 60:.0f} min); load average before {load_before}, after {load_after}",
        file=sys.stderr,
    )
    for name, ok, elapsed, status in summary:
        print(
            f"  {'ok  ' if ok else 'FAIL'} {name:<24} {elapsed:7.1f} s  {status}", file=sys.stderr
        )
    if total > BUDGET_S:
        print(
            f"[run_all] over the {BUDGET_S / 60:.0f}-minute budget by {total - BUDGET_S:.0f} s; "
            "a load average above the core count means other work shared the cores",
            file=sys.stderr,
        )
    if not only and not skip and args.serve_args is None:
        # The durations of a complete default run, kept with the results they produced.
        args.results_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "date": started_at.isoformat(timespec="seconds"),
            "cores": os.cpu_count(),
            "total_s": round(total, 1),
            "budget_s": BUDGET_S,
            "load_average_before": load_before,
            "load_average_after": load_after,
            "serve_args": SERVE_DEFAULT_ARGS,
            "benchmarks": [
                {"name": n, "ok": ok, "seconds": round(e, 1), "status": st}
                for n, ok, e, st in summary
            ],
        }
        (args.results_dir / "run_all.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0 if all(ok for _, ok, _, _ in summary) else 1


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())

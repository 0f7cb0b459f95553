"""Run every benchmark in benchmarks/ (what `make bench` does); each writes its own results.

The micro-benchmarks (`bench_*.py`, found by name) run first with their defaults, then the
serving benchmark (`serve_bench.py`). Each runs in its own process with a time limit, one at a
time, so they never compete for the cores. A failing benchmark does not stop the others; the
exit code is 1 when any failed. The whole run has a 15-minute budget: the serving benchmark
gets what the others left as its deadline, and cells it cannot finish in time are reported as
cut rather than run past it (`--no-budget` runs everything).

    .venv/bin/python benchmarks/run_all.py                   # everything (what make bench runs)
    .venv/bin/python benchmarks/run_all.py --only bench_tables,serve_bench
    .venv/bin/python benchmarks/run_all.py --serve-args "--workloads W1 --threads 1"
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

#: What `make bench` may take on the 2-core reference machine; the summary says when a run
#: went over (most often because other work shared the cores: see the load averages).
BUDGET_S = 15 * 60
#: Kept back from the budget for the serving benchmark's report and the summary.
_REPORT_MARGIN_S = 20

#: What `make bench` asks of the serving benchmark (its default model/thread pairs). The
#: one-request-at-a-time baseline is by far the slowest system (every token is its own
#: forward), so it gets one timed run after its warm-up; every other system gets the median of
#: five (runs of one system vary by up to a fifth on the shared reference machine, so three
#: left the ratios near a bar to chance). This keeps `make bench` within 15 minutes on 2 cores.
SERVE_DEFAULT_ARGS = ["--repeats", "5", "--repeats-sequential", "1"]


#: Micro-benchmarks run with other arguments than their defaults under `make bench`: W5 times
#: one run per system (its with/without ratio is far from the noise; about a minute).
MICRO_ARGS = {"bench_prefix_cache": ["--repeats", "1"]}


def discover() -> list[str]:
    """Micro-benchmarks in name order, then the serving benchmark."""
    micro = sorted(p.stem for p in HERE.glob("bench_*.py"))
    return [*micro, "serve_bench"]


@dataclass(frozen=True)
class Outcome:
    name: str
    ok: bool
    #: wall seconds
    seconds: float
    #: CPU seconds (user + system) of the benchmark and the processes it waited for. The
    #: single-thread parts use one core, so this is about what they take on an idle machine;
    #: wall time above it is time spent waiting for cores held by other work.
    cpu_seconds: float
    status: str


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(name: str, args: list[str], timeout_s: float) -> Outcome:
    cmd = [sys.executable, str(HERE / f"{name}.py"), *args]
    print(f"[run_all] {' '.join(shlex.quote(c) for c in cmd[1:])}", file=sys.stderr, flush=True)
    started, cpu_before = time.perf_counter(), _children_cpu_s()
    try:
        proc = subprocess.run(cmd, timeout=timeout_s, env=dict(os.environ))
        ok, status = proc.returncode == 0, f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        ok, status = False, f"timed out after {timeout_s:.0f} s"
    elapsed = time.perf_counter() - started
    return Outcome(name, ok, elapsed, _children_cpu_s() - cpu_before, status)


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
        "--no-budget",
        action="store_true",
        help="let the serving benchmark run its whole plan however long it takes",
    )
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
            summary.append(run(name, MICRO_ARGS.get(name, []), args.timeout))
            continue
        serve_args = SERVE_DEFAULT_ARGS if args.serve_args is None else shlex.split(args.serve_args)
        if args.results_dir != RESULTS:
            serve_args = [*serve_args, "--out-dir", str(args.results_dir)]
        if args.serve_args is None and not args.no_budget:
            # Cells still running when the budget is spent are stopped and reported as such
            # (the plan puts the 2-thread cells, the ones contention slows most, last).
            left = BUDGET_S - (time.perf_counter() - started) - _REPORT_MARGIN_S
            serve_args = [*serve_args, "--deadline", f"{max(left, 1.0):.0f}"]
        summary.append(run(name, serve_args, args.timeout))

    total = time.perf_counter() - started
    cpu_total = sum(o.cpu_seconds for o in summary)
    load_after = _load_average()
    print(
        f"\n[run_all] {len(summary)} run(s) in {total:.0f} s ({total / 60:.1f} min; budget "
        f"{BUDGET_S / 60:.0f} min), {cpu_total:.0f} CPU s; load average before {load_before}, "
        f"after {load_after}",
        file=sys.stderr,
    )
    for o in summary:
        print(
            f"  {'ok  ' if o.ok else 'FAIL'} {o.name:<24} {o.seconds:7.1f} s  "
            f"{o.cpu_seconds:7.1f} CPU s  {o.status}",
            file=sys.stderr,
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
            "cpu_s": round(cpu_total, 1),
            "budget_s": BUDGET_S,
            "load_average_before": load_before,
            "load_average_after": load_after,
            "serve_args": SERVE_DEFAULT_ARGS,
            "benchmarks": [
                {
                    "name": o.name,
                    "ok": o.ok,
                    "seconds": round(o.seconds, 1),
                    "cpu_seconds": round(o.cpu_seconds, 1),
                    "status": o.status,
                }
                for o in summary
            ],
        }
        (args.results_dir / "run_all.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0 if all(o.ok for o in summary) else 1


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())

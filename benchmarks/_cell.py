"""One benchmark cell in its own process: build the model, warm up, time the repeats, write JSON.

Run by serve_bench.py; a fresh interpreter per cell keeps peak RSS per system.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    MODELS,
    build_reference_model,
    current_rss_mb,
    kv_bytes_per_token,
    make_workload,
    peak_rss_mb,
    set_threads,
)
from _hf_systems import NotRunnableError  # noqa: E402


def make_runner(system: str, model, spec, workload):
    """A callable Workload -> RunResult for `system`, plus a close() for its resources."""
    bpt = kv_bytes_per_token(spec)
    if system == "hf_padded":
        from _hf_systems import run_hf_padded

        return (lambda wl: run_hf_padded(model, wl, bytes_per_token=bpt)), None
    if system == "hf_sequential":
        from _hf_systems import run_hf_sequential

        return (lambda wl: run_hf_sequential(model, wl, bytes_per_token=bpt)), None
    if system == "hf_cb":
        from _hf_systems import HFContinuousBatching

        cb = HFContinuousBatching(
            model,
            bytes_per_token=bpt,
            kv_capacity_tokens=workload.kv_capacity_tokens,
            max_requests=workload.num_requests,
        )
        return cb.run, cb.close
    if system == "kvskill":
        from _kvskill_system import KvskillRuntime

        rt = KvskillRuntime(spec, model, kv_capacity_tokens=workload.kv_capacity_tokens)
        return rt.run, rt.close
    raise ValueError(f"unknown system {system!r}")


def _reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark (VmHWM) so the next reading covers one workload only."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _peak_rss_since_reset_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return peak_rss_mb()


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_workload(system: str, model, spec, workload_name: str, repeats: int) -> dict:
    workload = make_workload(workload_name, spec.vocab_size)
    gc.collect()
    per_workload_rss = _reset_peak_rss()
    run, close = make_runner(system, model, spec, workload)
    try:
        run(workload.warmup())
        runs, cpu_s = [], []
        for _ in range(repeats):
            cpu_before = _cpu_seconds()
            runs.append(run(workload))
            cpu_s.append(_cpu_seconds() - cpu_before)
    finally:
        if close is not None:
            close()
    walls = [r.wall_s for r in runs]
    median_run = sorted(runs, key=lambda r: r.wall_s)[len(runs) // 2]
    tokens = runs[0].tokens
    kv = median_run.kv
    return {
        "system": system,
        "workload": workload_name,
        "num_requests": workload.num_requests,
        "useful_tokens": workload.useful_tokens,
        "prompt_tokens": sum(len(p) for p in workload.prompts),
        "kv_capacity_tokens": workload.kv_capacity_tokens,
        "repeats": repeats,
        "wall_s": statistics.median(walls),
        "wall_s_runs": walls,
        # CPU seconds over wall seconds of the timed runs: close to the thread count on an idle
        # machine, well below it when other processes took the cores.
        "cpu_per_wall": sum(cpu_s) / sum(walls),
        "tokens_per_s": workload.useful_tokens / statistics.median(walls),
        "ttft_s": statistics.median(statistics.fmean(r.ttft_s) for r in runs),
        # VmHWM reset before this workload: its peak, on top of whatever the process already
        # held (weights, libraries, allocator caches). Without the reset: the process peak.
        "peak_rss_mb": _peak_rss_since_reset_mb() if per_workload_rss else peak_rss_mb(),
        "kv": None
        if kv is None
        else {
            "held_bytes": kv.held_bytes,
            "live_bytes": kv.live_bytes,
            "pool_bytes": kv.pool_bytes,
            "utilization": kv.utilization,
        },
        "deterministic": all(r.tokens == tokens for r in runs),
        "lengths_ok": [len(t) for t in tokens] == workload.max_tokens,
        "tokens": tokens,
        "extra": median_run.extra,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--system", required=True)
    p.add_argument("--workloads", required=True, help="comma-separated, run in this order")
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--repeats", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    warnings.filterwarnings("ignore")
    set_threads(args.threads)
    spec = MODELS[args.model]
    model = build_reference_model(spec)
    rss_after_load = current_rss_mb()
    records = []
    for name in args.workloads.split(","):
        try:
            rec = run_workload(args.system, model, spec, name, args.repeats)
        except NotRunnableError as exc:
            rec = {"system": args.system, "workload": name, "error": str(exc), "not_runnable": True}
        except Exception as exc:  # one failing workload must not hide the others' numbers
            rec = {"system": args.system, "workload": name, "error": f"{type(exc).__name__}: {exc}"}
        rec.update(model=args.model, threads=args.threads, rss_after_load_mb=rss_after_load)
        records.append(rec)
        # Written after every workload so a timeout still leaves the finished ones.
        args.out.write_text(json.dumps(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())

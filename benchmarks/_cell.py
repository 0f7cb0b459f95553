"""One model at one thread count in its own process: every system on every workload, the
systems' timed runs interleaved, one JSON record per (system, workload).

Run by serve_bench.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import sys
import warnings
from dataclasses import dataclass, field
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
    """Reset the kernel's high-water mark (VmHWM) so the next reading covers one run only."""
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


@dataclass
class _Turn:
    """One system's runs of one workload: its runner and what its timed runs measured."""

    system: str
    repeats: int
    run: object = None
    close: object = None
    runs: list = field(default_factory=list)
    cpu_s: list = field(default_factory=list)
    peak_rss_mb: float = 0.0
    error: str | None = None
    not_runnable: bool = False
    close_error: str | None = None

    def fail(self, exc: Exception) -> None:
        self.not_runnable = isinstance(exc, NotRunnableError)
        self.error = str(exc) if self.not_runnable else f"{type(exc).__name__}: {exc}"


def run_workload(
    systems: list[str], repeats: dict[str, int], model, spec, workload_name: str
) -> list[dict]:
    """Every system on one workload in this process, their timed runs interleaved.

    Round r runs each system's r-th repeat in turn, so the systems share this process (its
    allocator state, its memory placement) and the machine's slow and fast moments alike: a
    ratio of two systems is not a ratio of two processes, which on a shared VM differ by
    more than the effects measured. The order rotates by one system each round, so no system
    always runs first or always after the same one.
    """
    workload = make_workload(workload_name, spec.vocab_size)
    turns = [_Turn(system, repeats[system]) for system in systems]
    try:
        for turn in turns:
            try:
                turn.run, turn.close = make_runner(turn.system, model, spec, workload)
                turn.run(workload.warmup())
            except Exception as exc:  # one failing system must not hide the others' numbers
                turn.fail(exc)
        for round_ in range(max(t.repeats for t in turns)):
            shift = round_ % len(turns)
            for turn in turns[shift:] + turns[:shift]:
                if turn.error is not None or round_ >= turn.repeats:
                    continue
                # Every run starts from an empty young generation: a full collection costs
                # about 0.2 s in a process holding torch and transformers, and garbage left by
                # the system before must not trigger one inside this system's timed run.
                gc.collect()
                _reset_peak_rss()
                cpu_before = _cpu_seconds()
                try:
                    turn.runs.append(turn.run(workload))
                except Exception as exc:
                    turn.fail(exc)
                    continue
                turn.cpu_s.append(_cpu_seconds() - cpu_before)
                turn.peak_rss_mb = max(turn.peak_rss_mb, _peak_rss_since_reset_mb())
    finally:
        for turn in turns:
            if turn.close is None:
                continue
            try:
                turn.close()
            except Exception as exc:  # its runs are measured; the others must still close
                turn.close_error = f"{type(exc).__name__}: {exc}"
    return [_record(turn, workload, workload_name) for turn in turns]


def _record(turn: _Turn, workload, workload_name: str) -> dict:
    base = {"system": turn.system, "workload": workload_name}
    if turn.close_error is not None:
        base["close_error"] = turn.close_error
    if turn.error is not None:
        return base | {"error": turn.error, "not_runnable": turn.not_runnable}
    runs = turn.runs
    walls = [r.wall_s for r in runs]
    median_run = sorted(runs, key=lambda r: r.wall_s)[len(runs) // 2]
    tokens = runs[0].tokens
    kv = median_run.kv
    return base | {
        "num_requests": workload.num_requests,
        "useful_tokens": workload.useful_tokens,
        "prompt_tokens": sum(len(p) for p in workload.prompts),
        "kv_capacity_tokens": workload.kv_capacity_tokens,
        "repeats": turn.repeats,
        "wall_s": statistics.median(walls),
        "wall_s_runs": walls,
        # CPU seconds over wall seconds of the timed runs: close to the thread count on an idle
        # machine, well below it when other processes took the cores.
        "cpu_per_wall": sum(turn.cpu_s) / sum(walls),
        "tokens_per_s": workload.useful_tokens / statistics.median(walls),
        "ttft_s": statistics.median(statistics.fmean(r.ttft_s) for r in runs),
        # The process's high-water mark over this system's timed runs (reset before each):
        # everything resident counts, the shared libraries, the reference weights and the
        # other systems' idle state of this workload included.
        "peak_rss_mb": turn.peak_rss_mb,
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
    p.add_argument("--systems", required=True, help="comma-separated, run in this order")
    p.add_argument("--workloads", required=True, help="comma-separated, run in this order")
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--repeats", type=int, required=True)
    p.add_argument("--repeats-sequential", type=int, default=0, help="0: --repeats")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    warnings.filterwarnings("ignore")
    set_threads(args.threads)
    systems = args.systems.split(",")
    repeats = {s: args.repeats for s in systems}
    if "hf_sequential" in repeats and args.repeats_sequential:
        repeats["hf_sequential"] = args.repeats_sequential
    spec = MODELS[args.model]
    model = build_reference_model(spec)
    rss_after_load = current_rss_mb()
    records = []
    for name in args.workloads.split(","):
        try:
            cell = run_workload(systems, repeats, model, spec, name)
        except Exception as exc:  # one failing workload must not hide the others' numbers
            error = f"{type(exc).__name__}: {exc}"
            cell = [{"system": s, "workload": name, "error": error} for s in systems]
        for rec in cell:
            rec.update(model=args.model, threads=args.threads, rss_after_load_mb=rss_after_load)
        records += cell
        # Written after every workload so a timeout still leaves the finished ones.
        args.out.write_text(json.dumps(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())

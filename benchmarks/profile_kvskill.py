"""Where the kvskill runtime spends its time on one workload.

Three views of the same workload, each from its own run after a warm-up:

1. stages of a step, timed around the engine's own calls: scheduling (with KV allocation),
   building the step's inputs (block tables, slot mappings), the model forward, sampling,
   the scheduler's update; the rest of the step is bookkeeping;
2. the forward's operators by category (torch.profiler self CPU time): linear layers
   (matmuls), attention (the reference fused attention and the paged-decode kernel), the KV
   write, norms / rope / activations, and the rest;
3. the process's CPU time over its wall time (at 2 threads: how much of the second core the
   run used), and cProfile's Python functions by cumulative time (``--cprofile``).

    .venv/bin/python benchmarks/profile_kvskill.py --workload W2 --model qwen3-0.6b-8l --threads 2
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import resource
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    MODELS,
    PEER_ONLY_MODELS,
    build_reference_model,
    load_average,
    set_threads,
)
from _kvskill_system import KvskillRuntime  # noqa: E402
from peers_bench import get_workload  # noqa: E402

ALL_MODELS = {**MODELS, **PEER_ONLY_MODELS}

#: Operator name fragments by category, first match wins (lower-case names).
CATEGORIES = (
    ("linear (matmul)", ("addmm", "aten::mm", "aten::bmm", "aten::linear", "matmul")),
    ("attention", ("fused_infer_attention", "scaled_dot_product", "softmax", "paged_decode")),
    ("KV write (scatter)", ("scatter", "index_put", "index_copy")),
    ("norm / rope / activation", ("rsqrt", "pow", "mean", "silu", "aten::mul", "aten::add", "neg", "cat")),
    ("embedding / gather", ("embedding", "index_select", "aten::index")),
    ("copies / layout", ("copy_", "contiguous", "clone", "to", "view", "reshape", "transpose")),
)  # fmt: skip


def _category(op: str) -> str:
    low = op.lower()
    for name, keys in CATEGORIES:
        if any(k in low for k in keys):
            return name
    return "other ops"


class StageTimer:
    """Wall time of each stage of the engine's step, by wrapping the engine's own calls."""

    def __init__(self, engine) -> None:
        import kvskill.runtime.engine as engine_mod

        self.totals: dict[str, float] = defaultdict(float)
        self.engine = engine
        self._undo = []
        self._wrap(engine.scheduler, "schedule", "schedule + KV allocation")
        self._wrap(engine_mod, "build_step_inputs", "step inputs (tables, slots)")
        self._wrap(engine, "_forward", "model forward")
        self._wrap(engine, "_sample", "sampling")
        self._wrap(engine.scheduler, "update_from_output", "scheduler update")
        self._wrap(engine, "step", "whole step")

    def _wrap(self, owner, attr: str, label: str) -> None:
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[label] += time.perf_counter() - t0

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original))

    def close(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)

    def report(self) -> dict[str, float]:
        out = dict(self.totals)
        step = out.get("whole step", 0.0)
        inner = sum(v for k, v in out.items() if k != "whole step")
        out["bookkeeping (rest of step)"] = max(0.0, step - inner)
        return out


class StepLog:
    """Each step's wall time with the tokens and requests it scheduled."""

    def __init__(self, engine) -> None:
        self.rows: list[tuple[float, int, int]] = []  # (seconds, tokens, requests)
        self.engine = engine
        self._schedule, self._step = engine.scheduler.schedule, engine.step
        scheduled: list[tuple[int, int]] = []

        def schedule():
            out = self._schedule()
            scheduled.append((sum(s.num_new_tokens for s in out.scheduled), len(out.scheduled)))
            return out

        def step():
            t0 = time.perf_counter()
            try:
                return self._step()
            finally:
                if scheduled and scheduled[-1][1]:
                    self.rows.append((time.perf_counter() - t0, *scheduled.pop()))
                scheduled.clear()

        engine.scheduler.schedule, engine.step = schedule, step

    def close(self) -> None:
        self.engine.scheduler.schedule, self.engine.step = self._schedule, self._step

    def report(self) -> list[str]:
        """Prefill steps one by one (any step with more tokens than requests), then the
        decode steps' median."""
        lines = [
            f"  prefill step {sec * 1000:7.0f} ms  {tokens:5d} tokens  {reqs:3d} requests"
            for sec, tokens, reqs in self.rows
            if tokens > reqs
        ]
        decode = sorted(sec for sec, tokens, reqs in self.rows if tokens == reqs)
        if decode:
            lines.append(
                f"  decode steps: {len(decode)}, median {decode[len(decode) // 2] * 1000:.1f} ms, "
                f"{sum(decode):.2f} s in all"
            )
        return lines


def _cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W1")
    parser.add_argument("--model", default="qwen3-4l-h256", choices=sorted(ALL_MODELS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--cprofile", action="store_true", help="also a cProfile run")
    parser.add_argument(
        "--prepack", action="store_true", help="LLM(prepack_linear=True), as kvskill_prepack"
    )
    parser.add_argument(
        "--fuse-layers",
        action="store_true",
        help="LLM(prepack_linear=True, fuse_layers=True), as kvskill_fused",
    )
    parser.add_argument(
        "--screen-output-head",
        action="store_true",
        help="LLM(screen_output_head=True); with --fuse-layers as kvskill_screen",
    )
    parser.add_argument("--json", type=Path, help="write the breakdown here")
    args = parser.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    warnings.filterwarnings("ignore")
    set_threads(args.threads)
    spec = ALL_MODELS[args.model]
    workload = get_workload(args.workload, spec.vocab_size)
    reference = build_reference_model(spec)
    rt = KvskillRuntime(
        spec,
        reference,
        kv_capacity_tokens=workload.kv_capacity_tokens,
        prepack_linear=args.prepack or args.fuse_layers,
        fuse_layers=args.fuse_layers,
        screen_output_head=args.screen_output_head,
    )
    try:
        rt.run(workload.warmup())
        load = load_average()
        cpu0 = _cpu_s()
        plain = rt.run(workload)
        cpu_plain = _cpu_s() - cpu0
        timer = StageTimer(rt.llm.engine)
        steps = StepLog(rt.llm.engine)
        try:
            staged = rt.run(workload)
        finally:
            steps.close()
            timer.close()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            profiled = rt.run(workload)
        profiler = None
        if args.cprofile:
            profiler = cProfile.Profile()
            profiler.enable()
            rt.run(workload)
            profiler.disable()
    finally:
        rt.close()

    stages = timer.report()
    ops = defaultdict(float)
    for evt in prof.key_averages():
        ops[_category(evt.key)] += evt.self_cpu_time_total / 1e6
    total_ops = sum(ops.values())
    print(
        f"{args.workload} {args.model} threads={args.threads} prepack={args.prepack} "
        f"fuse_layers={args.fuse_layers} "
        f"(load average {load}): wall "
        f"{plain.wall_s:.2f} s, CPU {cpu_plain:.2f} s (CPU/wall {cpu_plain / plain.wall_s:.2f}); "
        f"{staged.wall_s:.2f} s with stage timers, {profiled.wall_s:.2f} s under torch.profiler"
    )
    print("\n== stages of a step (wall s, share of the run) ==")
    for k, v in sorted(stages.items(), key=lambda kv: -kv[1]):
        print(f"  {k:30s} {v:8.3f}  {v / staged.wall_s:6.1%}")
    print("\n== steps (the stage-timed run) ==")
    print("\n".join(steps.report()))
    print("\n== forward operators by category (self CPU s summed over threads) ==")
    for k, v in sorted(ops.items(), key=lambda kv: -kv[1]):
        print(f"  {k:30s} {v:8.3f}  {v / total_ops:6.1%}")
    print("\n== torch.profiler: ops by self CPU time ==")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if profiler is not None:
        print("== cProfile: Python functions by cumulative time ==")
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(args.top)
        print(buf.getvalue())
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "workload": args.workload,
                    "model": args.model,
                    "threads": args.threads,
                    "prepack_linear": args.prepack or args.fuse_layers,
                    "fuse_layers": args.fuse_layers,
                    "screen_output_head": args.screen_output_head,
                    "load_average": load,
                    "wall_s": plain.wall_s,
                    "cpu_s": cpu_plain,
                    "stages_s": stages,
                    "staged_wall_s": staged.wall_s,
                    "steps": [
                        {"s": sec, "tokens": tokens, "requests": reqs}
                        for sec, tokens, reqs in steps.rows
                    ],
                    "op_categories_cpu_s": dict(ops),
                },
                indent=1,
            )
            + "\n"
        )
    torch.set_num_threads(args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())

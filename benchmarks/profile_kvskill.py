"""Where the kvskill runtime spends its time on one workload: torch.profiler op table plus a
cProfile table of Python functions (the host side).

    .venv/bin/python benchmarks/profile_kvskill.py --workload W1 --model qwen3-4l-h256
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MODELS, build_reference_model, make_workload, set_threads  # noqa: E402
from _kvskill_system import KvskillRuntime  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W1")
    parser.add_argument("--model", default="qwen3-4l-h256", choices=sorted(MODELS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    warnings.filterwarnings("ignore")
    set_threads(args.threads)
    spec = MODELS[args.model]
    workload = make_workload(args.workload, spec.vocab_size)
    reference = build_reference_model(spec)
    rt = KvskillRuntime(spec, reference, kv_capacity_tokens=workload.kv_capacity_tokens)
    try:
        rt.run(workload.warmup())
        plain = rt.run(workload)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            profiled = rt.run(workload)
        profiler = cProfile.Profile()
        profiler.enable()
        rt.run(workload)
        profiler.disable()
    finally:
        rt.close()

    print(
        f"{args.workload} {args.model} threads={args.threads}: wall {plain.wall_s:.2f} s "
        f"unprofiled, {profiled.wall_s:.2f} s under torch.profiler; host overhead "
        f"{plain.extra['host_overhead']:.3f} (all), decode at full batch "
        f"{plain.extra['host_overhead_full_batch']}"
    )
    print("\n== torch.profiler: ops by self CPU time ==")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    print("== cProfile: Python functions by cumulative time ==")
    buf = io.StringIO()
    pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(args.top)
    print(buf.getvalue())
    torch.set_num_threads(args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())

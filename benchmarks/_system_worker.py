"""One in-process system of the peer benchmark (a kvskill configuration or a transformers
path) in a process of its own, so its peak RSS and CPU time are its own.

Started by peers_bench.py with kvskill's python: argv[1] is the job as JSON (model, system,
checkpoint directory, the workload's KV capacity and request count, threads), argv[2] the file
descriptor to answer on. It loads the checkpoint, builds the system, answers {"ready": true},
then reads one JSON line per run on stdin ({"prompts", "max_tokens"}, as vLLM's runner does)
and answers one line per run: tokens, wall time, per-request TTFT, CPU seconds and the
process's peak RSS during the run. It serves one workload (the runners size their pools for
it).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def build_runner(system: str, reference, spec, *, kv_capacity_tokens: int, num_requests: int):
    """The system's ``run(Workload) -> RunResult`` (``_common``'s), and its close or None."""
    from _common import kv_bytes_per_token
    from peers_bench import KVSKILL_OPTIONS

    if system in KVSKILL_OPTIONS:
        from _kvskill_system import KvskillRuntime

        options = KVSKILL_OPTIONS[system]
        rt = KvskillRuntime(spec, reference, kv_capacity_tokens=kv_capacity_tokens, **options)
        if options.get("graph"):
            stats = rt.capture_buckets(num_requests)
            print(f"[{system}] captured before timing: {stats}", file=sys.stderr, flush=True)
        return rt.run, rt.close
    bpt = kv_bytes_per_token(spec)
    if system == "hf_padded":
        from _hf_systems import run_hf_padded

        return (lambda w: run_hf_padded(reference, w, bytes_per_token=bpt)), None
    if system == "hf_cb":
        if not hasattr(reference, "init_continuous_batching"):
            raise RuntimeError("this transformers has no continuous batching")
        from _hf_systems import HFContinuousBatching

        cb = HFContinuousBatching(
            reference,
            bytes_per_token=bpt,
            kv_capacity_tokens=kv_capacity_tokens,
            max_requests=num_requests,
        )
        return cb.run, cb.close
    raise ValueError(f"unknown system {system!r}")


def _cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    job = json.loads(sys.argv[1])
    reply = os.fdopen(int(sys.argv[2]), "w", buffering=1)
    # Library output must not reach the reply channel.
    os.dup2(2, 1)
    warnings.filterwarnings("ignore")

    import torch
    from _cell import _peak_rss_since_reset_mb, _reset_peak_rss
    from _common import Workload, set_threads
    from peers_bench import ALL_MODELS, load_reference

    set_threads(int(job["threads"]))
    spec = ALL_MODELS[job["model"]]
    reference = load_reference(Path(job["checkpoint"]))
    run, close = build_runner(
        job["system"],
        reference,
        spec,
        kv_capacity_tokens=int(job["kv_capacity_tokens"]),
        num_requests=int(job["num_requests"]),
    )
    reply.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        workload = Workload(
            name="run",
            description="",
            prompts=request["prompts"],
            max_tokens=request["max_tokens"],
            kv_capacity_tokens=int(job["kv_capacity_tokens"]),
        )
        gc.collect()
        _reset_peak_rss()
        cpu_before = _cpu_seconds()
        with torch.inference_mode():
            result = run(workload)
        reply.write(
            json.dumps(
                {
                    "tokens": result.tokens,
                    "wall_s": result.wall_s,
                    "ttft_s": result.ttft_s,
                    "cpu_s": _cpu_seconds() - cpu_before,
                    "peak_rss_mb": _peak_rss_since_reset_mb(),
                }
            )
            + "\n"
        )
    if close is not None:
        close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

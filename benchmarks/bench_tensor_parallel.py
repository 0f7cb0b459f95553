"""Tensor parallelism on this machine: the W1 workload on the 4-layer Qwen3 model at tp=1 and
tp=2 (gloo, one process per rank), with rank 0's communication time per step.

On a 2-core host the two ranks share the cores tp=1 uses alone, and every layer adds two
all-reduces (attention output, MLP output) plus one broadcast of the step's inputs per step,
so tp=2 is expected to be slower here: the point is to measure by how much and where the
time goes, and that the tokens are the same. The load average before and after is recorded
because other work on the host changes the numbers.

    .venv/bin/python benchmarks/bench_tensor_parallel.py            # W1, about 2 minutes
    .venv/bin/python benchmarks/bench_tensor_parallel.py --workload W2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import BLOCK_SIZE, MODELS, TOKEN_BUDGET, make_workload  # noqa: E402
from _kvskill_system import convert  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_tensor_parallel.json"


def _prepare(spec, root: Path) -> Path:
    """The converted model with seeded weights saved next to it (each rank reads its slice)."""
    from kvskill.runtime.loader import load_model
    from safetensors.torch import save_model

    directory = convert(spec, root / spec.name)
    model = load_model(directory, seed=spec.seed, random_weights=True).model
    save_model(model, str(directory / "model.safetensors"))
    return directory


def _run(directory: Path, workload, tp: int, threads: int) -> dict:
    from kvskill.runtime import LLM, EngineConfig, SamplingParams
    from kvskill.runtime.distributed.report import tensor_parallel_summary

    torch.set_num_threads(threads)
    started = time.perf_counter()
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        num_blocks=workload.kv_capacity_tokens // BLOCK_SIZE + 1,
        max_num_batched_tokens=TOKEN_BUDGET,
        max_num_seqs=256,
        tensor_parallel_size=tp,
    )
    llm = LLM(directory, config)
    start_s = time.perf_counter() - started
    with llm:
        warm = workload.warmup()
        llm.generate(
            warm.prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in warm.max_tokens]
        )
        llm.kv_manager.reset_prefix_cache()
        steps0, forward0 = llm.stats.num_steps, llm.stats.forward_s
        comm0 = llm.tensor_parallel.group.stats.total_s if llm.tensor_parallel else 0.0
        reduce0 = llm.tensor_parallel.group.stats.all_reduce_s if llm.tensor_parallel else 0.0
        params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in workload.max_tokens]
        started = time.perf_counter()
        outputs = llm.generate(workload.prompts, params)
        wall = time.perf_counter() - started
        steps = llm.stats.num_steps - steps0
        generated = sum(len(o.token_ids) for o in outputs)
        row = {
            "tp": tp,
            "threads_per_rank": torch.get_num_threads(),
            "start_s": round(start_s, 2),
            "wall_s": round(wall, 3),
            "throughput_tok_s": round(generated / wall, 1),
            "steps": steps,
            "step_ms": round(wall / steps * 1e3, 2),
            "forward_ms_per_step": round((llm.stats.forward_s - forward0) / steps * 1e3, 2),
            "tokens": [list(o.token_ids) for o in outputs],
        }
        if llm.tensor_parallel:
            stats = llm.tensor_parallel.group.stats
            row["comm_ms_per_step"] = round((stats.total_s - comm0) / steps * 1e3, 2)
            row["all_reduce_ms_per_step"] = round((stats.all_reduce_s - reduce0) / steps * 1e3, 2)
            summary = tensor_parallel_summary(llm)
            row["all_reduces_per_forward"] = summary["all_reduces_per_forward"]
            row["kv_bytes_per_token_per_rank"] = summary["kv_bytes_per_token_per_rank"]
            row["kv_bytes_per_token_unsplit"] = summary["kv_bytes_per_token_unsplit"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W1")
    parser.add_argument("--model", default="qwen3-4l-h256")
    args = parser.parse_args()
    spec = MODELS[args.model]
    workload = make_workload(args.workload, spec.vocab_size)
    load_before = os.getloadavg()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="kvskill-bench-tp-") as root:
        directory = _prepare(spec, Path(root))
        rows = [
            _run(directory, workload, tp=1, threads=cores),
            _run(directory, workload, tp=1, threads=1),
            _run(directory, workload, tp=2, threads=max(1, cores // 2)),
        ]
    load_after = os.getloadavg()
    reference = rows[0]["tokens"]
    for row in rows:
        row["tokens_equal_tp1"] = row.pop("tokens") == reference
    result = {
        "benchmark": "bench_tensor_parallel",
        "model": spec.name,
        "workload": workload.name,
        "workload_description": workload.description,
        "cpu_count": cores,
        "torch": torch.__version__,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load_after],
        "rows": rows,
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

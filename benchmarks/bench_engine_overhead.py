"""Micro-benchmark: the engine's per-step host overhead (everything but the model forward).

What it measures: decode steps of ``LLMEngine`` at batch 1 / 32 / 128 with the hand-written
converted toy model (tests/fixtures/toy_model: one full-attention and one sliding-window
layer, reference operators on the CPU). For each step the engine reports its wall time and
the time spent inside the model forward; the rest is host overhead: scheduling and KV
allocation, packing inputs, block tables and slot mappings, sampling and bookkeeping. The
overhead is also split by stage (schedule / inputs / sample / update) by timing those calls
from outside the engine. Two model sizes show how the fraction moves as the forward grows;
on an NPU the forward is far faster than these CPU reference ops, so the absolute host
milliseconds per step are the number to carry over, the fraction is the CPU picture.

Every number comes from the same process; medians over the timed decode steps.

Run: ``.venv/bin/python benchmarks/bench_engine_overhead.py [--out PATH] [--steps 20]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "fixtures"))

import kvskill.runtime.engine as engine_module  # noqa: E402
from _common import environment, load_average, set_threads  # noqa: E402
from kvskill.runtime import LLM, EngineConfig, SamplingParams  # noqa: E402
from toy_factory import write_toy_dir  # noqa: E402

BATCHES = (1, 32, 128)
PROMPT_LEN = 48
MODELS = {
    # name: config overrides of the toy model
    "toy-h64-l2": {},
    "small-h256-l4": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "vocab_size": 4096,
        "layer_types": ["full_attention", "sliding_attention"] * 2,
        "sliding_window": 32,
    },
}


class StageTimer:
    """Wraps the engine's stage functions and accumulates their time for the current step."""

    def __init__(self, llm: LLM) -> None:
        self.current: dict[str, float] = {}
        eng = llm.engine
        eng.scheduler.schedule = self._wrap("schedule", eng.scheduler.schedule)
        eng.scheduler.update_from_output = self._wrap("update", eng.scheduler.update_from_output)
        eng._sample = self._wrap("sample", eng._sample)
        self._original_inputs = engine_module.build_step_inputs
        engine_module.build_step_inputs = self._wrap("inputs", self._original_inputs)

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - started

        return timed

    def restore(self) -> None:
        engine_module.build_step_inputs = self._original_inputs


def measure(llm: LLM, batch: int, steps: int, seed: int) -> dict:
    """Time ``steps`` decode steps with ``batch`` requests running."""
    import random

    rng = random.Random(seed)
    vocab = llm.engine.vocab_size
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(vocab) for _ in range(PROMPT_LEN)], params)
    # Prefill (and one warm-up decode) untimed.
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()
    timer = StageTimer(llm)
    rows = []
    try:
        for _ in range(steps):
            timer.current = {}
            step_before, forward_before = engine.stats.step_s, engine.stats.forward_s
            outputs = engine.step()
            assert len(outputs) == batch, "every request must decode in every timed step"
            step_s = engine.stats.step_s - step_before
            forward_s = engine.stats.forward_s - forward_before
            rows.append({"step_s": step_s, "forward_s": forward_s, **timer.current})
    finally:
        timer.restore()
    while engine.has_unfinished_requests():
        engine.step()

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows)

    step_ms, forward_ms = median("step_s") * 1e3, median("forward_s") * 1e3
    host = [(r["step_s"] - r["forward_s"]) * 1e3 for r in rows]
    host_ms = statistics.median(host)
    return {
        "batch": batch,
        "timed_steps": steps,
        "step_ms": round(step_ms, 3),
        "forward_ms": round(forward_ms, 3),
        "host_ms": round(host_ms, 3),
        "host_fraction": round(host_ms / step_ms, 4),
        "host_us_per_request": round(host_ms * 1e3 / batch, 2),
        "stages_ms": {
            k: round(median(k) * 1e3, 3) for k in ("schedule", "inputs", "sample", "update")
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "bench_engine_overhead.json")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per case")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in MODELS.items():
            model_dir = write_toy_dir(Path(tmp) / name, seed=0, **overrides)
            for batch in BATCHES:
                config = EngineConfig(
                    trust_remote_code=True,
                    block_size=16,
                    num_blocks=batch * (PROMPT_LEN + args.steps + 8) // 16 + 2 * batch + 8,
                    max_num_seqs=batch,
                    max_num_batched_tokens=max(2048, batch * PROMPT_LEN),
                    free_block_order_seed=0,
                    exact=True,  # the host overhead around the model's own code, as recorded
                )
                llm = LLM(model_dir, config)
                row = {"model": name, **measure(llm, batch, args.steps, seed=batch)}
                results.append(row)
                print(
                    f"{name:14s} batch {batch:4d}: step {row['step_ms']:8.2f} ms, forward "
                    f"{row['forward_ms']:8.2f} ms, host {row['host_ms']:6.2f} ms "
                    f"({row['host_fraction']:.1%}), stages {row['stages_ms']}",
                    file=sys.stderr,
                )
    report = {
        "benchmark": "bench_engine_overhead",
        "prompt_len": PROMPT_LEN,
        "threads": args.threads,
        "load_average": load_average(),
        "environment": environment(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

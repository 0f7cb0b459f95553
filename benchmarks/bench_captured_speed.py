"""Captured decode against eager on the peer benchmark's model: per decode step and tokens/s.

Every system serves the same converted model (``qwen3-0.6b-8l`` of ``_common.py``: Qwen3-0.6B's
widths, heads and vocabulary cut to 8 layers; or ``--tiny``: 2 layers of hidden 64) with the
same seeded weights, in ONE process, so that the machine's load, which other processes
change from second to second on a shared machine, falls on all of them alike:

- ``eager``: ``LLM``'s defaults (the fast paths on where the machine allows them);
- ``exact``: ``exact=True`` (the model's own code; ``--skip-exact`` leaves it out: at the 0.6B
  shape its steps take several times the others', which makes a run long);
- ``graph:<backend>``: the defaults with ``graph=True``, captured with that torch.compile
  backend (``KVSKILL_GRAPH_BACKEND``).

Per batch size: one warm-up round per system (it captures the bucket: its time is reported as
the compile cost), then ``--rounds`` rounds, the systems' order reversed every other round;
each round generates ``--tokens`` greedy tokens for every request. Reported per system: the
median and 20th percentile of the decode step time (``LLM.engine.step``, prefill excluded),
the median tokens/s over rounds, the ratio of each to eager's, and whether its tokens are
eager's.

Run: ``.venv/bin/python benchmarks/bench_captured_speed.py [--tiny] [--batches 1,4]
[--backends eager,inductor] [--skip-exact] [--rounds 4] [--tokens 32] [--threads 2]
[--out PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from _common import PEER_ONLY_MODELS, ModelSpec  # noqa: E402

#: two layers of hidden 64: where per-operator overhead, not arithmetic, is the step
TINY = ModelSpec(
    name="qwen3-tiny",
    overrides={
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 256,
        "max_position_embeddings": 256,
    },
    note="Qwen3, 2 layers, hidden 64, 4/2 heads of 16, vocab 256",
)
MAX_MODEL_LEN = 256


def _llm(model_dir: Path, system: str, max_num_seqs: int):
    from kvskill.runtime import LLM

    mode, _, backend = system.partition(":")
    settings = {"exact": True} if mode == "exact" else {"graph": mode == "graph"}
    previous = os.environ.get("KVSKILL_GRAPH_BACKEND")
    if backend:
        os.environ["KVSKILL_GRAPH_BACKEND"] = backend
    try:
        llm = LLM(
            model_dir,
            random_weights=True,
            seed=1,
            max_num_seqs=max_num_seqs,
            max_model_len=MAX_MODEL_LEN,
            cpu_only_shapes=True,
            **settings,
        )
    finally:
        if previous is None:
            os.environ.pop("KVSKILL_GRAPH_BACKEND", None)
        else:
            os.environ["KVSKILL_GRAPH_BACKEND"] = previous
    step_s: list[float] = []
    step = llm.engine.step

    def timed_step():
        started = time.perf_counter()
        out = step()
        step_s.append(time.perf_counter() - started)
        return out

    llm.engine.step = timed_step
    return llm, step_s


def _round(llm, step_s: list[float], batch: int, tokens: int, vocab: int):
    """(tokens of each request, decode step times, wall seconds) of one generate call."""
    from kvskill.runtime import SamplingParams

    generator = torch.Generator().manual_seed(batch)
    prompts = [
        torch.randint(0, vocab, (12 + i % 5,), generator=generator).tolist() for i in range(batch)
    ]
    step_s.clear()
    started = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    wall = time.perf_counter() - started
    return [o.token_ids for o in outs], step_s[1:], wall  # step 0: the prompts' prefill


def measure(spec: ModelSpec, systems: list[str], batches: list[int], args) -> list[dict]:
    from _kvskill_system import convert

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = convert(spec, Path(tmp) / spec.name)
        llms = {s: _llm(model_dir, s, max(batches)) for s in systems}
        for batch in batches:
            warmup_s = {}
            for system, (llm, step_s) in llms.items():
                started = time.perf_counter()
                _round(llm, step_s, batch, 3, spec.vocab_size)
                warmup_s[system] = time.perf_counter() - started
            per = {s: {"steps": [], "tok_s": [], "tokens": None} for s in systems}
            for index in range(args.rounds):
                for system in systems if index % 2 == 0 else systems[::-1]:
                    llm, step_s = llms[system]
                    tokens, steps, wall = _round(llm, step_s, batch, args.tokens, spec.vocab_size)
                    per[system]["steps"] += steps
                    per[system]["tok_s"].append(batch * args.tokens / wall)
                    per[system]["tokens"] = tokens
            base = per[systems[0]]
            for system in systems:
                steps = sorted(per[system]["steps"])
                captured = llms[system][0].engine.captured_decode
                row = {
                    "model": spec.name,
                    "batch": batch,
                    "system": system,
                    "median_step_ms": statistics.median(steps) * 1e3,
                    "p20_step_ms": steps[len(steps) // 5] * 1e3,
                    "tok_s": statistics.median(per[system]["tok_s"]),
                    "step_ratio_vs_eager": statistics.median(steps)
                    / statistics.median(base["steps"]),
                    "tok_s_ratio_vs_eager": statistics.median(per[system]["tok_s"])
                    / statistics.median(base["tok_s"]),
                    "tokens_equal_eager": per[system]["tokens"] == base["tokens"],
                    "warmup_s": warmup_s[system],
                    "compile_s": captured.stats.compile_s if captured else None,
                    "eager_decode_steps": (
                        captured.stats.num_eager_decode_steps if captured else None
                    ),
                    "fast_paths": [p.name for p in llms[system][0].fast_paths.paths if p.on],
                    "load_average": os.getloadavg(),
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--backends", default="eager,inductor")
    parser.add_argument("--skip-exact", action="store_true", help="leave the exact system out")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = TINY if args.tiny else PEER_ONLY_MODELS["qwen3-0.6b-8l"]
    systems = ["eager", *([] if args.skip_exact else ["exact"])]
    systems += [f"graph:{b}" for b in args.backends.split(",") if b]
    batches = [int(b) for b in args.batches.split(",")]
    rows = measure(spec, systems, batches, args)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

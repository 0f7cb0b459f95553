"""Speculative decoding with an MTP layer: tokens/s with and without it, in the same process.

What it measures: a DeepSeek-V3-shaped model (MLA, MoE, one MTP layer; shrunk; or
GLM-4-MoE-shaped, GQA, with ``--family glm4_moe``) converted by ``kvskill apply`` and built to
agree: its main model's logits depend only on the current
token and its MTP layer predicts exactly the main model's next token
(``tests/fixtures/mtp_checkpoints.agreeing_state``), so every draft is accepted. This shows
the mechanism's ceiling with one MTP layer (two tokens per decode step), not what a trained
checkpoint reaches: with random weights acceptance is near zero and a speculative step only
costs more. Two ``LLM``s over the same directory differ only in ``speculative_tokens``;
runs alternate between them (a warm-up each, then the timed repeats). Reported: generated
tokens/s of each (median), their ratio, acceptance rate, tokens per request per decode step,
decode steps, and whether both produced the same tokens (greedy; they must).

Run: ``.venv/bin/python benchmarks/bench_speculative.py [--family deepseek_v3|glm4_moe]
[--speculative-tokens 1]
[--requests 8] [--prompt-len 32]
[--max-tokens 64] [--hidden-size 256] [--repeats 3] [--out PATH]``
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

import torch  # noqa: E402
from _common import environment, load_average, set_threads  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("deepseek_v3", "glm4_moe"), default="deepseek_v3")
    parser.add_argument("--speculative-tokens", type=int, default=1)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.out is None:
        suffix = "" if args.family == "deepseek_v3" else f"-{args.family}"
        if args.speculative_tokens != 1:
            suffix += f"-k{args.speculative_tokens}"
        args.out = HERE / "results" / f"bench_speculative{suffix}.json"
    set_threads(args.threads)

    from kvskill.runtime import LLM, SamplingParams
    from mla_models import tiny_config
    from mtp_checkpoints import GLM4_MOE, agreeing_state, convert_checkpoint, mtp_state

    load_before = load_average()
    sizes = dict(
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        moe_intermediate_size=args.hidden_size // 2,
        num_hidden_layers=args.layers,
        max_position_embeddings=1024,
    )
    if args.family == "deepseek_v3":
        overrides = tiny_config("deepseek_v3", num_nextn_predict_layers=1, **sizes)
    else:
        overrides = {
            **GLM4_MOE,
            **sizes,
            "head_dim": 64,
            "num_attention_heads": args.hidden_size // 64,
        }
    config, state = mtp_state(args.family, overrides)
    gen = torch.Generator().manual_seed(11)
    prompts = [
        torch.randint(3, config.vocab_size, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="kvskill-bench-spec-") as tmp:
        directory = convert_checkpoint(Path(tmp), config, agreeing_state(config, state))
        settings = dict(block_size=128, num_blocks=64, cpu_only_shapes=True)
        systems = {
            "one_token_per_step": LLM(directory, **settings),
            "speculative_mtp": LLM(
                directory, speculative_tokens=args.speculative_tokens, **settings
            ),
        }
        rates: dict[str, list[float]] = {name: [] for name in systems}
        tokens: dict[str, list[list[int]]] = {}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for name, llm in systems.items():
                started = time.perf_counter()
                outs = llm.generate(prompts, params)
                wall = time.perf_counter() - started
                tokens[name] = [o.token_ids for o in outs]
                if repeat:
                    rates[name].append(sum(len(o.token_ids) for o in outs) / wall)
        spec = systems["speculative_mtp"].stats
    medians = {name: statistics.median(r) for name, r in rates.items()}
    result = {
        "benchmark": "bench_speculative",
        "settings": vars(args) | {"out": str(args.out)},
        "tokens_per_s": medians,
        "speedup": medians["speculative_mtp"] / medians["one_token_per_step"],
        "acceptance_rate": spec.speculation.acceptance_rate,
        "tokens_per_step": spec.speculation.tokens_per_step,
        "decode_steps": {name: llm.stats.num_decode_steps for name, llm in systems.items()},
        "same_tokens": tokens["speculative_mtp"] == tokens["one_token_per_step"],
        "load_average": {"before": load_before, "after": load_average()},
        "environment": environment(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(
        f"tokens/s: one token per step {medians['one_token_per_step']:.1f}, speculative "
        f"{medians['speculative_mtp']:.1f} (x{result['speedup']:.2f}); acceptance "
        f"{result['acceptance_rate']:.2f}, {result['tokens_per_step']:.2f} tokens per decode "
        f"step; same tokens: {result['same_tokens']}"
    )
    return result


if __name__ == "__main__":
    main()

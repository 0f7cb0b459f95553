"""Benchmark W5 (shared prefix): kvskill with prefix caching against kvskill without it.

What it measures: N requests that share a long prefix (a system prompt, a few-shot
template) followed by 16-64 tokens of their own, each generating a few tokens (EOS
ignored), all submitted at once, on the shrunk Qwen3 of the serving benchmark
(``qwen3-4l-h256``, converted by ``kvskill apply`` and loaded with the transformers
reference's seeded weights). Two ``LLM``s share those weights and differ only in
``enable_prefix_caching``. Runs alternate between them (a warm-up each, then the timed
repeats); each run starts from a cold cache (``reset_prefix_cache``), so the cache only
helps inside a run: the first request computes the prefix, the others share its blocks
(those admitted in the same step too). Reported, from the same process: mean TTFT and
useful tokens/s of each (medians over the repeats) and their ratios, the prefix-cache hit
rate, and whether both produced the same tokens (greedy; they must).

Defaults are the issue's W5 (32 requests, 1024-token prefix, 16-64 own tokens, 32 output
tokens); ``make bench`` runs it with fewer repeats. About two minutes on 2 cores.

Run: ``.venv/bin/python benchmarks/bench_prefix_cache.py [--requests 32] [--prefix-len 1024]
[--max-tokens 32] [--repeats 3] [--out PATH]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from _common import (  # noqa: E402
    BLOCK_SIZE,
    MODELS,
    TOKEN_BUDGET,
    build_reference_model,
    environment,
    load_average,
    set_threads,
)
from _kvskill_system import converted_dir  # noqa: E402


def make_w5(vocab: int, *, requests: int, prefix_len: int, seed: int = 5):
    """(prompts, max_tokens list): one shared prefix, 16-64 own tokens per request."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (prefix_len,), generator=g).tolist()
    own = torch.randint(16, 65, (requests,), generator=g).tolist()
    return [prefix + torch.randint(0, vocab, (n,), generator=g).tolist() for n in own]


def build_llm(spec, reference, *, enable_prefix_caching: bool, capacity_tokens: int):
    from kvskill.runtime import LLM, EngineConfig
    from kvskill.runtime.loader import load_model

    loaded = load_model(converted_dir(spec), dtype="float32", random_weights=True)
    # The reference's own tensors: both engines read the same weights from the same memory.
    loaded.model.load_state_dict(reference.state_dict(), strict=True, assign=True)
    loaded.model.eval()
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        num_blocks=capacity_tokens // BLOCK_SIZE + 1,
        max_num_batched_tokens=TOKEN_BUDGET,
        max_num_seqs=256,
        enable_prefix_caching=enable_prefix_caching,
        exact=True,  # the prefix cache's saving on the model's own code, as recorded
    )
    return LLM(loaded.model, config)


@torch.inference_mode()
def run_once(llm, prompts, params) -> dict:
    llm.kv_manager.reset_prefix_cache()  # every run starts cold
    stats = llm.stats
    hits, queries = stats.num_prefix_hit_tokens, stats.num_prefix_query_tokens
    computed = stats.num_prompt_tokens
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - started
    useful = sum(len(o.token_ids) for o in outputs)
    queried = stats.num_prefix_query_tokens - queries
    return {
        "tokens": [list(o.token_ids) for o in outputs],
        "wall_s": wall,
        "mean_ttft_s": statistics.mean(o.ttft_s for o in outputs),
        "useful_tok_s": useful / wall,
        "prefilled_tokens": stats.num_prompt_tokens - computed,
        "hit_rate": (stats.num_prefix_hit_tokens - hits) / queried if queried else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="qwen3-4l-h256", choices=sorted(MODELS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "bench_prefix_cache.json")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    spec = MODELS[args.model]
    reference = build_reference_model(spec)
    prompts = make_w5(spec.vocab_size, requests=args.requests, prefix_len=args.prefix_len)
    from kvskill.runtime import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    # Every request fits at once (plus a block of slack each): nothing is preempted.
    capacity = sum(-(-(len(p) + args.max_tokens) // BLOCK_SIZE) + 1 for p in prompts) * BLOCK_SIZE
    systems = {
        name: build_llm(spec, reference, enable_prefix_caching=on, capacity_tokens=capacity)
        for name, on in (("kvskill_prefix_cache", True), ("kvskill_no_prefix_cache", False))
    }
    for llm in systems.values():  # warm-up: one-time costs out of the timings
        run_once(llm, prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    for repeat in range(args.repeats):
        order = list(systems) if repeat % 2 == 0 else list(reversed(systems))
        for name in order:
            runs[name].append(run_once(systems[name], prompts, params))
            r = runs[name][-1]
            print(
                f"{name:24s} run {repeat}: wall {r['wall_s']:7.2f} s, TTFT "
                f"{r['mean_ttft_s']:6.2f} s, {r['useful_tok_s']:7.1f} tok/s, hit rate "
                f"{r['hit_rate']:.1%}",
                file=sys.stderr,
            )
    rows = {}
    for name, results in runs.items():
        rows[name] = {
            key: statistics.median(r[key] for r in results)
            for key in ("wall_s", "mean_ttft_s", "useful_tok_s", "prefilled_tokens", "hit_rate")
        }
    on, off = rows["kvskill_prefix_cache"], rows["kvskill_no_prefix_cache"]
    same_tokens = all(
        r["tokens"] == runs["kvskill_no_prefix_cache"][0]["tokens"]
        for results in runs.values()
        for r in results
    )
    report = {
        "benchmark": "bench_prefix_cache",
        "workload": {
            "name": "W5",
            "description": (
                f"shared prefix: {args.requests} requests, {args.prefix_len}-token prefix + "
                f"16-64 own tokens -> {args.max_tokens}"
            ),
            "prompt_tokens": sum(map(len, prompts)),
            "useful_tokens": args.requests * args.max_tokens,
        },
        "model": spec.name,
        "threads": args.threads,
        "repeats": args.repeats,
        "systems": rows,
        "ratios": {
            "useful_tok_s_on_over_off": on["useful_tok_s"] / off["useful_tok_s"],
            "ttft_off_over_on": off["mean_ttft_s"] / on["mean_ttft_s"],
        },
        "same_tokens": same_tokens,
        "load_average": load_average(),
        "environment": environment(),
    }
    ratios = report["ratios"]
    print(
        f"W5 ({report['workload']['description']}): prefix caching gives "
        f"{ratios['useful_tok_s_on_over_off']:.2f}x useful tokens/s and "
        f"{ratios['ttft_off_over_on']:.2f}x lower mean TTFT (hit rate {on['hit_rate']:.1%}); "
        f"tokens {'identical' if same_tokens else 'DIFFER'}",
        file=sys.stderr,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if same_tokens else 1


if __name__ == "__main__":
    sys.exit(main())

"""Prefix caching on a model `apply` converted: a small Qwen3 with a full-attention and a
sliding-window layer gives the same greedy tokens with the cache on and off."""

from __future__ import annotations

import random

import pytest

#: two layers, the second sliding (window 12 = three blocks of 4)
SMALL_QWEN3_SLIDING = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 256,
    "use_sliding_window": True,
    "sliding_window": 12,
    "max_window_layers": 1,
    "layer_types": ["full_attention", "sliding_attention"],
}


@pytest.fixture(scope="module")
def qwen3_sliding(tmp_path_factory):
    from kvskill.implementer.writer import ApplyOptions, apply_model

    out = tmp_path_factory.mktemp("prefix") / "qwen3"
    apply_model("qwen3", out, ApplyOptions(config_overrides=SMALL_QWEN3_SLIDING))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("num_blocks", [80, 40], ids=["roomy", "preempting"])
def test_shared_prefix_tokens_match_without_the_cache(qwen3_sliding, num_blocks):
    from kvskill.runtime import LLM, SamplingParams

    rng = random.Random(0)
    prefix = [rng.randrange(256) for _ in range(45)]
    prompts = [prefix + [rng.randrange(256) for _ in range(rng.randint(1, 7))] for _ in range(8)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    runs = {}
    for on in (False, True):
        llm = LLM(
            qwen3_sliding,
            exact=True,  # the runs with the cache on and off are compared bit for bit
            random_weights=True,
            seed=3,
            block_size=4,
            num_blocks=num_blocks,
            max_num_batched_tokens=16,
            enable_prefix_caching=on,
        )
        assert llm.kv_manager.groups["SlidingWindow"].sliding_window == 12
        runs[on] = ([o.token_ids for o in llm.generate(prompts, params)], llm.stats)
    assert runs[True][0] == runs[False][0]
    stats = runs[True][1]
    # 7 of 8 requests find the 44 tokens of the prefix's full blocks (the first computes them)
    assert stats.num_prefix_hit_tokens >= 7 * 44 or stats.num_preemptions > 0
    assert stats.num_prefix_hit_tokens > 0
    if num_blocks == 40:
        assert runs[False][1].num_preemptions > 0

"""Speculative decoding over sliding-window layers: Qwen2's window layers (converted by
apply, framework mode) with an MTP layer added to the config (Qwen2 checkpoints carry none:
the fixture's MTP layer is random, its drafts replaced by the reference's tokens, one in
three spoiled). Blocks slide out of the 8-token window as the requests grow; a rejected draft
must not evict what an accepted token reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from kvskill.runtime import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from mtp_checkpoints import oracle_drafts  # noqa: E402

# one apply of qwen2's modeling file
pytestmark = pytest.mark.slow

SMALL_QWEN2_WINDOW = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    use_sliding_window=True,
    sliding_window=8,
    max_window_layers=1,  # layer 0 full attention, layer 1 windowed
)
SETTINGS = dict(exact=True, random_weights=True, seed=3, block_size=4, cpu_only_shapes=True)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 33, 7, 100, 3, 41, 8, 77], list(range(20, 43)), [200, 4, 17] * 5]


@pytest.fixture(scope="module")
def qwen2_window(tmp_path_factory):
    from kvskill.implementer.writer import ApplyOptions, apply_model

    out = tmp_path_factory.mktemp("window") / "qwen2"
    apply_model("qwen2", out, ApplyOptions(config_overrides=SMALL_QWEN2_WINDOW))
    config = json.loads((out / "config.json").read_text())
    config.update(num_nextn_predict_layers=1, mtp_layer_types=["full_attention"])
    (out / "config.json").write_text(json.dumps(config))
    return out


def _tokens(directory, **settings):
    llm = LLM(directory, **{**SETTINGS, "num_blocks": 100, **settings})
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], llm


def test_window_layers_keep_what_accepted_tokens_read(qwen2_window, monkeypatch):
    expected, llm = _tokens(qwen2_window)
    assert sorted(llm.kv_manager.group_keys) == ["FullAttention", "SlidingWindow"]
    oracle_drafts(monkeypatch, {tuple(p): e for p, e in zip(PROMPTS, expected, strict=True)})
    for k in (1, 3):
        got, llm = _tokens(qwen2_window, speculative_tokens=k)
        assert got == expected, k
        spec = llm.stats.speculation
        assert 0 < spec.num_accepted_draft_tokens < spec.num_draft_tokens
        assert llm.kv_manager.managers["SlidingWindow"].next_n == k
    # 12 blocks of 4 tokens per group: preemption
    got, llm = _tokens(qwen2_window, speculative_tokens=2, num_blocks=12, max_model_len=40)
    assert got == expected and llm.stats.num_preemptions > 0


def test_prefix_cache_hits_under_windows_keep_their_tokens(qwen2_window, monkeypatch):
    expected, _ = _tokens(qwen2_window)
    # prompts that continue the first two requests: their leading blocks are cached
    second = [PROMPTS[0] + expected[0][:5], PROMPTS[1] + expected[1][:3]]
    llm = LLM(qwen2_window, **SETTINGS, num_blocks=100)
    expected_second = [o.token_ids for o in llm.generate(second, GREEDY)]
    oracle_drafts(
        monkeypatch,
        {tuple(p): e for p, e in zip(PROMPTS + second, expected + expected_second, strict=True)},
    )
    llm = LLM(qwen2_window, **SETTINGS, num_blocks=100, speculative_tokens=2)
    assert llm.kv_manager.enable_prefix_caching
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert [o.token_ids for o in llm.generate(second, GREEDY)] == expected_second
    assert llm.stats.num_prefix_hit_tokens >= 8

"""analyze --kv-memory names the block counts run allocates, per family, for one budget.

Each family is shrunk, converted, and its runtime pool built the way ``kvskill run
--kv-memory`` builds it (``LLM`` with run's defaults and random weights, no generation), at
the dtype the plan sized it with. The conversions make this slow; the toy model's case below
is the fast one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kvskill.analyzer import analyze_model
from kvskill.implementer.convert import ApplyOptions
from kvskill.implementer.writer import apply_model
from kvskill.runtime import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from mla_models import tiny_config  # noqa: E402
from small_configs import SMALL_JAMBA, SMALL_QWEN3_NEXT  # noqa: E402
from toy_factory import write_toy_dir  # noqa: E402

#: large enough for gemma2's window pool: 128 requests x 18 blocks + null, 16 KiB each
BUDGET = 48 << 20

FAMILIES = {
    # plain GQA
    "llama": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
    },
    # MLA: one latent + rope row per token
    "deepseek_v3": tiny_config("deepseek_v3"),
    # Mamba hybrid: state rows paid first
    "jamba": SMALL_JAMBA,
    # sliding-window mix: the window pool paid first (soft-capping off, or it is Legacy)
    "gemma2": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 256,
        "sliding_window": 64,
        "attn_logit_softcapping": None,
    },
    # gated-delta hybrid: recurrent + conv state rows paid first
    "qwen3_next": SMALL_QWEN3_NEXT,
}


@pytest.mark.slow  # apply takes 5-20 s per family here
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_analyze_names_the_blocks_run_allocates(model_type, tmp_path):
    overrides = FAMILIES[model_type]
    plan = analyze_model(model_type, config_overrides=overrides, kv_memory_bytes=BUDGET)
    memory = plan.memory
    assert memory["budget_fits"]
    out = tmp_path / model_type
    apply_model(model_type, out, ApplyOptions(config_overrides=overrides))
    # what `kvskill run DIR --kv-memory 48MiB --dtype <plan dtype>` builds before generating
    llm = LLM(
        out,
        random_weights=True,
        dtype=memory["dtype"],
        kv_memory_bytes=BUDGET,
        cpu_only_shapes=True,
    )
    assert llm.kv_manager.num_blocks == memory["num_blocks_by_group"]
    # the pool of every group holds the null block besides the usable ones run reports
    usable = {key: n - 1 for key, n in memory["num_blocks_by_group"].items()}
    assert llm.kv_manager.initial_free_blocks == usable
    reserved = set(memory["reserved_groups"])
    growing = [key for key in memory["num_blocks_by_group"] if key not in reserved]
    assert memory["num_blocks"] == memory["num_blocks_by_group"][growing[0]]
    if model_type in ("jamba", "qwen3_next"):
        assert reserved == {"Mamba"} and memory["num_blocks_by_group"]["Mamba"] == 128 + 1
    if model_type == "gemma2":
        # window 64 + a 2,048-token step over 128-token blocks: 18 per request
        assert memory["num_blocks_by_group"]["SlidingWindow"] == 128 * 18 + 1


def test_toy_model_blocks_match_run(tmp_path):
    """The fast case: the converted toy model (full + sliding layers, 4-token blocks)."""
    toy = write_toy_dir(tmp_path / "toy", weights=False)
    budget = 96 << 20
    memory = analyze_model(str(toy), kv_memory_bytes=budget, block_size=4).memory
    llm = LLM(
        toy,
        trust_remote_code=True,
        random_weights=True,
        dtype=memory["dtype"],
        kv_memory_bytes=budget,
        cpu_only_shapes=True,
    )
    assert llm.kv_manager.num_blocks == memory["num_blocks_by_group"]
    # 2 KV heads x 16 dims x (K+V) x 2 B = 128 B per token and layer, 512 B per 4-token block;
    # window 8 + a 2,048-token step: ceil(2,055 / 4) + 1 = 515 blocks per request
    window_pool = 128 * 515 + 1
    assert memory["num_blocks_by_group"] == {
        "SlidingWindow": window_pool,
        "FullAttention": (budget - window_pool * 512) // 512,
    }
    assert memory["reserved_bytes"] == window_pool * 512

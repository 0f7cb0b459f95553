"""A file that writes cache rows with ``scatter_update_`` but is no converted Legacy shape is
refused with what it is (MLA latent caches, sparse attention, quantized paths), never with
"no attention class" (the framework's glm_5_2 was refused that way)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.convert import ApplyOptions
from kvskill.implementer.writer import apply_model

#: a Legacy sparse MLA attention in the shape of the framework's glm_5_2 (written here)
MODELING = """
import torch
import torch_npu
from torch import nn


class RowsMlaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, config.kv_lora_rank + 8)

    def forward(self, hidden_states, nope_cache, rope_cache, kv_len, topk):
        latent = self.kv_a_proj_with_mqa(hidden_states)
        q, k_nope, k_rope = torch_npu.npu_mla_prolog_v3(latent, cache_index=kv_len)
        torch_npu.scatter_update_(nope_cache, kv_len, k_nope, -2)
        torch_npu.scatter_update_(rope_cache, kv_len, k_rope, -2)
        return torch_npu.npu_sparse_flash_attention(q, nope_cache, nope_cache, topk, 1.0, 1)


class RowsMlaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([RowsMlaAttention(config, 0)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)
"""


def test_a_sparse_mla_row_writer_is_refused_naming_what_it_is(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "modeling_rows.py").write_text(MODELING, encoding="utf-8")
    config = {
        "model_type": "rows_mla",
        "architectures": ["RowsMlaForCausalLM"],
        "auto_map": {"AutoModelForCausalLM": "modeling_rows.RowsMlaForCausalLM"},
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 128,
        "kv_lora_rank": 32,
    }
    (model / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(UnsupportedModelError) as refused:
        apply_model(str(model), tmp_path / "out", ApplyOptions())
    message = str(refused.value)
    assert "\n" not in message and "no attention class" not in message
    assert "RowsMlaAttention (line 7) writes cache rows with torch_npu.scatter_update_" in message
    assert "(lines 15, 16)" in message
    assert "MLA latent caches (npu_mla_prolog_v3)" in message
    assert "sparse attention over an indexer's top-k (npu_sparse_flash_attention" in message
    lines = MODELING.splitlines()
    assert (
        lines[6].startswith("class RowsMlaAttention")
        and "scatter_update_" in lines[14]
        and "scatter_update_" in lines[15]
    )
    assert not (tmp_path / "out").exists()


ROOT = os.environ.get("KVSKILL_CANN_RECIPES")


@pytest.mark.skipif(not ROOT, reason="KVSKILL_CANN_RECIPES is not set")
def test_the_frameworks_glm_5_2_is_refused_with_its_true_reason(tmp_path):
    """models/glm_5_2 at fbc225d: Legacy MLA latent caches, DSA sparse attention with its
    indexer cache, quantized paths; none converts yet, and the refusal says so."""
    from transformers import PretrainedConfig

    source = Path(ROOT) / "models" / "glm_5_2" / "models"
    model = tmp_path / "glm"
    model.mkdir()
    for path in source.glob("*.py"):
        shutil.copy2(path, model / path.name)
    config_text = (model / "configuration_glm.py").read_text(encoding="utf-8")
    assert 'model_type = "glm_moe_dsa"' in config_text
    config = {
        **PretrainedConfig().to_dict(),
        "model_type": "glm_moe_dsa",
        "architectures": ["GlmMoeDsaForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_glm.GlmMoeDsaConfig",
            "AutoModelForCausalLM": "modeling_glm.GlmMoeDsaForCausalLM",
        },
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 1024,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
    }
    (model / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(UnsupportedModelError) as refused:
        apply_model(str(model), tmp_path / "out", ApplyOptions())
    message = str(refused.value)
    assert "GlmMoeDsaAttention" in message and "no attention class" not in message
    assert "npu_mla_prolog_v3" in message and "npu_sparse_flash_attention" in message
    # the standalone MLA rewrite (KVR026) does not take it either: its writes go through the
    # MLA prolog and its attention is sparse
    with pytest.raises(UnsupportedModelError) as standalone:
        apply_model(str(model), tmp_path / "out", ApplyOptions(deploy_mode="standalone"))
    assert str(standalone.value) == message
    assert not (tmp_path / "out").exists()

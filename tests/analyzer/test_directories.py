"""Model directories: checkpoints, transformers 4 style remote code, runners, safety, errors."""

from __future__ import annotations

import json
import math
import sys
import textwrap

import pytest
from kvskill.analyzer import analyze_model
from kvskill.analyzer.plan import CacheEntryPlan
from kvskill.core.errors import BadInputError, UnsupportedModelError

from tests.analyzer.fixtures import REMOTE_MODELING, write_checkpoint, write_remote_model

FULL = "FullAttention"


def test_checkpoint_directory_uses_the_installed_modeling_code(tmp_path):
    model = write_checkpoint(
        tmp_path / "ckpt",
        {"model_type": "qwen3", "num_hidden_layers": 3, "hidden_size": 64,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "dtype": "float32"},
    )  # fmt: skip
    plan = analyze_model(str(model))
    assert plan.source.kind == "directory"
    assert plan.source.config_file == str(model / "config.json")
    assert plan.source.modeling_file.endswith("modeling_qwen3.py")
    assert plan.attention == "gqa" and len(plan.layers) == 3
    assert plan.cache_entries[FULL][0] == CacheEntryPlan(
        cache_name="k_cache", dim=16, num_head=2, dtype="float32",
        sliding_window=None,
    )  # fmt: skip
    assert plan.kv_bytes_per_token == 2 * 2 * 16 * 4 * 3
    attention_sources = [e.source for e in plan.evidence if e.decision == "attention"]
    assert attention_sources == ["config.json:num_key_value_heads"]


def test_transformers4_remote_code_is_read_without_running_it(tmp_path):
    model = write_remote_model(tmp_path / "remote")
    modules_before = set(sys.modules)
    plan = analyze_model(str(model))
    # nothing in the directory ran: no marker files, no new module named after it
    assert not (model / "SIDE_EFFECT").exists()
    assert not (model / "SIDE_EFFECT_CONFIG").exists()
    assert not any("modeling_tiny" in name for name in set(sys.modules) - modules_before)
    assert plan.source.kind == "remote_code"
    assert plan.source.modeling_file == str(model / "modeling_tiny.py")
    code = plan.code
    assert code["cache_api"] == "transformers4"
    assert code["attention_classes"] == ["TinyAttention"]
    assert code["decoder_layer_class"] == "TinyDecoderLayer"
    assert code["model_class"] == "TinyModel" and code["causal_lm_class"] == "TinyForCausalLM"
    lines = REMOTE_MODELING.splitlines()
    assert "past_key_value.update(" in lines[code["cache_update_line"] - 1]
    assert "scaled_dot_product_attention(" in lines[code["attention_interface_line"] - 1]
    assert plan.attention == "gqa" and plan.num_key_value_heads_per_rank == 2
    assert plan.cache_entries[FULL][0].dtype == "float16"
    assert plan.kv_bytes_per_token == 2 * 2 * 16 * 2 * 2
    assert any("past_key_value.update" in e.reason for e in plan.evidence)


def test_runner_without_framework_means_standalone(tmp_path):
    model = write_remote_model(tmp_path / "m")
    (model / "runner_tiny.py").write_text(
        "import torch\n\nclass Runner:\n    def generate(self, ids):\n"
        "        for _ in range(4):\n            ids = self.model(ids)\n",
        encoding="utf-8",
    )
    assert analyze_model(str(model)).deploy_mode == "standalone"
    # an explicit mode wins over detection
    assert analyze_model(str(model), deploy_mode="framework").deploy_mode == "framework"


def test_runner_built_on_the_runtime_means_framework(tmp_path):
    model = write_remote_model(tmp_path / "m")
    (model / "runner_tiny.py").write_text(
        "from kvskill.runtime import LLM\n\nllm = LLM('.')\n", encoding="utf-8"
    )
    plan = analyze_model(str(model))
    assert plan.deploy_mode == "framework"
    assert [e.source for e in plan.evidence if e.decision == "deploy_mode"] == ["runner_tiny.py:1"]


def test_already_converted_code_is_recognised(tmp_path):
    converted = REMOTE_MODELING.replace(
        "        self.scaling = self.head_dim ** -0.5\n",
        "        self.scaling = self.head_dim ** -0.5\n"
        "        self.cache_entries = [CacheEntry('k_cache')]\n",
    ).replace(
        "        self.model = TinyModel(config)\n",
        "        self.model = TinyModel(config)\n\n"
        "    def get_cache_info(self):\n        return None\n",
    )
    assert "def get_cache_info" in converted and "self.cache_entries" in converted
    plan = analyze_model(str(write_remote_model(tmp_path / "m", converted)))
    assert plan.code["already_converted"] is True
    assert plan.code["already_converted_source"].startswith("modeling_tiny.py:")
    assert any("already converted" in w for w in plan.warnings)


def test_legacy_framework_code_is_recognised(tmp_path):
    legacy = REMOTE_MODELING.replace(
        "        self.scaling = self.head_dim ** -0.5\n",
        "        self.scaling = self.head_dim ** -0.5\n        self.cache_unit = (2 * 16,)\n",
    ).replace(
        "        attn_output = torch.nn",
        "        torch_npu.scatter_update_(self.k_cache, kv_len, key_states, -2)\n"
        "        attn_output = torch.nn",
    )
    assert "scatter_update_" in legacy and "cache_unit" in legacy
    plan = analyze_model(str(write_remote_model(tmp_path / "m", legacy)))
    assert plan.code["legacy_framework"] is True
    assert plan.kv_mode == "paged"  # Legacy code is the starting point; Paged is the target
    assert any("Legacy framework" in e.reason for e in plan.evidence)


def test_missing_config_and_malformed_json_are_bad_input(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInputError, match="no config.json"):
        analyze_model(str(tmp_path / "empty"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(BadInputError, match="not valid JSON"):
        analyze_model(str(broken))
    unknown = write_checkpoint(tmp_path / "unknown", {"model_type": "no_such_type"})
    with pytest.raises(BadInputError, match="ships no modeling"):
        analyze_model(str(unknown))
    with pytest.raises(BadInputError, match="neither a directory"):
        analyze_model("no_such_model_type")


def test_unparsable_code_and_non_decoders_are_refused(tmp_path):
    model = write_remote_model(tmp_path / "m", "class Broken(:\n")
    with pytest.raises(UnsupportedModelError, match="not valid Python"):
        analyze_model(str(model))
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        analyze_model("bart")
    with pytest.raises(UnsupportedModelError, match="is_decoder"):
        analyze_model("bert")
    with pytest.raises(UnsupportedModelError, match="causal=true"):
        analyze_model("xlm")
    # the decoder variant of an encoder family is served
    assert analyze_model("bert", config_overrides={"is_decoder": True}).attention == "mha"
    no_lm = write_remote_model(
        tmp_path / "n", REMOTE_MODELING.replace("TinyForCausalLM", "TinyEncoder")
    )
    with pytest.raises(UnsupportedModelError, match="ForCausalLM"):
        analyze_model(str(no_lm))


def test_config_json_is_only_read(tmp_path):
    model = write_remote_model(tmp_path / "m")
    before = (model / "config.json").read_text(encoding="utf-8")
    analyze_model(str(model), config_overrides={"num_hidden_layers": 1})
    assert json.loads((model / "config.json").read_text(encoding="utf-8")) == json.loads(before)


MLA_REMOTE = textwrap.dedent(
    """
    import math

    import torch
    from torch import nn


    def yarn_get_mscale(scale=1, mscale=1):
        if scale <= 1:
            return 1.0
        return 0.1 * mscale * math.log(scale) + 1.0


    class TinyMlaAttention(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.layer_idx = layer_idx
            self.q_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
            self.kv_a_layernorm = TinyRMSNorm(config.kv_lora_rank)
            self.softmax_scale = self.q_head_dim ** (-0.5)
            if config.rope_scaling is not None:
                mscale_all_dim = config.rope_scaling.get("mscale_all_dim", 0)
                if mscale_all_dim:
                    mscale = yarn_get_mscale(config.rope_scaling["factor"], mscale_all_dim)
                    self.softmax_scale = self.softmax_scale * mscale * mscale

        def forward(self, hidden_states, past_key_value=None, **kwargs):
            if past_key_value is not None:
                key_states, value_states = past_key_value.update(
                    key_states, value_states, self.layer_idx, {}
                )
            attn_weights = torch.matmul(query_states, key_states.transpose(2, 3))
            return attn_weights


    class TinyDecoderLayer(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.self_attn = TinyMlaAttention(config, layer_idx)


    class TinyModel(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.layers = nn.ModuleList([TinyDecoderLayer(config, i) for i in range(2)])


    class TinyForCausalLM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.model = TinyModel(config)
    """
)


def test_transformers4_mla_remote_code_with_legacy_rope_scaling(tmp_path):
    model = write_remote_model(
        tmp_path / "mla",
        MLA_REMOTE,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096},
    )  # fmt: skip
    plan = analyze_model(str(model), attn_tp_size=4)
    assert plan.attention == "mla" and plan.input_layout == "TND_NTD"
    assert plan.num_key_value_heads_per_rank == 1 and plan.is_mla_backend
    mscale = 0.1 * 1.0 * math.log(40) + 1.0
    assert plan.softmax_scale == pytest.approx(192**-0.5 * mscale * mscale, rel=1e-12)
    lines = MLA_REMOTE.splitlines()
    scaling_line = plan.code["attention"]["TinyMlaAttention"]["scaling_line"]
    assert "self.softmax_scale = self.q_head_dim" in lines[scaling_line - 1]
    assert plan.kv_bytes_per_token == (512 + 64) * 2 * 2  # float16, two layers


@pytest.mark.parametrize(
    "imports,mode",
    [
        ("from kvskill.runtime import LLM, SamplingParams\n", "framework"),
        ("from kvskill.runtime.engine import Engine\n", "framework"),
        ("import kvskill.runtime.llm\n", "framework"),
        # The generated standalone runner: runtime helpers only, its own loop and KV tensors.
        (
            "from kvskill.runtime import ForwardMetaData, forward_context, get_init_attn_mask\n"
            "from kvskill.runtime.loader import load_model\n",
            "standalone",
        ),
    ],
)
def test_runner_mode_follows_what_it_takes_from_the_runtime(tmp_path, imports, mode):
    model = write_remote_model(tmp_path / "m")
    (model / "runner_tiny.py").write_text(imports + "\nRUNNER = True\n", encoding="utf-8")
    plan = analyze_model(str(model))
    assert plan.deploy_mode == mode
    reasons = [e.reason for e in plan.evidence if e.decision == "deploy_mode"]
    assert reasons and ("engine" in reasons[0]) == (mode == "framework")

"""Vision-language models whose text decoder lives in their own modeling file (qwen2_5_vl,
qwen3_vl): the text model type has no causal-LM class, so the whole
``*ForConditionalGeneration`` is converted; only its text attention gets the paged KV cache.

Each checkpoint directory is saved from a tiny model built with
``AutoModelForImageTextToText`` and must give, on its own weights and text-only prompts, the
tokens transformers' model gives.
"""

from __future__ import annotations

import json

import libcst
import pytest
from checkpoint_tokens import hf_tokens, kvskill_tokens, save_checkpoint
from kvskill.analyzer import analyze_model
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.text_model import LocalTextModelCommand, text_model_problems
from kvskill.implementer.writer import ApplyOptions, apply_model
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions
from kvskill.verify.shrink import shrink_config
from libcst.codemod import CodemodContext

#: head_dim 16: the multimodal rope splits its 8 rotary frequencies into three sections
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]),
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
CHECKPOINTS = {
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLAttention"),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLTextAttention"),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def vlm_checkpoint(request, tmp_path_factory):
    from transformers import AutoConfig, AutoModelForImageTextToText

    model_type = request.param
    path = tmp_path_factory.mktemp(f"{model_type}_ckpt")
    text = dict(TEXT, head_dim=16) if model_type == "qwen3_vl" else TEXT
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=VISION)
    model = save_checkpoint(AutoModelForImageTextToText.from_config(config), path)
    return model_type, path, hf_tokens(model)


def test_checkpoint_converts_the_text_attention_and_runs_its_weights(vlm_checkpoint, tmp_path):
    model_type, source, expected = vlm_checkpoint
    architecture, attention = CHECKPOINTS[model_type]
    out = tmp_path / "converted"
    apply_model(str(source), out, ApplyOptions())
    plan = json.loads((out / "kvskill_plan.json").read_text())
    assert plan["architecture"] == architecture
    assert plan["source"]["vision_language_head"] == architecture
    code = (out / f"modeling_{model_type}.py").read_text()
    # Only the text attention declares caches; the vision tower's attention is untouched.
    assert code.count("self.cache_entries = [") == 1
    assert f"class {attention}(" in code
    # Packed [1, T] token ids with per-request positions give transformers' own tokens.
    assert kvskill_tokens(out) == expected
    report = verify_directory(out, VerifyOptions(num_prompts=2, max_new_tokens=4))
    assert report.passed, report.failures()


#: a vision-language file that builds its own text decoder through AutoModel (qwen3_vl)
AUTO_BUILT = """
class TextAttention(nn.Module):
    def __init__(self, config, layer_idx):
        self.q_proj = nn.Linear(4, 4)

    def forward(self, hidden_states, cache=None):
        key_states, value_states = cache.update(k, v, self.layer_idx)
        out, w = attention_interface(self, q, key_states, value_states, None)
        return out, w


class TextDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        self.self_attn = TextAttention(config, layer_idx)


class TextModel(PreTrainedModel):
    def __init__(self, config):
        self.layers = nn.ModuleList([TextDecoderLayer(config, i) for i in range(2)])


class VLModel(PreTrainedModel):
    def __init__(self, config):
        self.visual = AutoModel.from_config(config.vision_config)
        self.language_model = AutoModel.from_config(config.text_config)
"""


def test_the_language_model_is_built_from_the_converted_text_model():
    module = libcst.parse_module(AUTO_BUILT)
    out = LocalTextModelCommand(CodemodContext(), None).transform_module(module).code
    # AutoModel.from_config would build transformers' own (unconverted) text model.
    assert "self.language_model = TextModel._from_config(config.text_config)" in out
    assert "self.visual = AutoModel.from_config(config.vision_config)" in out


def test_an_auto_built_language_model_without_its_own_text_model_is_refused():
    unclear = AUTO_BUILT.replace(
        "class TextModel(",
        "class OtherModel(TextModel):\n    def __init__(self, config):\n        self.layers = [TextDecoderLayer(config, 0)]\n\n\nclass TextModel(",
    )
    assert text_model_problems(libcst.parse_module(AUTO_BUILT)) == []
    (problem,) = text_model_problems(libcst.parse_module(unclear))
    assert "not unique (found: ['OtherModel', 'TextModel'])" in problem


def test_by_name_plans_the_text_decoder_of_the_whole_model():
    plan = analyze_model("qwen2_5_vl")
    assert plan.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert plan.num_layers == plan.config["text_config"]["num_hidden_layers"]
    assert any("3-D rope positions" in w for w in plan.warnings)


def test_composite_without_a_generating_class_is_still_refused():
    with pytest.raises(UnsupportedModelError, match="'clip_text_model'"):
        analyze_model("clip")


def test_shrink_shrinks_the_nested_text_config_and_the_towers():
    config = {
        "model_type": "qwen2_5_vl",
        "text_config": {
            "num_hidden_layers": 80,
            "hidden_size": 8192,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "vocab_size": 152064,
            "eos_token_id": 151645,
            "layer_types": ["full_attention"] * 80,
        },
        "vision_config": {"depth": 32, "hidden_size": 1280, "num_heads": 16},
    }
    result = shrink_config(config)
    text = result.config["text_config"]
    assert text["num_hidden_layers"] == 2 and text["layer_types"] == ["full_attention"] * 2
    assert text["vocab_size"] == 256 and text["eos_token_id"] < 256
    # the head dim the rope sections are sized for stays; with no head_dim key the config
    # derives it from hidden / heads, so none is written
    assert "head_dim" not in text
    assert text["hidden_size"] // text["num_attention_heads"] == 128
    assert result.config["vision_config"]["depth"] == 1
    assert result.changes["vision_config.depth"] == (32, 1)
    assert config["text_config"]["num_hidden_layers"] == 80  # the input is not modified

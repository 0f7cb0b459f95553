"""Checkpoint directories of transformers models (config + weights, no code of their own),
and vision-language models whose language model is a causal LM.

Each converted directory is run on its own saved weights and must give the tokens the
original transformers model gives with those weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_tokens import NEW_TOKENS, PROMPTS, hf_tokens, kvskill_tokens, save_checkpoint
from kvskill.analyzer import analyze_model
from kvskill.implementer.writer import ApplyOptions, apply_model
from kvskill.runtime import LLM, SamplingParams
from kvskill.runtime.composite_weights import language_model_state
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions

TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
)
VISION = dict(
    model_type="pixtral",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    head_dim=16,
    image_size=64,
    patch_size=16,
)


@pytest.fixture(scope="module")
def mistral_checkpoint(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("mistral_ckpt")
    config = AutoConfig.for_model("mistral", **TEXT)
    model = save_checkpoint(AutoModelForCausalLM.from_config(config), path)
    return path, hf_tokens(model)


@pytest.fixture(scope="module")
def mistral3_checkpoint(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = tmp_path_factory.mktemp("mistral3_ckpt")
    config = AutoConfig.for_model(
        "mistral3", text_config=dict(model_type="mistral", **TEXT), vision_config=VISION
    )
    model = save_checkpoint(AutoModelForImageTextToText.from_config(config), path)
    return path, hf_tokens(model)


def test_checkpoint_directory_converts_with_absolute_imports_and_runs_its_weights(
    mistral_checkpoint, tmp_path
):
    source, expected = mistral_checkpoint
    out = tmp_path / "converted"
    apply_model(str(source), out, ApplyOptions())
    code = (out / "modeling_mistral.py").read_text()
    # The file left the transformers package: `from ...activations` could not be imported.
    assert "from ..." not in code and "from transformers.activations import" in code
    assert json.loads((out / "kvskill_plan.json").read_text())["source"]["kind"] == "directory"
    assert kvskill_tokens(out) == expected


def test_generation_config_end_tokens_are_kept_and_stop_generation(mistral_checkpoint, tmp_path):
    import shutil

    source, expected = mistral_checkpoint
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(source, checkpoint)
    # An end-of-turn token the model emits third, as an instruct checkpoint lists it beside
    # config.json's EOS: transformers' generate stops there, so must the runtime.
    end_of_turn = expected[0][2]
    (checkpoint / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [255, end_of_turn]})
    )
    out = tmp_path / "converted"
    apply_model(str(checkpoint), out, ApplyOptions())
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"][1] == (
        end_of_turn
    )
    llm = LLM(out, num_blocks=16, block_size=8)
    (output,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=NEW_TOKENS))
    first = expected[0].index(end_of_turn)
    assert output.token_ids == expected[0][: first + 1]
    assert output.finish_reason == "stop"


@pytest.mark.parametrize("eos", ['{"eos_token_id": "2"}', "{not json"])
def test_a_malformed_generation_config_is_bad_input(mistral_checkpoint, tmp_path, eos):
    from kvskill.core.errors import BadInputError

    out = tmp_path / "converted"
    apply_model(str(mistral_checkpoint[0]), out, ApplyOptions())
    (out / "generation_config.json").write_text(eos)
    with pytest.raises(BadInputError, match="generation_config.json"):
        LLM(out, num_blocks=16, block_size=8)


def test_checkpoint_directory_verifies_without_trusting_remote_code(mistral_checkpoint, tmp_path):
    out = tmp_path / "converted"
    apply_model(str(mistral_checkpoint[0]), out, ApplyOptions())
    report = verify_directory(out, VerifyOptions())
    assert report.passed


def test_checkpoint_directory_with_its_own_code_still_needs_trust(mistral_checkpoint, tmp_path):
    from kvskill.core.errors import BadInputError

    out = tmp_path / "converted"
    apply_model(str(mistral_checkpoint[0]), out, ApplyOptions())
    (out / "helpers.py").write_text("RAN = True\n")
    with pytest.raises(BadInputError, match="--trust-remote-code"):
        verify_directory(out, VerifyOptions())


def test_vision_language_checkpoint_converts_its_language_model(mistral3_checkpoint, tmp_path):
    source, expected = mistral3_checkpoint
    out = tmp_path / "converted"
    apply_model(str(source), out, ApplyOptions())
    plan = json.loads((out / "kvskill_plan.json").read_text())
    assert plan["model_type"] == "mistral"
    assert plan["source"]["language_model_of"] == "mistral3"
    config = json.loads((out / "config.json").read_text())
    # mistral3 ties its lm_head to the language model's embeddings by its own flag
    assert config["tie_word_embeddings"] is True
    # Text-only prompts through the whole vision-language model give the same tokens as the
    # converted language model fed the checkpoint's language-model tensors.
    assert kvskill_tokens(out) == expected
    assert verify_directory(out, VerifyOptions()).passed


def test_vision_language_model_by_name_delegates_to_its_text_model():
    plan = analyze_model("llava")
    assert plan.model_type == "llama"
    assert plan.source.language_model_of == "llava"


def test_config_overrides_of_a_vision_language_model_reach_its_language_model():
    plan = analyze_model("mistral3", config_overrides={"num_hidden_layers": 3})
    assert len(plan.layers) == 3
    evidence = {e["decision"]: e["source"] for e in plan.to_dict()["evidence"]}
    # Config keys are cited where they live: the composite's text_config.
    assert evidence["source"] == "mistral3 default config:text_config.model_type"
    assert evidence["attention"].startswith("mistral3 default config:text_config.")


def test_language_model_state_renames_and_sets_the_rest_aside():
    t = torch.zeros(1)
    state = {
        "model.language_model.embed_tokens.weight": t,
        "model.language_model.layers.0.w": t,
        "lm_head.weight": t,
        "model.vision_tower.blocks.0.w": t,
        "model.multi_modal_projector.w": t,
    }
    needed = {"model.embed_tokens.weight", "model.layers.0.w", "lm_head.weight"}
    renamed, ignored = language_model_state(state, needed)
    assert set(renamed) == needed
    assert ignored == ["model.multi_modal_projector", "model.vision_tower"]
    legacy = {"language_model.model.embed_tokens.weight": t, "language_model.lm_head.weight": t}
    renamed, _ = language_model_state(legacy, {"model.embed_tokens.weight", "lm_head.weight"})
    assert set(renamed) == {"model.embed_tokens.weight", "lm_head.weight"}
    # Nothing provides model.norm.weight: not a composite checkpoint of this model.
    assert language_model_state(state, needed | {"model.norm.weight"}) is None


def test_moe_checkpoint_with_one_tensor_per_expert_runs_its_weights(tmp_path, capfd):
    # transformers 5 fuses the experts on load (experts.gate_up_proj); the checkpoint keeps
    # experts.0.gate_proj.weight, ...: only transformers' converters can merge them.
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe",
        **{**TEXT, "intermediate_size": 128},
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
    )
    source = tmp_path / "checkpoint"
    expected = hf_tokens(save_checkpoint(AutoModelForCausalLM.from_config(config), source))
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        saved = list(f.keys())
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in saved
    out = tmp_path / "converted"
    apply_model(str(source), out, ApplyOptions())
    capfd.readouterr()
    assert kvskill_tokens(out) == expected
    # transformers' loader ran without drawing its progress bar into the runtime's output
    assert "Loading weights" not in capfd.readouterr().err

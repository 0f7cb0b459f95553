"""KV bytes count every attention sublayer; the deploy mode follows seed 003's order."""

from __future__ import annotations

import pytest
from kvskill.analyzer import analyze_model
from kvskill.core.errors import BadInputError

from tests.analyzer.fixtures import REMOTE_MODELING, write_remote_model

SMALL_LONGCAT = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "vocab_size": 256,
}

#: the decoder layer keeps its two attentions in a ModuleDict, keyed by name
DICT_OF_ATTENTIONS = REMOTE_MODELING.replace(
    "self.self_attn = ATTENTION_CLASSES[config._attn_implementation](config, layer_idx)",
    "self.attn = nn.ModuleDict(\n"
    '                {"local": TinyAttention(config, 2 * layer_idx), '
    '"global": TinyAttention(config, 2 * layer_idx + 1)}\n'
    "            )",
)


def _sources(plan, decision):
    return [e for e in plan.evidence if e.decision == decision]


@pytest.mark.slow
def test_longcat_counts_both_attention_sublayers_of_each_layer():
    plan = analyze_model("longcat_flash", config_overrides=SMALL_LONGCAT, kv_memory_bytes=1 << 20)
    # MLA latent (32 + 16) x bfloat16 per sublayer, two sublayers per decoder layer, 2 layers
    per_sublayer = (32 + 16) * 2
    assert plan.kv_bytes_per_token == per_sublayer * 2 * 2
    assert plan.memory["num_blocks"] == (1 << 20) // (plan.kv_bytes_per_token * 128)
    (cited,) = [e for e in _sources(plan, "layers") if "sublayers" in e.reason]
    assert "2 attention sublayers (self.self_attn)" in cited.reason
    assert cited.source.startswith("modeling_longcat_flash.py:")


def test_a_module_dict_of_attentions_counts_every_entry(tmp_path):
    one = analyze_model(str(write_remote_model(tmp_path / "one")))
    two = analyze_model(str(write_remote_model(tmp_path / "two", DICT_OF_ATTENTIONS)))
    assert two.kv_bytes_per_token == 2 * one.kv_bytes_per_token
    assert any("2 attention sublayers (self.attn)" in e.reason for e in _sources(two, "layers"))


def test_a_conditional_second_attention_is_not_counted():
    # GPT-2's decoder layer builds a cross-attention only with add_cross_attention
    plan = analyze_model("gpt2", config_overrides={"n_layer": 2, "n_embd": 64, "n_head": 4})
    assert plan.memory["dtype"] == "bfloat16"  # the config names none: assumed
    assert plan.kv_bytes_per_token == 2 * 64 * 2 * 2  # k and v, 64 wide, 2 layers, 2 bytes
    assert not any("sublayers" in e.reason for e in plan.evidence)


@pytest.mark.parametrize(
    ("line", "mode"),
    [("部署模式: 独立部署", "standalone"), ("部署模式：框架部署", "framework")],
)
def test_the_prompt_file_marker_decides_an_auto_deploy_mode(tmp_path, line, mode):
    prompt = tmp_path / "task.md"
    prompt.write_text(f"# migrate\n\n{line}\n", encoding="utf-8")
    plan = analyze_model("qwen3", prompt_file=prompt)
    assert plan.deploy_mode == mode
    (cited,) = _sources(plan, "deploy_mode")
    assert cited.source == "task.md:3" and mode in cited.reason


def test_flag_beats_prompt_and_prompt_beats_progress_and_runner(tmp_path):
    model = write_remote_model(tmp_path / "model")
    (model / "runner_tiny.py").write_text("import torch\n", encoding="utf-8")
    assert analyze_model(str(model)).deploy_mode == "standalone"  # runner detection
    (model / "progress.md").write_text("部署模式: 框架部署\n", encoding="utf-8")
    plan = analyze_model(str(model))
    assert plan.deploy_mode == "framework"
    assert _sources(plan, "deploy_mode")[0].source == "progress.md:1"
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("部署模式: 独立部署\n", encoding="utf-8")
    assert analyze_model(str(model), prompt_file=prompt).deploy_mode == "standalone"
    flagged = analyze_model(str(model), deploy_mode="framework", prompt_file=prompt)
    assert flagged.deploy_mode == "framework"
    assert _sources(flagged, "deploy_mode")[0].source == "flag --mode"


def test_progress_md_in_the_workspace_root_decides_the_mode_of_a_model_below_it(
    tmp_path, monkeypatch
):
    """The dispatch prompt's workspace keeps progress.md at its root, the checkpoint in a
    folder below: the marker is found there, and one beside the model still comes first."""
    workspace = tmp_path / "workspace"
    model = write_remote_model(workspace / "checkpoints" / "model")
    (workspace / "progress.md").write_text("# notes\n部署模式: 独立部署\n", encoding="utf-8")
    monkeypatch.chdir(workspace)
    plan = analyze_model(str(model))
    assert plan.deploy_mode == "standalone"
    (cited,) = _sources(plan, "deploy_mode")
    assert cited.source == "progress.md:2" and "in the workspace" in cited.reason
    # a built-in model type has no folder: the workspace's progress.md still speaks for it
    assert analyze_model("qwen3").deploy_mode == "standalone"
    (model / "progress.md").write_text("部署模式: 框架部署\n", encoding="utf-8")
    nearest = analyze_model(str(model))
    assert nearest.deploy_mode == "framework"
    assert "beside the model" in _sources(nearest, "deploy_mode")[0].reason
    # outside the workspace nothing above the model is read
    monkeypatch.chdir(tmp_path / "workspace" / "checkpoints")
    (model / "progress.md").unlink()
    assert analyze_model(str(model)).deploy_mode == "framework"


def test_a_missing_prompt_file_is_bad_input(tmp_path):
    with pytest.raises(BadInputError, match="--prompt-file .*nope.md does not exist"):
        analyze_model("qwen3", prompt_file=tmp_path / "nope.md")

"""``kvskill analyze`` output formats, exit codes and the progress-file section."""

from __future__ import annotations

import json

import pytest
import yaml
from kvskill.analyzer import Plan, analyze_model
from kvskill.analyzer.report import PROGRESS_HEADING, per_layer_line, to_markdown, update_progress
from kvskill.cli import main

CONTRACT_KEYS = {
    "model_type", "architecture", "source", "deploy_mode", "kv_mode", "legacy_reason",
    "attention", "layers", "attn_types", "mixed_attn_types", "fa_version", "fa_version_reason",
    "mla_absorb", "input_layout", "sparse_mode", "softmax_scale",
    "num_key_value_heads_per_rank", "cache_entries", "kv_bytes_per_token", "warnings",
    "evidence",
}  # fmt: skip


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_json_is_one_object_with_the_contract_keys(capsys):
    code, out, _ = run_cli(capsys, "analyze", "gpt_oss", "--format", "json")
    assert code == 0
    payload = json.loads(out)  # exactly one JSON document on stdout
    assert set(payload) >= CONTRACT_KEYS
    assert payload["layers"][0] == {
        "index": 0, "kind": "attention", "attn_type": "SlidingWindow", "sliding_window": 128,
        "kv_source": None,
    }  # fmt: skip
    assert {"decision", "reason", "source"} == set(payload["evidence"][0])
    # the JSON reads back into the same Plan
    assert Plan.from_dict(payload).to_dict() == payload


def test_yaml_and_table_formats(capsys):
    code, out, _ = run_cli(
        capsys, "analyze", "qwen3", "--format", "yaml", "--config-overrides", "num_hidden_layers=2"
    )
    assert code == 0
    data = yaml.safe_load(out)
    assert data["model_type"] == "qwen3" and len(data["layers"]) == 2
    code, out, _ = run_cli(capsys, "analyze", "gemma2")
    assert code == 0
    assert "legacy" in out and "soft-capping" in out and "evidence:" in out


def test_exit_codes(capsys):
    code, out, _ = run_cli(capsys, "analyze", "no_such_model", "--format", "json")
    assert code == 2 and json.loads(out)["error"]["code"] == "bad_input"
    code, _, err = run_cli(capsys, "analyze", "bart")
    assert code == 3 and "encoder-decoder" in err and err.count("\n") == 1
    code, _, err = run_cli(capsys, "analyze", "qwen3", "--kv-memory", "lots")
    assert code == 2 and "is not a size" in err


def test_memory_options_reach_the_plan(capsys):
    code, out, _ = run_cli(
        capsys, "analyze", "llama", "--format", "json", "--kv-memory", "1GiB",
        "--block-size", "64", "--attn-tp-size", "2",
    )  # fmt: skip
    assert code == 0
    payload = json.loads(out)
    memory = payload["memory"]
    assert memory["kv_memory_bytes"] == 1 << 30 and memory["block_size"] == 64
    # 16 KV heads per rank x 128 dims x K and V x 2 bytes x 32 layers
    per_token = 16 * 128 * 2 * 2 * 32
    assert payload["kv_bytes_per_token"] == per_token
    # 1 GiB pays for 64 blocks of 64 tokens; block 0 is the null block
    assert memory["num_blocks"] == (1 << 30) // (per_token * 64) == 64
    assert memory["max_tokens"] == (64 - 1) * 64


def test_progress_section_is_added_once_and_replaced_in_place(tmp_path, capsys):
    progress = tmp_path / "progress.md"
    progress.write_text("# Migration\n\nnotes above\n\n## Next steps\n\n- verify\n", "utf-8")
    code, _, err = run_cli(
        capsys, "analyze", "gpt_oss", "--format", "md", "--write-progress", str(progress)
    )
    assert code == 0 and "updated" in err
    first = progress.read_text("utf-8")
    assert first.startswith("# Migration\n\nnotes above\n")
    assert first.count(PROGRESS_HEADING) == 1 and "## Next steps\n\n- verify\n" in first
    # the same plan again changes nothing
    code, _, err = run_cli(capsys, "analyze", "gpt_oss", "--write-progress", str(progress))
    assert code == 0 and "already up to date" in err
    assert progress.read_text("utf-8") == first


def test_progress_keeps_one_section_per_model(tmp_path):
    progress = tmp_path / "progress.md"
    progress.write_text("# Notes\n\n## Next steps\n\n- verify\n", "utf-8")
    update_progress(progress, analyze_model("qwen3"))
    assert update_progress(progress, analyze_model("gpt_oss")) is True
    text = progress.read_text("utf-8")
    # a second model adds its own section: the first model's is kept whole
    assert text.count(PROGRESS_HEADING) == 2
    assert f"{PROGRESS_HEADING}: qwen3\n" in text and f"{PROGRESS_HEADING}: gpt_oss\n" in text
    assert text.startswith("# Notes\n\n## Next steps\n\n- verify\n")
    assert update_progress(progress, analyze_model("gpt_oss")) is False
    assert update_progress(progress, analyze_model("qwen3")) is False


def test_progress_replaces_only_the_same_models_section(tmp_path):
    progress = tmp_path / "progress.md"
    update_progress(progress, analyze_model("qwen3"))
    update_progress(progress, analyze_model("gpt_oss"))
    before = progress.read_text("utf-8")
    qwen3_section = before[: before.index(f"{PROGRESS_HEADING}: gpt_oss")]
    # a changed plan for gpt_oss (heads split over two ranks) replaces its section in place
    assert update_progress(progress, analyze_model("gpt_oss", attn_tp_size=2)) is True
    after = progress.read_text("utf-8")
    assert after.startswith(qwen3_section) and after.count(PROGRESS_HEADING) == 2
    assert after != before


def test_progress_sections_name_the_checkpoint_and_keep_the_agents_slots(tmp_path):
    """Two checkpoints of one model type get two titled sections; the verify and by-hand
    slots an agent filled survive the next analyze of that checkpoint."""
    from transformers import CONFIG_MAPPING

    progress = tmp_path / "progress.md"
    for name, layers in (("ckpt-a", 2), ("ckpt-b", 3)):
        CONFIG_MAPPING["qwen3"](num_hidden_layers=layers).save_pretrained(tmp_path / name)
        update_progress(progress, analyze_model(str(tmp_path / name)))
    text = progress.read_text("utf-8")
    assert f"{PROGRESS_HEADING}: ckpt-a (qwen3)\n" in text
    assert f"{PROGRESS_HEADING}: ckpt-b (qwen3)\n" in text
    assert "| attn_type per layer | 0-1 FullAttention |" in text
    assert "| attn_type per layer | 0-2 FullAttention |" in text
    verdict = "- PASSED: tokens identical, max logit diff 1.2e-06, chains ok"
    by_hand = "- modeling_qwen3.py: kept the rope cache in fp32 (accuracy)"
    text = text.replace(
        "- not run yet: paste the verdict line of `kvskill verify <converted dir>`", verdict, 1
    ).replace("- nothing yet: list each change made by hand (file, what, why)", by_hand, 1)
    progress.write_text(text, "utf-8")
    # a changed plan for ckpt-a rewrites its table, not what was written in its slots
    assert update_progress(progress, analyze_model(str(tmp_path / "ckpt-a"), attn_tp_size=2))
    after = progress.read_text("utf-8")
    first = after[: after.index(f"{PROGRESS_HEADING}: ckpt-b")]
    assert verdict in first and by_hand in first and "attn_tp_size=2" in first
    assert after.count("### Verify evidence") == 2


def test_per_layer_line_groups_runs_of_one_kind():
    plan = analyze_model("jamba", config_overrides={"num_hidden_layers": 6})
    line = per_layer_line(plan)
    assert line.split("; ")[0].endswith("Mamba") and "FullAttention" in line
    assert len(line.split("; ")) < 6  # runs, not one entry a layer


def test_progress_file_that_is_not_utf8_is_bad_input(tmp_path, capsys):
    progress = tmp_path / "progress.md"
    progress.write_bytes(b"# notes \xff\xfe\n")
    code, _, err = run_cli(capsys, "analyze", "qwen3", "--write-progress", str(progress))
    assert code == 2 and "progress file" in err and len(err.strip().splitlines()) == 1
    assert progress.read_bytes() == b"# notes \xff\xfe\n"


def test_progress_file_below_a_file_is_bad_input(tmp_path, capsys):
    (tmp_path / "notes").write_text("a file, not a folder\n", "utf-8")
    progress = tmp_path / "notes" / "progress.md"
    code, _, err = run_cli(capsys, "analyze", "qwen3", "--write-progress", str(progress))
    assert code == 2 and "cannot write the progress file" in err
    assert len(err.strip().splitlines()) == 1


def test_markdown_section_lists_decisions_evidence_and_warnings():
    text = to_markdown(analyze_model("deepseek_v3"))
    assert text.startswith(PROGRESS_HEADING)
    assert "| KV mode | paged |" in text and "TND_NTD" in text
    assert "Evidence:" in text and "Watch for:" in text


@pytest.mark.parametrize("model", ["cpmant", "jetmoe"])
def test_the_plan_names_what_apply_refuses(capsys, model):
    code, out, _ = run_cli(capsys, "analyze", model, "--format", "json")
    assert code == 0
    blockers = json.loads(out)["implementer_blockers"]
    assert len(blockers) == 1 and blockers[0].startswith("apply refuses: ")
    assert "cannot convert" in blockers[0]


def test_a_plan_apply_converts_lists_no_blockers(capsys):
    # (gemma2, a Legacy Plan apply converts: tests/implementer/test_plan_contract.py)
    code, out, _ = run_cli(capsys, "analyze", "qwen3", "--format", "json")
    assert code == 0 and json.loads(out)["implementer_blockers"] == []

"""``kvskill apply``: outputs, dry run, idempotence, and clear errors that write nothing."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from kvskill.cli import main
from remote_model import MODELING, write_remote_model


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_output_directory_holds_code_config_and_plan(converted):
    directory = converted.directory("qwen3")
    assert sorted(p.name for p in directory.iterdir()) == [
        "config.json",
        "kvskill_plan.json",
        "modeling_qwen3.py",
    ]
    plan = json.loads((directory / "kvskill_plan.json").read_text())
    assert plan["model_type"] == "qwen3"
    assert plan["conversion"]["package"] == "transformers.models.qwen3"
    assert "cache.update(" in plan["conversion"]["original_source"]
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    code = (directory / "modeling_qwen3.py").read_text()
    assert "from ..." not in code and "from transformers.models.qwen3.configuration_qwen3" in code


@pytest.mark.parametrize("family", ["qwen3", "tiny_remote"])
def test_apply_to_converted_output_is_byte_identical(converted, tmp_path, capsys, family):
    first = converted.directory(family)
    code, _, err = run_cli(capsys, "apply", str(first), "--out", str(tmp_path / "again"))
    assert code == 0, err
    for path in first.glob("*.py"):
        assert (tmp_path / "again" / path.name).read_bytes() == path.read_bytes()


def test_apply_twice_to_the_same_out_dir_is_byte_identical(converted, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, _ = run_cli(capsys, "apply", "qwen3", "--out", str(out))
    assert code == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    code, _, _ = run_cli(capsys, "apply", "qwen3", "--out", str(out), "--force")
    assert code == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first


def test_dry_run_prints_a_diff_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "apply", "llama", "--out", str(out), "--dry-run")
    assert code == 0
    assert stdout.startswith("--- a/modeling_llama.py\n+++ b/modeling_llama.py\n")
    assert "+        attn_output, _ = torch_npu.npu_fused_infer_attention_score(" in stdout
    assert "-            key_states, value_states = cache.update(" in stdout
    assert "nothing written" in err
    assert not out.exists()


def test_json_output_is_one_object(tmp_path, capsys):
    code, stdout, _ = run_cli(
        capsys, "apply", "mistral", "--out", str(tmp_path / "o"), "--format", "json"
    )
    assert code == 0
    data = json.loads(stdout)
    assert data["changed"] is True
    assert data["attn_types"] == ["SlidingWindow"]
    assert set(data["files"]) == {"modeling_mistral.py", "config.json", "kvskill_plan.json"}


def test_comments_in_untouched_code_survive(converted):
    source = (converted.directory("tiny_remote") / "modeling_tiny_remote.py").read_text()
    assert "        # keep this comment: untouched code keeps its comments\n" in source
    # everything above the seam is as written
    assert (
        "        cos, sin = position_embeddings\n"
        "        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)\n"
    ) in source


def test_existing_out_dir_is_refused_and_left_alone(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, "apply", "qwen3", "--out", str(out))
    assert code == 2
    assert "not empty" in err and "--force" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_syntax_error_in_modeling_code_is_bad_input(tmp_path, capsys):
    model = write_remote_model(
        tmp_path / "broken", MODELING.replace("def repeat_kv(x, n_rep):", "def repeat_kv(x, n_rep)")
    )
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "apply", str(model), "--out", str(out))
    assert code in (2, 3)
    assert "modeling_tiny_remote.py" in err
    assert err.count("\n") == 1  # one line, no traceback
    assert not out.exists()


def test_missing_config_is_bad_input(tmp_path, capsys):
    model = write_remote_model(tmp_path / "noconfig")
    (model / "config.json").unlink()
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "apply", str(model), "--out", str(out))
    assert code == 2
    assert "config.json" in err
    assert not out.exists()


def test_unsupported_structure_exits_3_and_writes_nothing(tmp_path, capsys):
    # the attention reads its output through a name defined inside the seam
    modeling = MODELING.replace(
        "        return self.o_proj(attn_output)\n",
        "        return self.o_proj(attn_output) + causal_mask.sum()\n",
        1,
    )
    model = write_remote_model(tmp_path / "odd", modeling)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "apply", str(model), "--out", str(out))
    assert code == 3
    assert "causal_mask" in err
    assert not out.exists()
    assert not list(tmp_path.glob(".out.kvskill-*"))  # no staging left behind


def test_out_dir_inside_the_model_is_refused(tmp_path, capsys):
    model = write_remote_model(tmp_path / "m")
    before = sorted(p.name for p in model.iterdir())
    code, _, err = run_cli(capsys, "apply", str(model), "--out", str(model / "converted"))
    assert code == 2
    assert sorted(p.name for p in model.iterdir()) == before


def test_verify_refuses_remote_code_without_trust(converted, capsys):
    code, _, err = run_cli(capsys, "verify", str(converted.directory("tiny_remote")))
    assert code == 2
    assert "--trust-remote-code" in err and err.count("\n") == 1


def test_weights_of_a_model_directory_are_linked(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    model = write_remote_model(tmp_path / "weighted")
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(model / "model.safetensors"))
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "apply", str(model), "--out", str(out))
    assert code == 0, err
    link = out / "model.safetensors"
    assert link.is_symlink() and os.readlink(link) == "../weighted/model.safetensors"
    # relative links: the model and its conversion can move together
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(str(model), moved / "weighted")
    shutil.move(str(out), moved / "out")
    assert (moved / "out" / "model.safetensors").read_bytes() == (
        moved / "weighted" / "model.safetensors"
    ).read_bytes()
    model = moved / "weighted"
    for flags in (["--weights", "copy"], ["--copy-weights"]):
        shutil.rmtree(out, ignore_errors=True)
        code, _, _ = run_cli(capsys, "apply", str(model), "--out", str(out), *flags)
        assert code == 0
        assert not (out / "model.safetensors").is_symlink()
        assert (out / "model.safetensors").read_bytes() == (
            model / "model.safetensors"
        ).read_bytes()


def test_reapplied_output_still_verifies_against_the_first_source(converted, tmp_path, capsys):
    first = converted.directory("qwen3")
    again = tmp_path / "again"
    code, _, _ = run_cli(capsys, "apply", str(first), "--out", str(again))
    assert code == 0
    plan = json.loads((again / "kvskill_plan.json").read_text())
    assert plan["source"]["kind"] == "transformers"
    assert "cache.update(" in plan["conversion"]["original_source"]
    code, stdout, _ = run_cli(
        capsys, "verify", str(again), "--format", "json", "--num-prompts", "2"
    )
    assert code == 0
    assert json.loads(stdout)["passed"] is True


def test_verify_of_a_config_the_original_model_cannot_build_is_bad_input(tmp_path, capsys):
    # A config.json the original modeling code refuses (here an unknown rope type) is the
    # input's fault: exit 2 and one line, not an internal error.
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "apply", "qwen3", "--out", str(out))
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "no-such-rope"}
    (out / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "verify", str(out))
    assert code == 2
    assert "cannot be built from the shrunk config" in err and "Traceback" not in err


def test_verify_refuses_models_that_do_not_fit_in_memory_before_building_them(
    converted, monkeypatch
):
    # Counted on the meta device: a too-large config is a one-line error, not an OOM kill.
    from kvskill.core.errors import BadInputError
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    monkeypatch.setattr("kvskill.runtime.loader.available_memory_bytes", lambda device: 1 << 20)
    with pytest.raises(BadInputError, match="GiB is free"):
        verify_directory(converted.directory("qwen3"), VerifyOptions())


def test_an_original_model_that_fails_to_generate_is_bad_input(converted, monkeypatch):
    # e.g. hrm_text, whose stacks index layers past the shrunk count: the original's own
    # failure is reported as such (exit 2), not as an internal error.
    from kvskill.core.errors import BadInputError
    from kvskill.verify import flow as verify

    def broken(*args, **kwargs):
        raise IndexError("list index out of range")

    monkeypatch.setattr(verify, "reference_generate", broken)
    with pytest.raises(BadInputError, match="fails to generate with the shrunk config"):
        verify.verify_directory(converted.directory("qwen3"), verify.VerifyOptions())


def test_kv_heads_tiled_with_repeat_are_refused(tmp_path, capsys):
    # JetMoE repeats its KV heads (query head h reads KV head h % KVN); the fused operator
    # groups them (h // G), so a conversion would attend to the wrong heads.
    code, _, err = run_cli(capsys, "apply", "jetmoe", "--out", str(tmp_path / "out"))
    assert code == 3
    assert "tiles its KV heads with .repeat" in err
    assert not (tmp_path / "out").exists()


def test_a_window_only_the_cache_applies_is_refused(tmp_path, capsys):
    # Moshi's mask is plain causal, but with no layer_types transformers' DynamicCache makes
    # every layer a sliding-window cache: prefill sees the whole prompt, decode the last W
    # tokens. A window below max_position_embeddings binds, and no single mask matches.
    out = tmp_path / "out"
    code, _, err = run_cli(
        capsys, "apply", "moshi", "--config-overrides", "sliding_window=8", "--out", str(out)
    )
    assert code == 3
    assert "mask and cache disagree" in err and "sliding_window=8" in err
    assert not out.exists()

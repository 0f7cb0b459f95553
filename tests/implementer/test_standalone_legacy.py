"""The framework's standalone Legacy model (mode 1) converted to standalone mode 2, and proven.

The fixture (tests/fixtures/cann_legacy/dense_standalone) has the shape of cann-recipes-infer's
standalone dense models: its own runner, ``init_cache`` rows ``[B, max_len, width]``,
``scatter_update_`` at ``kv_len``, BSH fused attention. ``apply --mode standalone`` rewrites it
in place (KVR024, KVR025); ``verify`` drives the result paged against the fixture's own Legacy
path through the runner's protocol.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kvskill.analyzer.analyze import analyze_model
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.convert import ApplyOptions
from kvskill.implementer.pipeline import convert_standalone_legacy_source
from kvskill.implementer.spec import ConversionSpec, FaVersion
from kvskill.implementer.standalone.convert import convert_standalone

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "cann_legacy" / "dense_standalone"
MODELING = "modeling_legacy_dense.py"
SOURCE = (FIXTURE / MODELING).read_text(encoding="utf-8")
SPEC = ConversionSpec(
    fa_version=FaVersion.V1,
    input_layout="TND",
    uniform_attn_type="FullAttention",
    sparse_mode={"FullAttention": {"prefill": 3, "decode": 3}},
    causal_lm_class="LegacyDenseForCausalLM",
)
STANDALONE = ApplyOptions(deploy_mode="standalone")


def convert(source: str) -> str:
    return convert_standalone_legacy_source(source, SPEC, filename=MODELING)


def _refusal(source: str) -> str:
    with pytest.raises(UnsupportedModelError) as caught:
        convert(source)
    return str(caught.value)


def _line_of(text: str) -> int:
    return SOURCE.splitlines().index(text) + 1


def test_the_plan_reads_the_standalone_legacy_path_and_apply_keeps_the_runner():
    plan = analyze_model(str(FIXTURE))
    assert plan.deploy_mode.value == "standalone"
    assert plan.code["legacy_standalone"] is True and plan.code["legacy_framework"] is False
    init_cache = _line_of("    def init_cache(self, input_ids):")
    write = _line_of("            torch_npu.scatter_update_(past_key, kv_len, key_states, -2)")
    assert plan.code["legacy_standalone_source"] == f"{MODELING}:{init_cache}, {MODELING}:{write}"
    conversion = convert_standalone(plan, STANDALONE)
    assert "def set_paged_step_metadata(" in conversion.converted
    # no runner is generated: the model's own runner is written unchanged
    runner = (FIXTURE / "runner_legacy_dense.py").read_text(encoding="utf-8")
    assert conversion.added == {"runner_legacy_dense.py": runner}
    assert conversion.standalone.mode == 2 and conversion.standalone.kv_mode == "paged"


def test_the_conversion_replaces_every_legacy_piece_by_mode_2():
    converted = convert(SOURCE)
    # scatter_update_ at kv_len -> npu_scatter_nd_update_ at the step's slots
    assert "scatter_update_(" not in converted.replace("npu_scatter_nd_update_(", "")
    assert converted.count("torch_npu.npu_scatter_nd_update_(past_") == 2
    assert converted.count('get_forward_metadata().slot_mapping["FullAttention"]') == 2
    # the BSH prefill / decode pair -> one TND call over the static block table
    assert converted.count("npu_fused_infer_attention_score(") == 1
    assert 'input_layout="BSH"' not in converted and 'input_layout="TND"' in converted
    assert 'block_table=md.block_table["FullAttention"]' in converted
    assert "block_size=past_key.shape[1]" in converted
    assert "if q_len == 1:" not in converted and "past_key_states" not in converted
    # init_cache: blocks and a static block table instead of [B, max_len, width] rows
    assert "cache_shape = ((batch_size) * blocks_per_row, self.block_size, " in converted
    assert "self.block_table = torch.arange(" in converted
    assert "self.block_size = 128" in converted
    # the step's metadata is set where the runner asks for its inputs
    assert "self.set_paged_step_metadata(input_ids, kv_len, is_prefill)\n        return {" in (
        converted
    )
    assert "from executor.utils.forward_metadata import" in converted
    assert "import kvskill" not in converted and "from kvskill" not in converted


def test_converting_twice_changes_nothing():
    converted = convert(SOURCE)
    assert convert(converted) == converted


def test_the_self_check_refuses_a_half_converted_output():
    """A rewrite that left one Legacy write or a BSH kernel behind is caught after the fact."""
    import libcst as cst
    from kvskill.implementer.standalone_legacy_checks import standalone_legacy_self_check

    converted = convert(SOURCE)
    paged_write = converted.splitlines()[
        next(
            i
            for i, line in enumerate(converted.splitlines())
            if "npu_scatter_nd_update_(past_value" in line
        )
    ]
    half = converted.replace(
        paged_write, "            torch_npu.scatter_update_(past_value, kv_len, value_states, -2)"
    )
    with pytest.raises(UnsupportedModelError, match="a scatter_update_ row write is left"):
        standalone_legacy_self_check(cst.parse_module(SOURCE), cst.parse_module(half), MODELING)
    no_table = converted.replace('block_table=md.block_table["FullAttention"],', "")
    with pytest.raises(UnsupportedModelError, match=r"\(1 without the step.s block_table\)"):
        standalone_legacy_self_check(cst.parse_module(SOURCE), cst.parse_module(no_table), MODELING)
    standalone_legacy_self_check(cst.parse_module(SOURCE), cst.parse_module(converted), MODELING)


def test_a_quantized_fused_attention_is_refused_with_class_and_line():
    message = _refusal(SOURCE.replace("antiquant_mode=0,", "antiquant_mode=1,"))
    assert "LegacyDenseAttention.exec_qkv line" in message
    assert "antiquant_mode=1, which the Paged rewrite does not carry over" in message


def test_a_windowed_legacy_call_is_refused():
    message = _refusal(SOURCE.replace("sparse_mode=2,", "sparse_mode=4,"))
    assert "sparse_mode=4 is not causal full attention" in message


def test_an_init_cache_allocating_other_states_is_refused_with_its_line():
    source = SOURCE.replace(
        "            past_key_values += ((key_cache, value_cache),)\n",
        "            state = torch.zeros((batch_size, 4), dtype=dtype)\n"
        "            past_key_values += ((key_cache, value_cache, state),)\n",
    )
    message = _refusal(source)
    assert (
        f"LegacyDenseForCausalLM.init_cache (line {_line_of('    def init_cache(self, input_ids):')})"
        in message
    )
    assert "allocates tensors other than cache_shape rows (line" in message


def test_a_third_row_write_is_refused_not_half_converted():
    write = "            torch_npu.scatter_update_(past_value, kv_len, value_states, -2)\n"
    message = _refusal(SOURCE.replace(write, write + write.replace("past_value", "past_key")))
    assert "LegacyDenseAttention.exec_qkv (line" in message
    assert "calls scatter_update_ 3 times" in message


def test_step_inputs_without_kv_len_are_refused():
    signature = "        is_prefill=None,\n        kv_len=None,\n"
    assert signature in SOURCE
    source = SOURCE.replace(signature, "        is_prefill=None,\n").replace(
        "            position_ids = kv_len.unsqueeze(1)",
        "            kv_len = kwargs['kv_len']\n            position_ids = kv_len.unsqueeze(1)",
    )
    message = _refusal(source)
    assert "LegacyDenseForCausalLM.prepare_inputs_for_generation (line" in message
    assert "takes no kv_len" in message


def test_framework_mode_points_to_standalone_mode():
    from kvskill.implementer.convert import convert_framework

    plan = analyze_model(str(FIXTURE))
    with pytest.raises(UnsupportedModelError, match="convert it with --mode standalone"):
        convert_framework(plan, ApplyOptions(deploy_mode="framework"))


def test_kv_mode_contiguous_is_refused_for_a_model_already_in_mode_1():
    plan = analyze_model(str(FIXTURE))
    with pytest.raises(UnsupportedModelError, match="already standalone mode 1"):
        convert_standalone(plan, ApplyOptions(deploy_mode="standalone", kv_mode="contiguous"))


def test_the_cli_refuses_in_one_line_with_exit_3(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(FIXTURE, model)
    modeling = model / MODELING
    modeling.write_text(SOURCE.replace("sparse_mode=2,", "sparse_mode=4,"), encoding="utf-8")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvskill",
            "apply",
            str(model),
            "--mode",
            "standalone",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 3
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "LegacyDenseAttention.exec_qkv line" in done.stderr
    assert not (tmp_path / "out").exists()


def _apply(tmp_path: Path) -> Path:
    from kvskill.implementer.writer import apply_model

    out = tmp_path / "out"
    apply_model(str(FIXTURE), out, STANDALONE)
    return out


def _verify(out: Path):
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    return verify_directory(out, VerifyOptions(trust_remote_code=True, max_new_tokens=8))


@pytest.mark.slow
def test_apply_then_verify_is_token_exact_against_the_legacy_original(tmp_path):
    out = _apply(tmp_path)
    assert (out / "runner_legacy_dense.py").is_file()
    record = json.loads((out / "kvskill_plan.json").read_text())
    assert record["code"]["legacy_standalone"] is True
    report = _verify(out)
    assert report.error is None
    assert report.tokens_identical and report.logits_within
    assert report.max_logit_diff < 1e-4
    assert [c["passed"] for c in report.chains] == [True, True, True]
    assert any("Legacy rows from init_cache: [4, 64, 128]" in n for n in report.notes)


def test_run_refuses_an_output_that_keeps_its_own_runner(tmp_path):
    from kvskill.core.errors import BadInputError
    from kvskill.verify.launch import StandaloneRun

    out = _apply(tmp_path)
    with pytest.raises(BadInputError, match=r"its own runner \(runner_legacy_dense.py\)"):
        StandaloneRun.load(out, trust_remote_code=True)


@pytest.mark.slow
def test_verify_fails_a_conversion_whose_paged_attention_is_wrong(tmp_path):
    """The comparison can fail: a scale 10% off in the paged call moves the logits."""
    out = _apply(tmp_path)
    modeling = out / MODELING
    text = modeling.read_text(encoding="utf-8")
    assert "scale=self.scale_fa," in text
    modeling.write_text(text.replace("scale=self.scale_fa,", "scale=self.scale_fa * 1.1,"))
    report = _verify(out)
    assert not report.logits_within


@pytest.mark.slow
def test_verify_fails_slots_that_ignore_the_block_table(tmp_path):
    """The linear slot formula b * max_len + p holds only for an arange table; verify shuffles
    the table, so slots that bypass it write where the kernel does not read."""
    out = _apply(tmp_path)
    modeling = out / MODELING
    text = modeling.read_text(encoding="utf-8")
    right = "slots = (blocks * self.block_size + positions % self.block_size).view(-1)"
    assert right in text
    linear = (
        "slots = (torch.arange(batch_size)[:, None] * self.block_table.shape[1] * "
        "self.block_size + positions).view(-1)"
    )
    modeling.write_text(text.replace(right, linear))
    report = _verify(out)
    assert not (report.tokens_identical and report.logits_within)


@pytest.mark.slow
def test_the_fixtures_own_runner_drives_both_files_as_verify_does(tmp_path):
    """verify's runner protocol is the fixture runner's: same tokens on the original, and the
    converted directory still runs under the runner it had."""
    import importlib

    import torch
    from kvskill.runtime.executor_host import framework_modules
    from kvskill.runtime.forward_context import reset_forward_metadata
    from kvskill.runtime.ops.npu_standin import npu_standin
    from kvskill.verify.drivers.legacy_original import import_model
    from kvskill.verify.drivers.runner import import_runner
    from kvskill.verify.drivers.standalone_legacy import runner_settings
    from kvskill.verify.drivers.standalone_legacy_drive import drive_runner_protocol

    out = _apply(tmp_path)
    plan = json.loads((out / "kvskill_plan.json").read_text())
    config = json.loads((out / "config.json").read_text())
    prompts = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16]]
    settings = runner_settings(batch_size=3, input_max_len=7, max_new_tokens=6)
    runs = {}
    with npu_standin(), framework_modules(), torch.no_grad():
        for name, folder in (("original", FIXTURE), ("converted", out)):
            cls, cfg, _ = import_model(folder, plan["code"], config)
            torch.manual_seed(0)
            model = cls(cfg, settings).eval()
            model.block_size = 4
            runner = import_runner(folder / "runner_legacy_dense.py").LegacyDenseRunner(model)
            runs[name] = runner.generate(prompts, 6)
            runs[f"{name} drive"] = drive_runner_protocol(
                model, prompts, max_new_tokens=6, pad_token_id=0
            ).token_ids
        reset_forward_metadata()
    assert importlib.util.find_spec("kvskill") is not None
    assert (
        runs["original"] == runs["original drive"] == runs["converted"] == runs["converted drive"]
    )


ROOT = os.environ.get("KVSKILL_CANN_RECIPES")
#: the real model's files, and a shrunk config of it (fp32, 2 layers, head_dim 64 as the
#: rotary operator needs)
PANGU_FILES = (
    "models/modeling_openpangu_dense.py",
    "models/configuration_openpangu_dense.py",
    "runner_openpangu_dense.py",
)
PANGU_CONFIG = {
    "model_type": "PanguEmbedded",
    "architectures": ["PanguEmbeddedForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_openpangu_dense.PanguEmbeddedConfig"},
    "vocab_size": 64,
    "hidden_size": 128,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 64,
    "rope_theta": 10000.0,
    # NOTE: linear scaling by 1 is no scaling; transformers 5 replaces a null rope_scaling by
    # a default without the "type" key the file (written for 4.55) reads
    "rope_scaling": {"type": "linear", "rope_type": "linear", "factor": 1.0},
    "rms_norm_eps": 1e-5,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}


@pytest.mark.skipif(not ROOT, reason="KVSKILL_CANN_RECIPES is not set")
def test_the_real_pangu_7b_converts_to_mode_2_and_verifies_token_exact(tmp_path):
    pytest.importorskip("datasets", reason="the framework's executor imports datasets")
    from kvskill.implementer.writer import apply_model
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    real = Path(ROOT) / "models" / "pangu_7b"
    model = tmp_path / "pangu_7b"
    model.mkdir()
    for name in PANGU_FILES:
        shutil.copy(real / name, model / Path(name).name)
    (model / "config.json").write_text(json.dumps(PANGU_CONFIG))
    plan = analyze_model(str(model))
    assert plan.code["legacy_standalone"] is True
    out = tmp_path / "out"
    apply_model(str(model), out, STANDALONE)
    converted = (out / "modeling_openpangu_dense.py").read_text(encoding="utf-8")
    assert "scatter_update_(" not in converted.replace("npu_scatter_nd_update_(", "")
    assert (out / "runner_openpangu_dense.py").read_text() == (model / PANGU_FILES[2]).read_text()
    report = verify_directory(out, VerifyOptions(trust_remote_code=True, max_new_tokens=8))
    assert report.error is None
    assert report.tokens_identical and report.logits_within and report.max_logit_diff < 1e-4
    assert [c["passed"] for c in report.chains] == [True, True, True]

"""The framework's standalone Legacy MLA model converted to paged (mode 3), and proven.

The fixture (tests/fixtures/cann_legacy/mla_standalone) has the shape of cann-recipes-infer's
GLM-5.2 without its indexer: latent (nope) and rope caches ``[B * blocks, block_size, 1, dim]``
from ``init_cache``, written as rows with ``scatter_update_`` at ``kv_len``, read by one TND
fused attention with ``query_rope`` / ``key_rope`` over the attention's own arange block table.
``apply --mode standalone`` rewrites it in place (KVR026, KVR025); ``verify`` drives the result
paged, with a shuffled block table, against the fixture's own Legacy path.
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

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "cann_legacy" / "mla_standalone"
MODELING = "modeling_legacy_mla.py"
SOURCE = (FIXTURE / MODELING).read_text(encoding="utf-8")
#: what apply derives from the MLA Plan (absorbed: causal prefill, decode without a mask)
SPEC = ConversionSpec(
    fa_version=FaVersion.V1,
    input_layout="TND",
    uniform_attn_type="FullAttention",
    sparse_mode={"FullAttention": {"prefill": 3, "decode": 0}},
    causal_lm_class="LegacyMlaForCausalLM",
)
STANDALONE = ApplyOptions(deploy_mode="standalone")
NOPE_WRITE = (
    "        torch_npu.scatter_update_(nope_cache.view(bsz, -1, self.kv_lora_rank), kv_len, "
    "k_nope, 1)\n"
)
ROPE_WRITE = (
    "        torch_npu.scatter_update_(rope_cache.view(bsz, -1, self.qk_rope_head_dim), kv_len, "
    "k_pe, 1)\n"
)


def convert(source: str) -> str:
    return convert_standalone_legacy_source(source, SPEC, filename=MODELING)


def _refusal(source: str) -> str:
    assert source != SOURCE, "the mutation applied"
    with pytest.raises(UnsupportedModelError) as caught:
        convert(source)
    return str(caught.value)


def _line_of(text: str) -> int:
    return SOURCE.splitlines().index(text) + 1


def test_the_fixture_writes_both_caches_as_rows_and_reads_its_own_table():
    assert NOPE_WRITE in SOURCE and ROPE_WRITE in SOURCE
    assert "block_table=self.block_table," in SOURCE
    assert "key_rope=rope_cache.flatten(2)," in SOURCE


def test_the_plan_reads_the_standalone_legacy_mla_path_and_apply_keeps_the_runner():
    plan = analyze_model(str(FIXTURE))
    assert plan.deploy_mode.value == "standalone" and plan.is_mla
    assert plan.code["legacy_standalone"] is True
    # the conversion keeps the model's own absorbed call for prefill: no un-absorbed prefill
    # limits, the 16-token limit of a 512-wide latent named instead
    assert not [w for w in plan.warnings if "un-absorbed" in w]
    assert any("keeps the model's own absorbed call for prefill" in w for w in plan.warnings)
    conversion = convert_standalone(plan, STANDALONE)
    runner = (FIXTURE / "runner_legacy_mla.py").read_text(encoding="utf-8")
    assert conversion.added == {"runner_legacy_mla.py": runner}
    assert conversion.standalone.mode == 3 and conversion.standalone.mla_absorb
    assert conversion.standalone.kv_mode == "paged"


def test_the_conversion_replaces_every_legacy_piece():
    converted = convert(SOURCE)
    # the row writes at kv_len -> slot-mapped writes of the same states into each cache
    assert "scatter_update_(" not in converted.replace("npu_scatter_nd_update_(", "")
    slots = 'get_forward_metadata().slot_mapping["FullAttention"].view(-1, 1)'
    assert f"npu_scatter_nd_update_(nope_cache.view(-1, k_nope.shape[-1]), {slots}" in converted
    assert f"npu_scatter_nd_update_(rope_cache.view(-1, k_pe.shape[-1]), {slots}" in converted
    # the one fused call keeps its query, caches and rope parts, reads the step's table
    assert converted.count("npu_fused_infer_attention_score(") == 1
    assert "key_rope=rope_cache.flatten(2)," in converted
    assert 'block_table=md.block_table["FullAttention"],' in converted
    assert "block_size=nope_cache.shape[1]," in converted
    assert "sparse_mode=(3 if md.is_prefill else 0)," in converted
    assert "atten_mask=md.attention_mask if md.is_prefill else None," in converted
    assert "actual_seq_lengths=actual_seq_lengths_q" not in converted
    # the pseudo-paged table of the attention is gone; the model holds the step's table
    assert "self.block_table = torch.arange(0, self.batch_size_per_rank" not in converted
    assert (
        "self.block_table = torch.arange(batch_size * cache_len, dtype=torch.int32, "
        "device=input_ids.device).view(input_ids.shape[0], -1)"
    ) in converted
    assert "self.set_paged_step_metadata(input_ids, kv_len, is_prefill)\n        return {" in (
        converted
    )
    assert "from executor.utils.forward_metadata import" in converted
    assert "import kvskill" not in converted and "from kvskill" not in converted


def test_converting_twice_changes_nothing():
    converted = convert(SOURCE)
    assert convert(converted) == converted


def test_the_self_check_refuses_a_call_left_on_the_models_own_table():
    import libcst as cst
    from kvskill.implementer.standalone_legacy_checks import standalone_legacy_self_check

    converted = convert(SOURCE)
    own = converted.replace(
        'block_table=md.block_table["FullAttention"],', "block_table=self.block_table,"
    )
    with pytest.raises(UnsupportedModelError) as refused:
        standalone_legacy_self_check(cst.parse_module(SOURCE), cst.parse_module(own), MODELING)
    assert "(1 without the step's block_table)" in str(refused.value)
    assert "LegacyMlaAttention still reads its own self.block_table" in str(refused.value)


def test_a_quantized_mla_attention_is_refused_with_class_and_line():
    kernel = "        attn_output, _ = torch.ops.npu.npu_fused_infer_attention_score("
    source = SOURCE.replace(
        "            sparse_mode=3,\n",
        "            sparse_mode=3,\n            antiquant_mode=1,\n",
    )
    message = _refusal(source)
    assert f"LegacyMlaAttention.forward line {_line_of(kernel)}" in message
    assert "antiquant_mode=1, which the paged MLA rewrite does not carry over" in message


def test_a_windowed_mla_call_is_refused():
    message = _refusal(
        SOURCE.replace("            sparse_mode=3,\n", "            sparse_mode=4,\n")
    )
    assert "sparse_mode=4 is not causal full attention" in message


def test_a_bsnd_read_without_the_models_table_is_refused():
    source = SOURCE.replace('input_layout="TND",', 'input_layout="BSND",').replace(
        "            block_table=self.block_table,\n", ""
    )
    message = _refusal(source)
    assert 'passes input_layout="BSND" and no block_table' in message


def test_a_key_rope_read_from_another_cache_is_refused():
    message = _refusal(SOURCE.replace("key_rope=rope_cache.flatten(2),", "key_rope=k_pe,"))
    assert "reads nope_cache (key / value) and k_pe (key_rope), not the two caches" in message


def test_a_third_write_is_refused_not_half_converted():
    message = _refusal(SOURCE.replace(ROPE_WRITE, ROPE_WRITE + ROPE_WRITE))
    assert "LegacyMlaAttention.forward (line" in message
    assert "calls scatter_update_ 3 times" in message


def test_a_write_along_the_head_axis_of_a_4d_view_is_refused():
    rows = "nope_cache.view(bsz, -1, self.kv_lora_rank), kv_len, k_nope, 1)"
    heads = "nope_cache.view(bsz, -1, 1, self.kv_lora_rank), kv_len, k_nope, -2)"
    message = _refusal(SOURCE.replace(NOPE_WRITE, NOPE_WRITE.replace(rows, heads)))
    assert f"LegacyMlaAttention.forward line {_line_of(NOPE_WRITE.rstrip())}" in message
    assert "is not a bare scatter_update_(<cache> or <cache>.view(batch, -1, dim)" in message


def test_writes_at_two_positions_are_refused():
    message = _refusal(SOURCE.replace(ROPE_WRITE, ROPE_WRITE.replace("kv_len", "kv_len + 1")))
    assert "the two writes index different positions" in message


def test_writes_not_at_kv_len_are_refused():
    source = SOURCE.replace(NOPE_WRITE, NOPE_WRITE.replace("kv_len", "kv_len + 1")).replace(
        ROPE_WRITE, ROPE_WRITE.replace("kv_len", "kv_len + 1")
    )
    message = _refusal(source)
    assert "the writes start at kv_len + 1, not at the runner's kv_len" in message


def test_the_table_read_elsewhere_is_refused():
    source = SOURCE.replace(
        "        return w_k.permute(1, 2, 0), w_v.transpose(0, 1)\n",
        "        assert self.block_table is not None\n"
        "        return w_k.permute(1, 2, 0), w_v.transpose(0, 1)\n",
    )
    message = _refusal(source)
    assert "reads self.block_table in absorbed_kv_b_weights besides its fused attention" in message


def test_an_init_cache_allocating_another_shape_is_refused_with_its_line():
    source = SOURCE.replace(
        "            cache_rope = torch.zeros(rope_shape, dtype=dtype, device=input_ids.device)\n",
        "            cache_rope = torch.zeros(rope_shape, dtype=dtype, device=input_ids.device)\n"
        "            state = torch.zeros((batch_size, 4), dtype=dtype)\n",
    )
    message = _refusal(source)
    assert "LegacyMlaForCausalLM.init_cache (line" in message
    assert "`torch.zeros((batch_size, 4), dtype=dtype)` allocates neither the rows" in message


def test_caches_of_two_block_counts_are_refused():
    source = SOURCE.replace(
        "rope_shape = (batch_size * cache_len, self.block_size,",
        "rope_shape = (batch_size * cache_len * 2, self.block_size,",
    )
    message = _refusal(source)
    assert "with 2 block count(s)" in message


def test_a_block_size_the_mla_attention_cannot_page_is_bad_input(tmp_path):
    from kvskill.core.errors import BadInputError
    from kvskill.implementer.writer import apply_model

    options = ApplyOptions(deploy_mode="standalone", block_size=24)
    with pytest.raises(BadInputError, match="--block-size 24: the MLA caches need a multiple"):
        apply_model(str(FIXTURE), tmp_path / "out", options)
    assert not (tmp_path / "out").exists()


def test_the_cli_refuses_in_one_line_with_exit_3(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(FIXTURE, model)
    (model / MODELING).write_text(
        SOURCE.replace("            sparse_mode=3,\n", "            sparse_mode=4,\n"),
        encoding="utf-8",
    )
    done = subprocess.run(
        [sys.executable, "-m", "kvskill", "apply", str(model), "--mode", "standalone"]
        + ["--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 3
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "LegacyMlaAttention.forward line" in done.stderr
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


def _mutate(out: Path, old: str, new: str) -> None:
    modeling = out / MODELING
    text = modeling.read_text(encoding="utf-8")
    assert text.count(old) == 1, old
    modeling.write_text(text.replace(old, new), encoding="utf-8")


@pytest.mark.slow
def test_apply_then_verify_is_token_exact_against_the_legacy_original(tmp_path):
    out = _apply(tmp_path)
    assert (out / "runner_legacy_mla.py").is_file()
    record = json.loads((out / "kvskill_plan.json").read_text())
    assert record["code"]["legacy_standalone"] is True
    report = _verify(out)
    assert report.error is None
    assert report.tokens_identical and report.logits_within
    assert report.max_logit_diff < 1e-4
    assert [c["passed"] for c in report.chains] == [True, True, True]
    # 4 prompts x 2048 / 128 blocks of the Legacy layout; 2 layers x (nope, rope) paged
    assert any("Legacy rows from init_cache: [64, 128, 1, 128]" in n for n in report.notes)
    assert "4 caches from init_cache are paged blocks" in report.chains[0]["summary"]


@pytest.mark.slow
def test_verify_fails_a_rope_write_at_the_wrong_slots(tmp_path):
    """The comparison can fail: the rope keys written one slot off are read as garbage."""
    out = _apply(tmp_path)
    slots = 'get_forward_metadata().slot_mapping["FullAttention"].view(-1, 1)'
    _mutate(
        out,
        f"npu_scatter_nd_update_(rope_cache.view(-1, k_pe.shape[-1]), {slots}",
        f"npu_scatter_nd_update_(rope_cache.view(-1, k_pe.shape[-1]), {slots} + 1",
    )
    report = _verify(out)
    assert not (report.tokens_identical and report.logits_within)


@pytest.mark.slow
def test_verify_fails_the_rope_cache_read_as_the_latent(tmp_path):
    """The latent read where the rope keys belong: a wrong conversion never passes."""
    out = _apply(tmp_path)
    _mutate(
        out,
        "key_rope=rope_cache.flatten(2),",
        "key_rope=nope_cache.flatten(2)[..., : rope_cache.shape[-1]],",
    )
    report = _verify(out)
    assert report.error is not None or not (report.tokens_identical and report.logits_within)


@pytest.mark.slow
def test_verify_fails_slots_that_ignore_the_block_table(tmp_path):
    """The Legacy row address b * max_len + p holds only for the arange table; verify
    shuffles the table, so slots that bypass it write where the kernel does not read."""
    out = _apply(tmp_path)
    right = "slots = (blocks * self.block_size + positions % self.block_size).view(-1)"
    linear = (
        "slots = (torch.arange(batch_size)[:, None] * self.block_table.shape[1] * "
        "self.block_size + positions).view(-1)"
    )
    _mutate(out, right, linear)
    report = _verify(out)
    assert not (report.tokens_identical and report.logits_within)


@pytest.mark.slow
def test_the_fixtures_own_runner_drives_both_files_to_the_same_tokens(tmp_path):
    import torch
    from kvskill.runtime.executor_host import framework_modules
    from kvskill.runtime.forward_context import reset_forward_metadata
    from kvskill.runtime.ops.npu_standin import npu_standin
    from kvskill.verify.drivers.legacy_original import import_model
    from kvskill.verify.drivers.runner import import_runner
    from kvskill.verify.drivers.standalone_legacy import runner_settings

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
            if name == "converted":
                # several blocks per row, so the step's table is what addresses them
                model.block_size = 16
            runner = import_runner(folder / "runner_legacy_mla.py").LegacyMlaRunner(model)
            runs[name] = runner.generate(prompts, 6)
        reset_forward_metadata()
    assert runs["original"] == runs["converted"]


@pytest.mark.slow
def test_verify_fails_the_latent_and_rope_caches_swapped(tmp_path):
    """init_cache handing each layer (rope, nope): the latent's slots fall outside the
    narrower rope cache, and verify reports the converted run's error instead of passing."""
    out = _apply(tmp_path)
    _mutate(
        out,
        "past_key_values += ((cache_nope, cache_rope),)",
        "past_key_values += ((cache_rope, cache_nope),)",
    )
    report = _verify(out)
    assert not report.passed
    assert report.error is not None and "the converted model failed in its runner" in report.error
    assert "npu_scatter_nd_update_: indices out of range" in report.error

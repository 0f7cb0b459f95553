"""The framework's Legacy gated-delta states converted to MambaCacheEntry entries, and proven.

The fixture (tests/fixtures/cann_legacy/gqa_gated_delta) has the shape of cann-recipes-infer's
Legacy Qwen3.5: three gated-delta layers whose ``init_cache`` states are ``[batch, ...]`` rows
(row b = request b) and one Legacy GQA attention layer. ``apply`` rewrites it in place
(KVR020, KVR021, KVR022); ``verify`` runs the result paged against the fixture's own Legacy
path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.pipeline import convert_framework_legacy_source
from kvskill.implementer.spec import ConversionSpec, FaVersion

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "cann_legacy" / "gqa_gated_delta"
MODELING = "modeling_legacy_gated_delta.py"
SOURCE = (FIXTURE / MODELING).read_text(encoding="utf-8")
SPEC = ConversionSpec(
    fa_version=FaVersion.V1,
    input_layout="TND",
    uniform_attn_type="FullAttention",
    sparse_mode={"FullAttention": {"prefill": 3, "decode": 3}},
)


def convert(source: str) -> str:
    return convert_framework_legacy_source(source, SPEC, filename=MODELING)


def _refusal(source: str) -> str:
    assert source != SOURCE, "the test's edit must change the fixture"
    with pytest.raises(UnsupportedModelError) as info:
        convert(source)
    return str(info.value)


def test_the_states_become_mamba_entries_with_the_row_shapes_init_cache_gave():
    converted = convert(SOURCE)
    # init_cache is gone with its per-batch-row allocations; the None placeholders too
    assert "def init_cache" not in converted and "self.conv_state = None" not in converted
    assert converted.count("MambaCacheEntry(") == 2 and 'self.attn_type = "Mamba"' in converted
    assert "shape=[self.conv_dim, self.conv_kernel_size]," in converted
    assert "shape=[self.num_v_heads, self.head_v_dim, self.head_k_dim]," in converted
    assert "def set_conv_state(self, tensor" in converted
    assert "def set_recurrent_state(self, tensor" in converted
    assert "from executor.core.kv_cache import" in converted and "MambaCacheEntry" in converted
    assert "from kvskill" not in converted


def test_every_state_use_is_made_at_the_requests_blocks():
    converted = convert(SOURCE)
    # both methods bind the step's blocks from block_table["Mamba"]
    assert converted.count("state_index = md.block_table[self.attn_type][:, 0].long()") == 2
    # prefill: whole-row copy_ -> indexed writes
    assert ".copy_(window)" not in converted and ".copy_(last_recurrent_state)" not in converted
    assert "conv_state[state_index] = window.to(conv_state.dtype)" in converted
    assert (
        "recurrent_state[state_index] = last_recurrent_state.to(recurrent_state.dtype)" in converted
    )
    # decode: the conv shifts this step's rows, written back to their blocks
    assert "conv_state_step = conv_state[state_index]" in converted
    assert "conv_state[state_index] = conv_state_step" in converted
    # decode: the kernel reads the paged states at the blocks, not at arange(batch)
    assert "ssm_state_indices=state_index.to(torch.int32)," in converted
    assert "ssm_state_indices=self.gdn_ssm_state_indices" not in converted
    assert "actual_seq_lengths=md.actual_seq_lengths_q.to(torch.int32)," in converted
    # only the overwriting (prefill) path refuses steps with cached tokens
    assert converted.count("starts every request from a fresh state") == 1


def test_each_framework_legacy_rewrite_leaves_the_converted_file_alone():
    import libcst as cst
    from kvskill.implementer.registry import ConversionPath, rewrites_for
    from libcst.codemod import CodemodContext

    converted = convert(SOURCE)
    for rewrite in rewrites_for(ConversionPath.FRAMEWORK_LEGACY):
        command = rewrite.command(CodemodContext(filename=MODELING), SPEC, None)
        again = command.transform_module(cst.parse_module(converted)).code
        assert again == converted, rewrite.code


def test_a_state_used_under_a_condition_is_refused_with_class_and_line():
    source = SOURCE.replace(
        "        recurrent_state.copy_(last_recurrent_state)\n",
        "        if num_requests > 1:\n            recurrent_state.copy_(last_recurrent_state)\n",
    )
    message = _refusal(source)
    assert "LegacyGatedDeltaNet._forward_prefill line " in message
    assert (
        "`if num_requests > 1:` uses the Legacy rows recurrent_state under a condition" in message
    )


def test_the_real_files_guards_and_fallback_alias_are_converted():
    """What the framework's Qwen3.5 writes around its states: writes under
    ``with autocast`` / ``if state is not None:``, the decode state chosen by
    ``buffer if state is None else state`` and cast with ``.to(dtype)`` for the kernel."""
    source = (
        SOURCE.replace(
            "        recurrent_state.copy_(last_recurrent_state)\n",
            '        with torch.autocast(device_type="cpu", enabled=False):\n'
            "            if recurrent_state is not None:\n"
            "                recurrent_state.copy_(last_recurrent_state)\n",
        )
        .replace(
            "            recurrent_state,\n            beta=beta,\n",
            "            last_state.to(query.dtype),\n            beta=beta,\n",
        )
        .replace(
            "        batch_size = fused_proj.shape[0]\n",
            "        batch_size = fused_proj.shape[0]\n"
            "        last_state = self.gdn_ssm_state_indices if recurrent_state is None else recurrent_state\n",
        )
    )
    converted = convert(source)
    assert "    if recurrent_state is not None:\n" in converted
    assert (
        "            recurrent_state[state_index] = last_recurrent_state.to(recurrent_state.dtype)"
        in converted
    )
    assert "last_state.to(query.dtype)," in converted
    assert "ssm_state_indices=state_index.to(torch.int32)," in converted


def test_a_state_read_directly_from_self_is_refused():
    source = SOURCE.replace(
        "        conv_state.copy_(window)\n", "        self.conv_state.copy_(window)\n"
    )
    message = _refusal(source)
    assert "LegacyGatedDeltaNet._forward_prefill line " in message
    assert "self.<state> directly" in message


def test_a_kernel_without_row_indices_is_refused():
    source = SOURCE.replace("            ssm_state_indices=self.gdn_ssm_state_indices,\n", "")
    message = _refusal(source)
    assert "LegacyGatedDeltaNet._forward_decode line " in message


def test_a_state_sized_by_the_sequence_is_not_a_per_request_state():
    source = SOURCE.replace(
        "(batch_size, layer.linear_attn.conv_dim, layer.linear_attn.conv_kernel_size)",
        "(batch_size, layer.linear_attn.conv_dim, cache_seq_len)",
    )
    message = _refusal(source)
    assert "LegacyGatedDeltaForCausalLM.init_cache line " in message
    assert "not read from layer.linear_attn" in message
    assert "no layer class holds" not in message, "one reason, reported once"


def test_states_no_layer_class_holds_are_refused():
    source = SOURCE.replace("        self.recurrent_state = None\n", "")
    message = _refusal(source)
    assert "not exactly one class sets them all to None" in message
    assert "conv_state, recurrent_state" in message


def _apply(tmp_path):
    return _apply_model_dir(FIXTURE, tmp_path / "out")


def _verify(out):
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    return verify_directory(out, VerifyOptions(trust_remote_code=True, max_new_tokens=8))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("num_prompts", "max_new_tokens", "block_size"),
    # the second: 37 prompt tokens over a step budget of 32, so the prompts are admitted in
    # more than one prefill step; blocks of 4 tokens
    [(4, 8, None), (6, 16, 4)],
)
def test_apply_then_verify_is_token_exact_against_the_legacy_original(
    tmp_path, num_prompts, max_new_tokens, block_size
):
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    options = VerifyOptions(
        trust_remote_code=True,
        num_prompts=num_prompts,
        max_new_tokens=max_new_tokens,
        block_size=block_size,
    )
    report = verify_directory(_apply(tmp_path), options)
    assert report.error is None
    assert report.tokens_identical and report.logits_within
    assert report.max_logit_diff < 1e-4
    assert [c["passed"] for c in report.chains] == [True, True, True]
    runtime_chain = next(c for c in report.chains if c["name"] == "runtime")
    assert "Mamba" in str(runtime_chain)


@pytest.mark.slow
def test_verify_fails_a_conversion_that_reads_states_from_the_wrong_blocks(tmp_path):
    """The comparison can fail: the decode kernel reading each request's recurrent state
    from another request's block (the step's block order reversed) changes the tokens."""
    out = _apply(tmp_path)
    modeling = out / MODELING
    text = modeling.read_text(encoding="utf-8")
    right = "ssm_state_indices=state_index.to(torch.int32),"
    assert text.count(right) == 1
    modeling.write_text(
        text.replace(right, "ssm_state_indices=state_index.flip(0).to(torch.int32),")
    )
    report = _verify(out)
    assert report.error is None
    assert not report.tokens_identical and not report.logits_within


def test_verify_of_a_model_importing_more_of_the_framework_is_refused_in_one_line(
    tmp_path, monkeypatch
):
    """The CPU host answers the executor's cache and metadata modules only; a model that
    imports its config package (as the real qwen3_5 does) needs a checkout, and without one
    it is refused, not a crash (test_framework_legacy_qwen3_5.py runs the real one)."""
    import shutil

    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    monkeypatch.delenv("KVSKILL_CANN_RECIPES", raising=False)

    model = tmp_path / "model"
    shutil.copytree(FIXTURE, model)
    modeling = model / MODELING
    text = modeling.read_text(encoding="utf-8")
    anchor = "from executor.utils.forward_metadata import ForwardMetaData\n"
    modeling.write_text(text.replace(anchor, anchor + "from executor.core.config import X\n"))
    out = _apply_model_dir(model, tmp_path / "out")
    with pytest.raises(UnsupportedModelError, match=r"imports 'executor\.core\.config',.* KVSKILL"):
        verify_directory(out, VerifyOptions(trust_remote_code=True, max_new_tokens=2))


def _apply_model_dir(model: Path, out: Path) -> Path:
    from kvskill.implementer.convert import ApplyOptions
    from kvskill.implementer.writer import apply_model

    apply_model(str(model), out, ApplyOptions())
    return out


@pytest.mark.slow
def test_the_converted_legacy_prefill_refuses_a_chunked_prefill_instead_of_dropping_state(
    tmp_path,
):
    """The Legacy prefill starts every request from a fresh state; under a host that splits a
    prompt over steps (kvskill's runtime with chunked prefill on: 37 prompt tokens, a budget
    of 32) the converted code stops with its reason instead of continuing from nothing."""
    import json

    import torch
    from kvskill.runtime.executor_host import executor_infer_config, framework_modules
    from kvskill.runtime.ops.npu_standin import npu_standin
    from kvskill.verify.drivers.engine import EngineDriver
    from kvskill.verify.drivers.legacy_original import import_model
    from kvskill.verify.prompts import make_prompts
    from kvskill.verify.weights import condition_weights

    out = _apply(tmp_path)
    config = json.loads((out / "config.json").read_text())
    code = {"modeling_file": MODELING, "causal_lm_class": "LegacyGatedDeltaForCausalLM"}
    prompts = make_prompts([7, 3, 11, 5, 9, 2], config["vocab_size"], 0)
    with npu_standin(), framework_modules(), torch.no_grad():
        model_cls, model_config, _ = import_model(out, code, config)
        model = model_cls(model_config, executor_infer_config(block_size=4), None).eval()
        condition_weights(model, 0)
        driver = EngineDriver(seed=0, use_hybrid_blocks=False, chunked_prefill=True)
        with pytest.raises(RuntimeError, match="starts every request from a fresh state"):
            driver.run(model, prompts, max_new_tokens=4, block_size=4)


def test_analyze_says_the_states_keep_init_caches_layout():
    from kvskill.analyzer.analyze import analyze_model

    plan = analyze_model(str(FIXTURE))
    assert plan.code["legacy_framework"] is True
    notes = [e.reason for e in plan.evidence if e.decision == "cache_entries.Mamba"]
    assert any("one MambaCacheEntry per state init_cache allocates" in n for n in notes)

"""Mamba-2 mixers: recognised by their scan calls, converted to paged states, token-exact."""

from __future__ import annotations

import functools
import importlib

import libcst as cst
import pytest
from hf_generate import runtime_tokens, transformers_tokens
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.mamba2 import is_mamba2_class, mamba2_facts
from kvskill.implementer.pipeline import convert_source

#: a small pure Mamba-2: two state layers, chunks of 8 so prompts cross chunk boundaries
SMALL_MAMBA2 = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_heads": 8,
    "head_dim": 16,
    "expand": 2,
    "state_size": 16,
    "n_groups": 2,
    "chunk_size": 8,
    "vocab_size": 256,
}
#: a small Bamba: a Mamba-2 layer, then a full-attention layer
SMALL_BAMBA = {
    "num_hidden_layers": 2,
    "attn_layer_indices": [1],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_chunk_size": 8,
    "vocab_size": 256,
}


def _source(model_type: str) -> str:
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    with open(module.__file__, encoding="utf-8") as handle:
        return handle.read()


@functools.cache
def _mixer(model_type: str) -> cst.ClassDef:
    module = cst.parse_module(_source(model_type))
    found = [c for c in module.body if isinstance(c, cst.ClassDef) and is_mamba2_class(c)]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize(
    "model_type", ["mamba2", "bamba", "nemotron_h", "granitemoehybrid", "falcon_h1"]
)
def test_the_mixer_of_each_family_is_found_with_nothing_blocking_it(model_type):
    facts = mamba2_facts(_mixer(model_type))
    assert facts.problems == [] and not facts.converted


def test_falcon_h1_multipliers_and_gate_flag_are_read_from_the_mixer():
    facts = mamba2_facts(_mixer("falcon_h1"))
    assert facts.in_multiplier == "ssm_in_multiplier"
    assert facts.projection_multiplier == "mup_vector"
    assert facts.norm_flag == "mamba_rms_norm"
    # the other families scale nothing and always gate through their norm
    plain = mamba2_facts(_mixer("bamba"))
    assert (plain.in_multiplier, plain.projection_multiplier, plain.norm_flag) == (None,) * 3


def _clamped_by_time_step_min(source: str) -> str:
    """SOURCE (5.x mamba2) with ``dt = torch.clamp(dt, self.time_step_min)`` before both the
    recurrent and the chunk form, as transformers 4.46's mamba2 and 4.55's zamba2 clamp it."""
    for anchor in (
        "dt = dt.transpose(1, 2).expand(-1, -1, self.head_dim)",
        "output_final_state = cache is not None",
    ):
        (line,) = [ln for ln in source.splitlines() if ln.strip() == anchor]
        indent = line[: len(line) - len(line.lstrip())]
        source = source.replace(line, f"{indent}dt = torch.clamp(dt, self.time_step_min)\n{line}")
    return source


def test_a_mixer_clamping_dt_by_time_step_min_alone_keeps_that_bound_in_both_forms():
    from kvskill.analyzer import analyze_model
    from kvskill.implementer.mamba2 import MIN_BOUNDS

    (mixer,) = [
        c
        for c in cst.parse_module(_clamped_by_time_step_min(_source("mamba2"))).body
        if isinstance(c, cst.ClassDef) and is_mamba2_class(c)
    ]
    facts = mamba2_facts(mixer)
    assert facts.problems == []
    assert facts.dt_bounds == MIN_BOUNDS and facts.clamp_decode
    forward = _paged_forward(_converted_class(mixer, analyze_model("mamba2")))
    assert 'dt_limit=(self.time_step_min, float("inf"))' in forward
    assert 'dt = dt.clamp(self.time_step_min, float("inf"))' in forward
    assert "time_step_limit" not in forward
    # the 5.x source clamps in the chunk scan only, to time_step_limit
    plain = mamba2_facts(_mixer("mamba2"))
    assert not plain.clamp_decode and plain.dt_bounds != MIN_BOUNDS


@pytest.mark.parametrize(
    ("recurrence", "refused"),
    [
        # the decay left untransposed, summed over the target chunk (4.46 mamba2, 4.55 zamba2)
        ("(decay_chunk[..., None, None] * states[:, :, None, ...]).sum(dim=2)", True),
        # transposed and summed over the source chunk: the scan itself
        (
            "(decay_chunk.transpose(1, 3)[..., None, None] * states[:, :, None, ...]).sum(dim=1)",
            False,
        ),
    ],
)
def test_a_chunked_scan_summing_its_recurrence_over_the_target_chunk_is_refused(
    recurrence, refused
):
    anchor = "output_final_state = cache is not None"
    (line,) = [ln for ln in _source("mamba2").splitlines() if ln.strip() == anchor]
    indent = line[: len(line) - len(line.lstrip())]
    source = _source("mamba2").replace(line, f"{indent}new_states = {recurrence}\n{line}")
    (mixer,) = [
        c
        for c in cst.parse_module(source).body
        if isinstance(c, cst.ClassDef) and is_mamba2_class(c)
    ]
    problems = mamba2_facts(mixer).problems
    if refused:
        assert len(problems) == 1 and "inter-chunk recurrence over the target chunk" in problems[0]
    else:
        assert problems == []


def _mamba2_converted(source: str) -> str:
    from kvskill.analyzer import analyze_model
    from kvskill.implementer.spec import ConversionSpec

    spec = ConversionSpec.from_plan(analyze_model("mamba2"))
    return convert_source(source, spec, package="transformers.models.mamba2")


def _paged_forward(code: str) -> str:
    return code.split("state_index = md.block_table[self.attn_type]")[1].split("def set_")[0]


def test_a_projection_scaled_per_channel_in_place_is_converted_with_its_scale():
    from kvskill.analyzer import analyze_model

    # the per-channel vector multiplies the projection in the same statement
    source = _source("mamba2").replace(
        "projected_states = self.in_proj(hidden_states)",
        "projected_states = self.in_proj(hidden_states) * self.mup_vector",
    )
    (mixer,) = [
        c
        for c in cst.parse_module(source).body
        if isinstance(c, cst.ClassDef) and is_mamba2_class(c)
    ]
    plan = analyze_model("mamba2")
    forward = _paged_forward(_converted_class(mixer, plan))
    assert "projected_states = projected_states * self.mup_vector" in forward
    plain = _paged_forward(_converted_mixer("mamba2", plan))
    assert (
        "mup_vector" not in plain and "projected_states = self.in_proj(hidden_states)[0]" in plain
    )


@pytest.mark.parametrize(
    "scaled",
    [
        # a vector added to the projection (not a scale)
        "projected_states = self.in_proj(hidden_states) + self.mup_vector",
        # the input scaled inside the call: not the statement before it
        "projected_states = self.in_proj(hidden_states * self.mup_vector)",
    ],
)
def test_a_mixer_using_an_attribute_in_a_shape_the_paged_forward_lacks_is_refused(scaled):
    source = _source("mamba2").replace("projected_states = self.in_proj(hidden_states)", scaled)
    with pytest.raises(UnsupportedModelError, match=r"reads self\.mup_vector"):
        _mamba2_converted(source)


def _converted_class(mixer: cst.ClassDef, plan) -> str:
    """The text of MIXER after the Mamba-2 rewrite under PLAN."""
    from kvskill.implementer.mamba2 import Mamba2Command
    from kvskill.implementer.spec import ConversionSpec
    from libcst.codemod import CodemodContext

    command = Mamba2Command(CodemodContext(), ConversionSpec.from_plan(plan))
    return command.transform_module(cst.Module(body=[mixer])).code


def _converted_mixer(model_type: str, plan) -> str:
    """The text of MODEL_TYPE's Mamba-2 mixer class after the Mamba-2 rewrite under PLAN."""
    return _converted_class(_mixer(model_type), plan)


def _pinned_assign(mixer_text: str) -> str:
    (line,) = [ln.strip() for ln in mixer_text.splitlines() if "self.pinned_cache_dtypes =" in ln]
    return line


@pytest.mark.parametrize(
    ("model_type", "overrides", "pinned"),
    [
        # nemotron_h's config sets mamba_ssm_cache_dtype="float32" (the default of its class)
        ("nemotron_h", {}, "torch.float32"),
        ("mamba2", {"mamba_ssm_cache_dtype": "float32"}, "torch.float32"),
        ("mamba2", {}, None),
    ],
)
def test_the_ssm_state_is_pinned_exactly_when_the_plan_pins_it(model_type, overrides, pinned):
    from kvskill.analyzer import analyze_model

    plan = analyze_model(model_type, config_overrides=overrides)
    mixer = _converted_mixer(model_type, plan)
    ssm_dtype = mixer.split('cache_name="ssm_state"')[1].split("tensor_setter")[0]
    conv_dtype = mixer.split('cache_name="conv_state"')[1].split("tensor_setter")[0]
    # the conv state always follows the layer (get_cache_info gives it the weights' dtype)
    assert "dtype=torch.get_default_dtype()" in conv_dtype
    if pinned:
        assert plan.state_cache["states"][1]["dtype"] == pinned.removeprefix("torch.")
        assert _pinned_assign(mixer) == f'self.pinned_cache_dtypes = {{"ssm_state": {pinned}}}'
        assert 'dtype=self.pinned_cache_dtypes["ssm_state"]' in ssm_dtype
    else:
        assert _pinned_assign(mixer) == "self.pinned_cache_dtypes = {}"
        assert "dtype=torch.get_default_dtype()" in ssm_dtype


def test_the_rewrite_takes_the_pinned_dtype_from_the_plan_and_refuses_an_unknown_one():
    import dataclasses

    from kvskill.analyzer import analyze_model
    from kvskill.implementer.spec import ConversionSpec

    plan = analyze_model("mamba2", config_overrides={"mamba_ssm_cache_dtype": "float32"})
    states = plan.state_cache["states"]
    # a Plan whose state_cache says float16 is converted so, whatever the config says
    half = {**plan.state_cache, "states": [states[0], {**states[1], "dtype": "float16"}]}
    mixer = _converted_mixer("mamba2", dataclasses.replace(plan, state_cache=half))
    assert _pinned_assign(mixer) == 'self.pinned_cache_dtypes = {"ssm_state": torch.float16}'
    odd = {**plan.state_cache, "states": [states[0], {**states[1], "dtype": "float8"}]}
    with pytest.raises(UnsupportedModelError, match="float8"):
        ConversionSpec.from_plan(dataclasses.replace(plan, state_cache=odd))


@pytest.fixture(scope="module")
def small_mamba2(tmp_path_factory):
    from kvskill.implementer.writer import ApplyOptions, apply_model

    out = tmp_path_factory.mktemp("mamba2") / "mamba2"
    apply_model("mamba2", out, ApplyOptions(config_overrides=SMALL_MAMBA2))
    return out


def _llm(directory, **options):
    from kvskill.runtime import LLM

    # exact: the tests compare tokens with transformers' or across batchings, bit for bit
    return LLM(directory, exact=True, random_weights=True, seed=3, block_size=4, **options)


def _prompts() -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (23, 5, 17, 30, 11)]


@pytest.mark.slow
def test_mamba2_verifies_and_serves_a_mixed_batch_from_state_groups_alone(small_mamba2):
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    code = (small_mamba2 / "modeling_mamba2.py").read_text()
    assert "mamba.mamba_chunk_scan_combined(" in code and "gather_ssm_states(" in code
    assert "cache.update_recurrent_state" not in code.split("def set_conv_state")[0][-4000:]
    # token-exact against transformers' generate, both layouts (contiguous, one page pool)
    for layout in ("contiguous", "page_pool"):
        report = verify_directory(small_mamba2, VerifyOptions(kv_layout=layout))
        assert report.error is None, report.error
        assert report.passed, report.failures()
    prompts = _prompts()
    roomy = _llm(small_mamba2, num_blocks=40, max_num_batched_tokens=256)
    assert list(roomy.engine.kv_manager.groups) == ["Mamba"]  # no attention group
    expected = runtime_tokens(roomy, prompts)
    # 3 state blocks (null + 2) admit two requests at a time, and a 6-token budget splits
    # every longer prompt over several prefill steps, each continuing from the saved states
    tight = _llm(small_mamba2, num_blocks=3, max_num_batched_tokens=6)
    assert runtime_tokens(tight, prompts) == expected
    # and both equal transformers' own generate on the same weights
    assert expected == transformers_tokens(small_mamba2, tight.model.state_dict(), prompts)
    assert tight.engine.stats.num_prefill_steps > 2 * roomy.engine.stats.num_prefill_steps


@pytest.mark.slow
def test_a_request_never_reads_the_state_a_block_held_before(small_mamba2):
    prompts = _prompts()
    llm = _llm(small_mamba2, num_blocks=40, max_num_batched_tokens=12)
    expected = runtime_tokens(llm, prompts)
    layers = [m for m in llm.model.modules() if getattr(m, "attn_type", None) == "Mamba"]
    assert len(layers) == 2
    for layer in layers:
        layer.conv_state.fill_(50.0)
        layer.ssm_state.fill_(50.0)
    assert runtime_tokens(llm, prompts) == expected


@pytest.mark.slow
def test_bamba_hybrid_verifies_and_preempted_requests_keep_their_tokens(tmp_path):
    from kvskill.implementer.writer import ApplyOptions, apply_model
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    out = tmp_path / "bamba"
    apply_model("bamba", out, ApplyOptions(config_overrides=SMALL_BAMBA))
    report = verify_directory(out, VerifyOptions())
    assert report.error is None, report.error
    assert report.passed, report.failures()
    prompts = _prompts()
    expected = runtime_tokens(_llm(out, num_blocks=200, max_num_batched_tokens=256), prompts)
    tight = _llm(out, num_blocks=24, max_num_batched_tokens=12)
    assert runtime_tokens(tight, prompts) == expected
    assert tight.engine.stats.num_preemptions > 0


#: a small falcon_h1: attention and a Mamba-2 mixer in each layer, every multiplier the mixer
#: and the layer apply away from 1 so a dropped one changes the tokens
SMALL_FALCON_H1 = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "mamba_d_ssm": 128,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_n_groups": 2,
    "mamba_chunk_size": 8,
    "vocab_size": 256,
    "ssm_multipliers": [0.5, 2.0, 1.5, 0.7, 1.3],
    "ssm_in_multiplier": 1.7,
    "ssm_out_multiplier": 0.8,
    "key_multiplier": 1.2,
    "attention_in_multiplier": 0.9,
}


def test_the_falcon_h1_mixer_is_converted_with_its_scales_and_its_gate_choice():
    from kvskill.analyzer import analyze_model

    mixer = _converted_mixer("falcon_h1", analyze_model("falcon_h1"))
    forward = _paged_forward(mixer)
    scaled_in = "projected_states = self.in_proj(hidden_states * self.ssm_in_multiplier)"
    scaled_out = "projected_states = projected_states * self.mup_vector"
    # the source's order: scale the input, project, scale the projection, then split
    assert forward.index(scaled_in) < forward.index(scaled_out) < forward.index(".split(")
    gate = forward.split("if self.mamba_rms_norm:")[1]
    assert "self.norm(y.reshape(1, num_tokens, -1), gate.unsqueeze(0))" in gate
    assert "torch.nn.functional.silu(gate.unsqueeze(0))" in gate.split("else:")[1]


@pytest.mark.slow
def test_falcon_h1_verifies_with_attention_and_mamba_states_in_every_layer(tmp_path):
    from kvskill.implementer.writer import ApplyOptions, apply_model
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    out = tmp_path / "falcon_h1"
    apply_model("falcon_h1", out, ApplyOptions(config_overrides=SMALL_FALCON_H1))
    report = verify_directory(out, VerifyOptions())
    assert report.error is None, report.error
    assert report.passed, report.failures()
    prompts = _prompts()
    llm = _llm(out, num_blocks=200, max_num_batched_tokens=256)
    assert sorted(llm.engine.kv_manager.groups) == ["FullAttention", "Mamba"]
    kinds = [info.caches[0].attn_type for info in llm.model.get_cache_info().layer_infos]
    assert sorted(kinds) == ["FullAttention"] * 2 + ["Mamba"] * 2
    expected = runtime_tokens(llm, prompts)
    # one page pool for both groups, prompts split over prefill steps: each step continues
    # from the K/V and the states the one before stored
    tight = _llm(out, num_blocks=40, max_num_batched_tokens=6, use_hybrid_blocks=True)
    assert runtime_tokens(tight, prompts) == expected
    assert tight.engine.stats.num_prefill_steps > 2 * llm.engine.stats.num_prefill_steps


@pytest.fixture(scope="module")
def pinned_mamba2(tmp_path_factory):
    """SMALL_MAMBA2 whose config pins the SSM state to float32 (nemotron_h's field)."""
    from kvskill.implementer.writer import ApplyOptions, apply_model

    out = tmp_path_factory.mktemp("pinned") / "mamba2"
    overrides = {**SMALL_MAMBA2, "mamba_ssm_cache_dtype": "float32"}
    apply_model("mamba2", out, ApplyOptions(config_overrides=overrides))
    return out


@pytest.mark.slow
def test_a_bfloat16_run_keeps_each_state_in_the_dtype_the_plan_reports(pinned_mamba2, small_mamba2):
    import torch
    from kvskill.analyzer.plan import Plan

    prompts = _prompts()[:3]
    for directory, ssm_dtype in ((pinned_mamba2, torch.float32), (small_mamba2, torch.bfloat16)):
        plan = Plan.from_json(directory / "kvskill_plan.json")
        reported = {row["cache_name"]: row["dtype"] for row in plan.state_cache["states"]}
        runs = []
        # whole prompts in separate tensors, then prompts split over several prefill steps in
        # one page pool: every later step reads back the states the step before stored
        for use_hybrid_blocks, budget in ((False, 256), (True, 6)):
            llm = _llm(
                directory,
                dtype="bfloat16",
                num_blocks=8,
                max_num_batched_tokens=budget,
                use_hybrid_blocks=use_hybrid_blocks,
            )
            runs.append(runtime_tokens(llm, prompts))
            layers = [m for m in llm.model.modules() if getattr(m, "attn_type", None) == "Mamba"]
            infos = llm.model.get_cache_info().layer_infos
            assert len(layers) == len(infos) == 2
            for layer, info in zip(layers, infos, strict=True):
                allocated = {c.cache_name: getattr(layer, c.cache_name).dtype for c in info.caches}
                assert allocated == {"conv_state": torch.bfloat16, "ssm_state": ssm_dtype}
                # the Plan and the converted model agree on every state's dtype
                assert {k: str(v).removeprefix("torch.") for k, v in allocated.items()} == reported
            # the scan stored float32 values bfloat16 cannot hold into a pinned state
            state = layers[0].ssm_state.float()
            assert state.abs().sum() > 0
            assert torch.equal(state, state.bfloat16().float()) == (ssm_dtype == torch.bfloat16)
        assert llm.engine.stats.num_prefill_steps > len(prompts)
        assert runs[0] == runs[1] and [len(t) for t in runs[0]] == [8] * len(prompts)


@pytest.mark.slow
def test_granitemoehybrid_with_an_attention_layer_verifies(tmp_path):
    # the default config lists only Mamba layers ("linear_attention"), and transformers' own
    # generate cannot run a model without an attention layer: one of each here
    import json

    from kvskill.implementer.writer import ApplyOptions, apply_model
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    out = tmp_path / "granitemoehybrid"
    overrides = {**SMALL_BAMBA, "layer_types": ["mamba", "attention"]}
    del overrides["attn_layer_indices"]
    apply_model("granitemoehybrid", out, ApplyOptions(config_overrides=overrides))
    report = verify_directory(out, VerifyOptions())
    assert report.error is None, report.error
    assert report.passed, report.failures()
    plan = json.loads((out / "kvskill_plan.json").read_text())
    assert [layer["attn_type"] for layer in plan["layers"]] == ["Mamba", "FullAttention"]


def test_a_saved_config_s_special_float_tags_read_as_transformers_reads_them(tmp_path):
    import json

    from kvskill.analyzer.inputs import resolve_model

    # what transformers 5's save_pretrained writes for Mamba-2's unbounded dt limit
    config = {"model_type": "mamba2", **SMALL_MAMBA2}
    config["time_step_limit"] = [0.0, {"__float__": "Infinity"}]
    config["vendor_note"] = {"__float__": "Unknown"}  # not a tag transformers decodes: kept
    (tmp_path / "config.json").write_text(json.dumps(config))
    source = resolve_model(str(tmp_path))
    assert source.config["time_step_limit"] == [0.0, float("inf")]
    assert source.config["vendor_note"] == {"__float__": "Unknown"}


@pytest.mark.slow
def test_a_mamba2_checkpoint_saved_by_save_pretrained_converts_and_verifies(tmp_path):
    import torch
    from kvskill.implementer.writer import ApplyOptions, apply_model
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    Mamba2ForCausalLM(Mamba2Config(**SMALL_MAMBA2)).save_pretrained(tmp_path / "saved")
    saved = (tmp_path / "saved" / "config.json").read_text()
    if "__float__" not in saved:
        pytest.skip("this transformers writes time_step_limit without a special-float tag")
    apply_model(str(tmp_path / "saved"), tmp_path / "out", ApplyOptions())
    report = verify_directory(tmp_path / "out", VerifyOptions())
    assert report.error is None, report.error
    assert report.passed, report.failures()
    assert report.checked.value == "real_weights"

"""Mamba-1 mixers (Jamba, Mamba, Falcon-Mamba): the rewrite, its refusals, and Jamba served
by the runtime under chunked prefill, preemption and block reuse, token-equal to
transformers' own generate."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import libcst as cst
import pytest
from hf_generate import runtime_tokens, transformers_tokens
from kvskill.implementer.mamba_mixer import is_mamba1_class, mamba1_facts
from kvskill.implementer.pipeline import parse

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from small_configs import SMALL_JAMBA  # noqa: E402


def _source(model_type: str) -> str:
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    with open(module.__file__, encoding="utf-8") as handle:
        return handle.read()


def _mixers(model_type: str) -> list[cst.ClassDef]:
    module = parse(_source(model_type))
    return [c for c in module.body if isinstance(c, cst.ClassDef) and is_mamba1_class(c)]


@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba", "jamba"])
def test_the_facts_find_the_statements_the_rewrite_replaces(model_type):
    (mixer,) = _mixers(model_type)
    facts = mamba1_facts(mixer)
    if facts.problems and "three separate statements" in facts.problems[0]:
        pytest.skip("this transformers' mixer reads its cache in another shape")
    assert not facts.problems, facts.problems
    assert facts.read_index < facts.conv_index < facts.scan_index
    assert facts.output == "scan_output" and facts.conv_target == "hidden_states_B_C"
    assert facts.operands["A"] == "A" and facts.operands["z"] == "gate"
    assert facts.shapes == {
        "kernel_expr": "self.conv_kernel_size",
        "dim_expr": "self.intermediate_size",
        "dstate_expr": "self.ssm_state_size",
    }


def test_a_scan_per_head_in_a_loop_is_kept_per_head():
    # Zamba's mixer runs one scan per Mamba head in a for loop, each head on its channels
    (mixer,) = _mixers("zamba")
    facts = mamba1_facts(mixer)
    assert facts.problems == []
    assert (facts.loop_var, facts.heads) == ("head_idx", "self.n_mamba_heads")
    assert facts.operands["hidden_states"] == "hidden_states_B_C[head_idx]"
    assert facts.output == "scan_output"


@pytest.mark.parametrize(
    "loop",
    [
        "for head_idx in range(0, self.n_mamba_heads):",  # not range(heads)
        "for head_idx in self.head_order:",
    ],
)
def test_a_scan_loop_of_another_shape_is_refused(loop):
    source = _source("zamba")
    old = "for head_idx in range(self.n_mamba_heads):"
    # the full-sequence form's loop (the last one) around the scan
    at = source.rindex(old)
    (mixer,) = [
        c
        for c in parse(source[:at] + loop + source[at + len(old) :]).body
        if isinstance(c, cst.ClassDef) and is_mamba1_class(c)
    ]
    problems = mamba1_facts(mixer).problems
    assert len(problems) == 1 and "for head in range(heads)" in problems[0]


def test_an_output_read_under_another_name_is_refused():
    source = _source("jamba")
    old = "contextualized_states = self.out_proj(scan_output.transpose(1, 2).to(dtype))"
    assert source.count(old) == 1
    broken = source.replace(old, old.replace("scan_output", "(scan_output + final_state)"))
    module = parse(broken)
    (mixer,) = [c for c in module.body if isinstance(c, cst.ClassDef) and is_mamba1_class(c)]
    assert "binds ['final_state', 'scan_output']" in mamba1_facts(mixer).problems[0]


#: zamba with its shared attention block called from two hybrid layers, two Mamba heads
SMALL_ZAMBA = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_mamba_heads": 2,
    "mamba_d_state": 16,
    "intermediate_size": 128,
    "vocab_size": 256,
    "num_hidden_layers": 4,
    "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
}


@pytest.fixture(scope="module")
def small_jamba(tmp_path_factory):
    from kvskill.implementer.writer import ApplyOptions, apply_model

    out = tmp_path_factory.mktemp("jamba") / "jamba"
    apply_model("jamba", out, ApplyOptions(config_overrides=SMALL_JAMBA))
    return out


def _llm(directory, **options):
    from kvskill.runtime import LLM

    # exact: the tests compare tokens with transformers' or across batchings, bit for bit
    return LLM(directory, exact=True, random_weights=True, seed=3, block_size=4, **options)


def _prompts() -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (23, 41, 9, 30, 17, 35)]


@pytest.mark.slow
def test_zamba_per_head_scans_and_shared_attention_serve_transformers_tokens(tmp_path):
    from kvskill.implementer.writer import ApplyOptions, apply_model

    out = tmp_path / "zamba"
    apply_model("zamba", out, ApplyOptions(config_overrides=SMALL_ZAMBA))
    code = (out / "modeling_zamba.py").read_text()
    assert code.count("for head_idx in range(self.n_mamba_heads):") == 1
    assert "self.use_call_site(layer_idx)" in code
    prompts = _prompts()
    # a 12-token budget: longer prompts continue from the states their last chunk left
    llm = _llm(out, num_blocks=48, max_num_batched_tokens=12)
    tokens = runtime_tokens(llm, prompts)
    assert tokens == transformers_tokens(out, llm.model.state_dict(), prompts)
    mixers = [m for m in llm.model.modules() if getattr(m, "attn_type", None) == "Mamba"]
    assert len(mixers) == 4  # every layer's mixer, the hybrid ones included


@pytest.mark.slow
def test_jamba_served_with_preemption_equals_transformers_generate(small_jamba):
    prompts = _prompts()
    # A 12-token budget splits every longer prompt over several prefill steps (each chunk
    # continues from the states the one before left); 24 blocks of 4 tokens cannot hold all
    # six requests, so some are preempted and recomputed from their prompt.
    tight = _llm(small_jamba, num_blocks=24, max_num_batched_tokens=12)
    tokens = runtime_tokens(tight, prompts)
    assert tight.engine.stats.num_preemptions > 0
    expected = transformers_tokens(small_jamba, tight.model.state_dict(), prompts)
    assert tokens == expected
    # Every state block now belongs to no request; fill them with garbage a new request would
    # carry into every token if it started from its block instead of from zeros.
    layers = [m for m in tight.model.modules() if getattr(m, "attn_type", None) == "Mamba"]
    assert len(layers) == 2
    for layer in layers:
        layer.conv_state.fill_(50.0)
        layer.ssm_state.fill_(50.0)
    assert runtime_tokens(tight, prompts) == expected
    # and on the one page-aligned pool shared by the attention and Mamba groups
    pooled = _llm(small_jamba, num_blocks=200, max_num_batched_tokens=12, use_hybrid_blocks=True)
    assert runtime_tokens(pooled, prompts) == expected


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_type", "overrides", "expected"),
    [
        # every layer a Mamba-1 mixer: served by the Mamba group alone
        ("mamba", {}, "fla.selective_scan_fn("),
        # LFM2: short convs around an attention layer (the library default is all attention)
        (
            "lfm2",
            {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"]},
            "torch_npu.npu_fused_causal_conv1d(",
        ),
    ],
)
def test_state_models_verify_token_exact(tmp_path, model_type, overrides, expected):
    from kvskill.implementer.writer import ApplyOptions, apply_model
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    out = tmp_path / model_type
    apply_model(model_type, out, ApplyOptions(config_overrides=overrides))
    code = (out / f"modeling_{model_type}.py").read_text()
    assert expected in code and "cache.get_conv_state" not in code
    report = verify_directory(out, VerifyOptions())
    assert report.error is None, report.error
    assert report.passed, report.failures()
    if model_type == "mamba":
        # NOTE: the analyzer reads a converted all-state directory as a mixer beside
        # attention in every layer and refuses it; re-applying is checked on lfm2
        return
    # converting the converted file changes nothing
    again = tmp_path / "again"
    apply_model(str(out), again, ApplyOptions())
    assert (again / f"modeling_{model_type}.py").read_text() == code


def test_a_mamba1_ssm_state_is_pinned_when_the_config_pins_it():
    from kvskill.analyzer import analyze_model
    from kvskill.implementer.mamba_mixer import Mamba1MixerCommand
    from kvskill.implementer.spec import ConversionSpec
    from libcst.codemod import CodemodContext

    (mixer,) = _mixers("mamba")
    if mamba1_facts(mixer).problems:
        pytest.skip("this transformers' mixer is refused")
    for overrides, pinned in (({}, "{}"), ({"mamba_ssm_cache_dtype": "float32"}, "torch.float32")):
        spec = ConversionSpec.from_plan(analyze_model("mamba", config_overrides=overrides))
        code = Mamba1MixerCommand(CodemodContext(), spec).transform_module(cst.Module([mixer])).code
        (line,) = [ln.strip() for ln in code.splitlines() if "self.pinned_cache_dtypes =" in ln]
        want = pinned if pinned == "{}" else f'{{"ssm_state": {pinned}}}'
        assert line == f"self.pinned_cache_dtypes = {want}"


@pytest.mark.slow
def test_no_state_or_attention_row_is_read_before_it_is_written(small_jamba):
    from kvskill.runtime import SamplingParams
    from unwritten_rows import clean_and_poisoned_tokens

    # NaN in every block but the null block of the conv, SSM and attention pools
    clean, poisoned = clean_and_poisoned_tokens(
        lambda: _llm(small_jamba, num_blocks=200),
        _prompts(),
        SamplingParams(max_tokens=6, ignore_eos=True),
    )
    assert poisoned == clean


@pytest.mark.slow
def test_run_sizes_a_jambas_pools_for_three_short_prompts(small_jamba, capsys):
    import json

    from kvskill.cli import main

    # the config allows 262,144 positions; three prompts of at most 5 tokens + 8 new ones
    # need one attention block and one state row each
    with pytest.raises(SystemExit) as exc:
        main(
            ["run", str(small_jamba), "--random-weights", "--prompt-ids", "1,2,3,4,5;6,7,8;9,10"]
            + ["--max-tokens", "8", "--exact", "--format", "json"]
        )
    out = capsys.readouterr().out
    assert exc.value.code == 0, out
    report = json.loads(out)
    assert {k: v["blocks_total"] for k, v in report["kv_cache"].items()} == {
        "Mamba": 3,
        "FullAttention": 3,
    }
    budget = report["kv_budget"]
    assert budget["reason"].startswith("default: 3 requests x 13 tokens (1 block(s) of 128 each)")
    assert "the longest 5 tokens + --max-tokens 8 = max_model_len 13" in budget["workload"]

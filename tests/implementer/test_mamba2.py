"""Mamba-2 mixers: recognised by their scan calls, converted to paged states, token-exact."""

from __future__ import annotations

import importlib

import libcst as cst
import pytest
from hf_generate import transformers_tokens
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


def _mixer(model_type: str) -> cst.ClassDef:
    module = cst.parse_module(_source(model_type))
    found = [c for c in module.body if isinstance(c, cst.ClassDef) and is_mamba2_class(c)]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize("model_type", ["mamba2", "bamba", "nemotron_h", "granitemoehybrid"])
def test_the_mixer_of_each_family_is_found_with_nothing_blocking_it(model_type):
    facts = mamba2_facts(_mixer(model_type))
    assert facts.problems == [] and not facts.converted


def test_a_mixer_reading_an_attribute_the_paged_forward_ignores_is_refused():
    # falcon_h1-like: the projections scaled by a per-channel vector the paged body would drop
    source = _source("mamba2").replace(
        "projected_states = self.in_proj(hidden_states)",
        "projected_states = self.in_proj(hidden_states) * self.mup_vector",
    )
    from kvskill.analyzer import analyze_model
    from kvskill.implementer.spec import ConversionSpec

    spec = ConversionSpec.from_plan(analyze_model("mamba2"))
    with pytest.raises(UnsupportedModelError, match=r"reads self\.mup_vector"):
        convert_source(source, spec, package="transformers.models.mamba2")


@pytest.fixture(scope="module")
def small_mamba2(tmp_path_factory):
    from kvskill.implementer.writer import ApplyOptions, apply_model

    out = tmp_path_factory.mktemp("mamba2") / "mamba2"
    apply_model("mamba2", out, ApplyOptions(config_overrides=SMALL_MAMBA2))
    return out


def _llm(directory, **options):
    from kvskill.runtime import LLM

    return LLM(directory, random_weights=True, seed=3, block_size=4, **options)


def _tokens(llm, prompts) -> list[list[int]]:
    from kvskill.runtime import SamplingParams

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, params)]


def _prompts() -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (23, 5, 17, 30, 11)]


@pytest.mark.slow
def test_mamba2_verifies_and_serves_a_mixed_batch_from_state_groups_alone(small_mamba2):
    from kvskill.implementer.verify import VerifyOptions, verify_directory

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
    expected = _tokens(roomy, prompts)
    # 3 state blocks (null + 2) admit two requests at a time, and a 6-token budget splits
    # every longer prompt over several prefill steps, each continuing from the saved states
    tight = _llm(small_mamba2, num_blocks=3, max_num_batched_tokens=6)
    assert _tokens(tight, prompts) == expected
    # and both equal transformers' own generate on the same weights
    assert expected == transformers_tokens(small_mamba2, tight.model.state_dict(), prompts)
    assert tight.engine.stats.num_prefill_steps > 2 * roomy.engine.stats.num_prefill_steps


@pytest.mark.slow
def test_a_request_never_reads_the_state_a_block_held_before(small_mamba2):
    prompts = _prompts()
    llm = _llm(small_mamba2, num_blocks=40, max_num_batched_tokens=12)
    expected = _tokens(llm, prompts)
    layers = [m for m in llm.model.modules() if getattr(m, "attn_type", None) == "Mamba"]
    assert len(layers) == 2
    for layer in layers:
        layer.conv_state.fill_(50.0)
        layer.ssm_state.fill_(50.0)
    assert _tokens(llm, prompts) == expected


@pytest.mark.slow
def test_bamba_hybrid_verifies_and_preempted_requests_keep_their_tokens(tmp_path):
    from kvskill.implementer.verify import VerifyOptions, verify_directory
    from kvskill.implementer.writer import ApplyOptions, apply_model

    out = tmp_path / "bamba"
    apply_model("bamba", out, ApplyOptions(config_overrides=SMALL_BAMBA))
    report = verify_directory(out, VerifyOptions())
    assert report.error is None, report.error
    assert report.passed, report.failures()
    prompts = _prompts()
    expected = _tokens(_llm(out, num_blocks=200, max_num_batched_tokens=256), prompts)
    tight = _llm(out, num_blocks=24, max_num_batched_tokens=12)
    assert _tokens(tight, prompts) == expected
    assert tight.engine.stats.num_preemptions > 0

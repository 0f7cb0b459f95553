"""Gated delta net layers (Qwen3-Next, Qwen3.5): the rewrite, its refusals, and the paged
states under chunked prefill, preemption and block reuse."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from kvskill.analyzer import analyze_model
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.gated_delta import gated_delta_facts, is_gated_delta_class
from kvskill.implementer.pipeline import convert_source, parse
from kvskill.implementer.spec import ConversionSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from small_configs import SMALL_QWEN3_NEXT  # noqa: E402


def _transformers_source(model_type: str) -> str:
    import importlib

    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    with open(module.__file__, encoding="utf-8") as handle:
        return handle.read()


def _spec(model_type: str) -> ConversionSpec:
    return ConversionSpec.from_plan(analyze_model(model_type))


def test_the_facts_find_the_four_statements_the_rewrite_replaces():
    module = parse(_transformers_source("qwen3_next"))
    (cls,) = [c for c in module.body if getattr(c, "name", None) and is_gated_delta_class(c)]
    facts = gated_delta_facts(cls)
    assert facts.problems == []
    assert facts.read_index < facts.conv_index < facts.rule_index < facts.write_index
    assert (facts.conv_source, facts.conv_target) == ("mixed_qkv", "mixed_qkv")
    assert facts.conv_weight == "self.conv1d.weight.squeeze(1)"
    assert facts.activation == "self.activation"
    assert (facts.query, facts.key, facts.value) == ("query", "key", "value")
    assert (facts.g, facts.beta, facts.l2norm) == ("g", "beta", "True")
    assert facts.rule_targets == ["core_attn_out", "last_recurrent_state"]


def test_the_converted_layer_keeps_its_states_in_the_mamba_group(converted):
    code = (converted.directory("qwen3_next") / "modeling_qwen3_next.py").read_text()
    layer = code[code.index("class Qwen3NextGatedDeltaNet") : code.index("class Qwen3NextMLP")]
    assert 'self.attn_type = "Mamba"' in layer
    assert 'self.pinned_cache_dtypes = {"ssm_state": torch.float32}' in layer
    assert "shape=[self.conv_kernel_size - 1, self.conv_dim]" in layer
    assert "shape=[self.num_v_heads, self.head_k_dim, self.head_v_dim]" in layer
    # transformers' cache is gone from the forward; both paths of both operators remain
    assert "cache.get_conv_state" not in layer and "update_recurrent_state" not in layer
    for op in (
        "fla.causal_conv1d_fn(",
        "fla.causal_conv1d_update(",
        "fla.chunk_gated_delta_rule(",
        "fla.fused_recurrent_gated_delta_rule(",
    ):
        assert op in layer
    assert "ssm_state_indices=decode_state_index" in layer
    # the attention layers of the hybrid model are full attention, not a Mamba conditional
    attention = code[code.index("class Qwen3NextAttention") : code.index("class Qwen3NextGated")]
    assert 'self.attn_type = "FullAttention"' in attention
    assert "from kvskill.runtime.ops import fla, torch_npu" in code
    assert re.search(r"from kvskill\.runtime import .*MambaCacheEntry", code)


def test_a_forward_of_another_shape_is_refused_with_the_reason():
    # both paths bind the rule's result to one name instead of (output, state)
    source = _transformers_source("qwen3_next").replace(
        "core_attn_out, last_recurrent_state = torch_", "outputs = torch_"
    )
    assert source.count("outputs = torch_") == 2
    with pytest.raises(UnsupportedModelError, match=r"rule to \(output, state\)"):
        convert_source(source, _spec("qwen3_next"), package="transformers.models.qwen3_next")


_CONV_FN = """            mixed_qkv = causal_conv1d_fn(
                mixed_qkv,"""
_CHUNK = """            core_attn_out, last_recurrent_state = torch_chunk_gated_delta_rule(
                query,"""


@pytest.mark.parametrize(
    ("old", "new", "reason"),
    [
        # a statement inside a replaced branch would be lost
        (
            _CHUNK,
            "            beta = beta * 2.0\n" + _CHUNK,
            "delta rule statement also does `beta = beta \\* 2.0`",
        ),
        # the two rule calls must agree on what the rewrite passes on
        (
            _CHUNK,
            _CHUNK.replace("query,", "query * 0.5,"),
            "prefill and decode rule calls differ",
        ),
        # the emitted code indexes the conv input: an expression is not read
        (
            _CONV_FN,
            _CONV_FN.replace("mixed_qkv,", "mixed_qkv * 2,"),
            "conv input 'mixed_qkv \\* 2' is not a name",
        ),
        # the rewrite binds `md` in the forward; a model's own `md` would be overwritten
        (
            "        beta = b.sigmoid()",
            "        md = 1\n        beta = b.sigmoid() * md",
            r"uses \['md'\], names the rewrite binds",
        ),
    ],
    ids=["extra-statement", "operands-differ", "conv-input-expression", "local-clash"],
)
def test_a_delta_layer_the_rewrite_would_change_is_refused(old, new, reason):
    source = _transformers_source("qwen3_next")
    assert source.count(old) == 1
    with pytest.raises(UnsupportedModelError, match=reason):
        convert_source(
            source.replace(old, new), _spec("qwen3_next"), package="transformers.models.qwen3_next"
        )


def test_mamba_layers_without_a_gated_delta_class_are_refused():
    # the Plan says Mamba layers; the code (Qwen3's) has none
    with pytest.raises(UnsupportedModelError, match="no state mixer the tool converts was found"):
        convert_source(
            _transformers_source("qwen3"), _spec("qwen3_next"), package="transformers.models.qwen3"
        )


def test_a_model_of_state_layers_only_has_no_attention_type():
    # served by its state group alone: no attention rewrite has anything to map
    spec = ConversionSpec.from_plan(analyze_model("mamba2"))
    assert not spec.has_attention_layers and spec.has_state_layers


def test_states_of_mamba_models_are_not_split_over_ranks_yet():
    plan = analyze_model("qwen3_next", attn_tp_size=2)
    with pytest.raises(UnsupportedModelError, match="attn_tp_size 2 with recurrent-state"):
        ConversionSpec.from_plan(plan)


@pytest.mark.parametrize("model_type", ["qwen3_next", "kimi_linear"])  # GQA and MLA paths
def test_standalone_mode_refuses_state_layers(tmp_path, model_type):
    from kvskill.cli import main

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["apply", model_type, "--mode", "standalone", "--out", str(out)])
    assert exit_info.value.code == 3  # unsupported model, nothing written
    assert not out.exists()


@pytest.fixture(scope="module")
def small_qwen3_next(tmp_path_factory):
    from kvskill.implementer.writer import ApplyOptions, apply_model

    out = tmp_path_factory.mktemp("gdn") / "qwen3_next"
    apply_model("qwen3_next", out, ApplyOptions(config_overrides=SMALL_QWEN3_NEXT))
    return out


def _llm(directory, **options):
    from kvskill.runtime import LLM

    # exact: the tests compare tokens with transformers' or across batchings, bit for bit
    return LLM(directory, exact=True, random_weights=True, seed=3, block_size=4, **options)


def _tokens(llm, prompts) -> list[list[int]]:
    from kvskill.runtime import SamplingParams

    params = SamplingParams(max_tokens=10, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, params)]


def _prompts() -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (23, 41, 9, 30, 17, 35)]


def test_split_prompts_and_preempted_requests_give_the_tokens_of_a_roomy_run(small_qwen3_next):
    prompts = _prompts()
    roomy = _llm(small_qwen3_next, num_blocks=200, max_num_batched_tokens=512)
    expected = _tokens(roomy, prompts)
    assert roomy.engine.stats.num_preemptions == 0
    # A 12-token budget splits every longer prompt over several prefill steps (each later
    # chunk continues from the states the earlier one left); 30 blocks cannot hold all six
    # requests, so some are preempted and recomputed from their prompt.
    tight = _llm(small_qwen3_next, num_blocks=30, max_num_batched_tokens=12)
    assert _tokens(tight, prompts) == expected
    stats = tight.engine.stats
    assert stats.num_preemptions > 0
    assert stats.num_prefill_steps > 2 * roomy.engine.stats.num_prefill_steps
    # and on the one page-aligned pool shared by the attention and Mamba groups
    pooled = _llm(
        small_qwen3_next, num_blocks=200, max_num_batched_tokens=12, use_hybrid_blocks=True
    )
    assert _tokens(pooled, prompts) == expected


def test_a_request_never_reads_the_state_a_block_held_before(small_qwen3_next):
    prompts = _prompts()
    llm = _llm(small_qwen3_next, num_blocks=200, max_num_batched_tokens=12)
    expected = _tokens(llm, prompts)
    # Every state block now belongs to no request; fill them with garbage a new request
    # would carry into every token if it started from its block instead of from zeros.
    layers = [m for m in llm.model.modules() if getattr(m, "attn_type", None) == "Mamba"]
    assert len(layers) == 3
    for layer in layers:
        layer.conv_state.fill_(50.0)
        layer.ssm_state.fill_(50.0)
    assert _tokens(llm, prompts) == expected


@pytest.mark.parametrize(
    ("model_type", "expected", "reapply"),
    [
        # Qwen3.5: separate q/k/v, z, b and a projections before the same conv and rule
        ("qwen3_5", "fla.chunk_gated_delta_rule(", False),
        # OLMo-hybrid passes weight=, bias= and activation= to causal_conv1d_fn by keyword
        # and guards its state read with a local `use_cache`.
        ("olmo_hybrid", "fla.chunk_gated_delta_rule(", False),
        # Kimi Linear: Kimi delta attention (a decay per key channel) between MLA layers;
        # its converted rule is fla's chunk_kda, which a re-apply must still recognise.
        ("kimi_linear", "fla.chunk_kda(", True),
    ],
)
def test_other_delta_layers_convert_token_exact(tmp_path, model_type, expected, reapply):
    from kvskill.implementer.writer import ApplyOptions, apply_model
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    out = tmp_path / model_type
    apply_model(model_type, out, ApplyOptions())
    code = (out / f"modeling_{model_type}.py").read_text()
    assert expected in code and "self.conv_state.transpose(-1, -2)" in code
    assert "cache.update_recurrent_state" not in code
    report = verify_directory(out, VerifyOptions())
    assert report.error is None, report.error
    assert report.passed, report.failures()
    if not reapply:
        return
    # converting the converted file changes nothing (its rule is then fla's, not the source's)
    again = tmp_path / "again"
    apply_model(str(out), again, ApplyOptions())
    assert (again / f"modeling_{model_type}.py").read_text() == code


def test_prefix_caching_is_off_for_state_layers_with_the_reason_in_the_run_report(
    small_qwen3_next, capsys
):
    # A gated delta layer's state is a snapshot of the whole prefix, overwritten in place:
    # no block of it can be shared, so the model runs without prefix caching, and says why.
    llm = _llm(small_qwen3_next, num_blocks=200, max_num_batched_tokens=12)
    assert not llm.prefix_caching
    assert "Mamba" in llm.prefix_caching_disabled_reason
    shared = [list(range(1, 30)) + [40 + i] for i in range(3)]
    first = _tokens(llm, shared)
    assert _tokens(llm, shared) == first
    assert llm.stats.num_prefix_hit_tokens == 0 and llm.stats.num_cached_blocks == 0
    from kvskill.cli import main

    with pytest.raises(SystemExit) as exc:
        main(
            ["run", str(small_qwen3_next), "--random-weights", "--prompt-ids", "1,2,3,4,5,6",
             "--max-tokens", "2", "--num-blocks", "40", "--block-size", "4"]
        )  # fmt: skip
    out = capsys.readouterr().out
    assert exc.value.code == 0, out
    assert "prefix cache" in out and "off: group 'Mamba'" in out
    assert "snapshot of the whole prefix" in out
    # the state entry points say which backend ran them (the reference here: no NPU)
    assert "state ops" in out and "causal_conv1d_fn -> reference (the operator backend" in out


def test_no_state_or_attention_row_is_read_before_it_is_written(small_qwen3_next):
    from kvskill.runtime import SamplingParams
    from unwritten_rows import clean_and_poisoned_tokens

    # NaN in every block but the null block of the one page pool the gated delta states and
    # the attention share: a first step reading its state row before writing it would carry
    # the NaN into every token
    clean, poisoned = clean_and_poisoned_tokens(
        lambda: _llm(small_qwen3_next, num_blocks=64, use_hybrid_blocks=True),
        _prompts()[:3],
        SamplingParams(max_tokens=4, ignore_eos=True),
    )
    assert poisoned == clean

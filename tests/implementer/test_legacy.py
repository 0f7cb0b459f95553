"""Framework Legacy output: static-row caches around the model's own attention call.

gemma2 (logit soft-capping, sliding layers), llama4_text (chunked layers), mpt (ALiBi added
to hand-written scores) and bloom (scores from an ALiBi tensor, the batch folded into the
heads) are families the analyzer sends to Legacy; they verify token-exact, and a gemma2 served from a
pool of two rows (requests wait for a row; prompts split over prefill steps) gives the tokens
of transformers' own greedy forward.
"""

from __future__ import annotations

import pytest
import torch
from hf_generate import transformers_tokens_uncached
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.writer import ApplyOptions, apply_model, convert_model

SMALL = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
}
SMALL_MPT = {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 256}
SMALL_BLOOM = {"n_layer": 2, "hidden_size": 64, "n_head": 4, "vocab_size": 256}
#: gemma2 with a window shorter than the prompts: one sliding layer, one full layer
SMALL_GEMMA2 = {**SMALL, "sliding_window": 6, "max_position_embeddings": 64}


@pytest.mark.slow
def test_gemma2_keeps_its_own_soft_capped_attention_call():
    code = convert_model("gemma2", ApplyOptions(config_overrides=SMALL_GEMMA2)).converted
    assert code.count('self.attn_type = "Legacy"') == 1
    seam = code[code.index("legacy_attention_inputs(") :]
    # the source's kernel call survives with its soft-capping, after the rows are read
    assert "softcap=self.attn_logit_softcapping" in seam
    assert "attn_output = packed_output(attn_output, md)" in seam
    assert "cache.update(" not in seam.split("def set_k_cache")[0]
    assert "npu_fused_infer_attention_score" not in code


@pytest.mark.slow
def test_an_explicit_legacy_request_converts_a_paged_model():
    code = convert_model("qwen3", ApplyOptions(kv_mode="legacy", config_overrides=SMALL)).converted
    assert 'self.attn_type = "Legacy"' in code and "self.legacy_window = None" in code


def test_scores_from_a_bias_block_the_fused_operator_but_not_legacy():
    import inspect

    import libcst as cst
    from kvskill.implementer.facts import KernelStyle, attention_facts, module_classes
    from transformers.models.bloom import modeling_bloom

    classes = module_classes(cst.parse_module(inspect.getsource(modeling_bloom)))
    facts = attention_facts(classes["BloomAttention"], classes)
    assert facts.seam is not None and facts.problems == []
    assert (facts.seam.style, facts.seam.bias) == (KernelStyle.BIAS_BMM, "alibi")
    # what only the fused operator cannot do: start from ALiBi, read attention_probs after
    assert any("starts its attention scores from alibi" in p for p in facts.fused_limits)


def test_folded_batch_alibi_is_rebuilt_for_the_padded_batch():
    code = convert_model("bloom", ApplyOptions(config_overrides=SMALL_BLOOM)).converted
    seam = code[code.index("legacy_attention_inputs(") : code.index("def set_k_cache")]
    rebuilt = seam.index("alibi = build_alibi_tensor(")
    assert seam.index("batch_size, q_length = query_layer.shape[0], query_layer.shape[2]") < rebuilt
    assert rebuilt < seam.index("attention_scores = alibi.baddbmm(")
    packed = seam.index("context_layer = packed_output(context_layer.unflatten(0, (-1, self.num_")
    assert packed < seam.index("batch_size, q_length = legacy_packed_dims")
    assert packed < seam.index("context_layer = self._merge_heads(context_layer)")


def test_hand_written_alibi_attention_keeps_its_bias_and_boolean_mask():
    # mpt: matmul scores + position_bias (ALiBi), masked_fill with a boolean mask
    code = convert_model("mpt", ApplyOptions(config_overrides=SMALL_MPT)).converted
    seam = code[code.index("legacy_attention_inputs(") : code.index("def set_k_cache")]
    assert "attention_mask = attention_mask != 0" in seam
    assert "attention_scores = attention_scores + position_bias" in seam
    packed = "context_states = packed_output(context_states.transpose(1, 2), md).transpose(1, 2)"
    assert seam.index(packed) < seam.index("context_states.permute(0, 2, 1, 3)")
    # the model's mask builder and its .to(torch.bool) are skipped together in the runtime
    assert "(None if _in_paged_runtime() else create_causal_mask(" in code


@pytest.fixture(scope="module")
def small_gemma2(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma2") / "gemma2"
    apply_model("gemma2", out, ApplyOptions(config_overrides=SMALL_GEMMA2))
    return out


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (23, 5, 17, 30, 11)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_type", "mode"),
    # llama4_text's chunks in standalone mode only: its framework twin takes 15 s and runs
    # the same legacy_attention_inputs as gemma2's
    [
        ("gemma2", "framework"),
        ("gemma2", "standalone"),
        ("llama4_text", "standalone"),
        ("mpt", "framework"),  # ALiBi in hand-written scores
        ("bloom", "standalone"),  # ALiBi as baddbmm's bias, the batch folded into heads
    ],
)
def test_legacy_families_verify_token_exact(tmp_path, model_type, mode):
    from kvskill.implementer.record import ConvertedDir
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    out = tmp_path / model_type
    apply_model(model_type, out, ApplyOptions(deploy_mode=mode))
    if mode == "standalone":  # mode 1, its runner's rows read by the model's own attention
        record = ConvertedDir.read(out).record.standalone
        assert (record.mode, record.kv_mode) == (1, "legacy")
    report = verify_directory(out, VerifyOptions())
    assert report.error is None, report.error
    assert report.passed, report.failures()


def test_a_legacy_model_is_not_written_as_paged_in_standalone_mode():
    with pytest.raises(UnsupportedModelError, match="--kv-mode paged: Legacy KV"):
        convert_model(
            "gemma2",
            ApplyOptions(deploy_mode="standalone", kv_mode="paged", config_overrides=SMALL),
        )


@pytest.mark.slow
def test_two_rows_serve_five_requests_with_transformers_tokens(small_gemma2):
    from kvskill.runtime import LLM, SamplingParams

    prompts = _prompts()
    # three blocks: the null block and two rows of max_position_embeddings (64) tokens; a
    # budget of 8 tokens per step splits every longer prompt over several prefill steps
    llm = LLM(
        small_gemma2,
        exact=True,  # compared with transformers' tokens
        random_weights=True,
        seed=3,
        num_blocks=3,
        max_num_batched_tokens=8,
        cpu_only_shapes=True,
    )
    assert list(llm.engine.kv_manager.groups) == ["Legacy"]
    group = llm.engine.kv_manager.groups["Legacy"]
    assert group.block_size == 64
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    tokens = [list(o.token_ids) for o in llm.generate(prompts, params)]
    assert llm.engine.stats.num_prefill_steps > len(prompts)
    # NOTE: the reference is transformers' forward without a cache: its cached generate with
    # a window (6) shorter than the prompt parts from its own uncached forward at the third
    # token of prompt 0 (measured), and the runtime matches the uncached forward
    want = transformers_tokens_uncached(small_gemma2, llm.model.state_dict(), prompts)
    assert tokens == want

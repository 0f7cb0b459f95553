"""One vocabulary for the three code readers: the analyzer's scan, the implementer and lint
decide what a cache write, a fused-attention call and an attention class are in one place."""

from __future__ import annotations

import importlib
from pathlib import Path

import libcst as cst
import pytest
from kvskill.analyzer import gather
from kvskill.analyzer.gather import CallKind, classify_call
from kvskill.analyzer.lint import fa as lint_fa
from kvskill.analyzer.roles import find_roles
from kvskill.analyzer.scan import scan_source
from kvskill.implementer import facts as implementer_facts


def _call(code: str) -> cst.Call:
    return cst.ensure_type(cst.parse_expression(code), cst.Call)


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        ("past_key_values.update(k, v, self.layer_idx)", CallKind.CACHE_UPDATE),
        ("cache.update(k, v, self.layer_idx, {'cos': cos})", CallKind.CACHE_UPDATE),
        ("layer_past.update(k, v, 0)", CallKind.CACHE_UPDATE),
        ("curr_cache.update(k, v, self.layer_idx)", CallKind.CACHE_UPDATE),
        ("torch_npu.npu_fused_infer_attention_score(q, k, v)", CallKind.FA_CALL),
        ("ops.npu_fused_infer_attention_score_v2(q, k, v)", CallKind.FA_CALL),
        ("torch_npu.npu_scatter_nd_update_(cache, slots, k)", CallKind.CACHE_WRITE),
        ("torch_npu.scatter_update_(cache, kv_len, k, -2)", CallKind.CACHE_WRITE),
        ("F.scaled_dot_product_attention(q, k, v)", CallKind.ATTENTION_CALL),
        ("attention_interface(self, q, k, v, mask)", CallKind.ATTENTION_CALL),
        ("self.chunk_gated_delta_rule(q, k, v, g=g, beta=beta)", CallKind.STATE_CALL),
        ("causal_conv1d_update(x, state, w)", CallKind.STATE_CALL),
    ],
)
def test_calls_are_classified_by_what_they_do(code, kind):
    found = classify_call(_call(code))
    assert found is not None and found[0] is kind


@pytest.mark.parametrize(
    "code",
    [
        "kwargs.update(a, b, c)",  # dict.update on a keyword dict
        "self.config.update(a, b, c)",
        "past_key_values.update(k)",  # one argument: not Cache.update(key, value, idx)
        "torch.matmul(q, k)",
        "make_layer()(x)",
    ],
)
def test_other_calls_are_not_cache_calls(code):
    assert classify_call(_call(code)) is None


def test_the_implementer_and_lint_read_with_the_same_rules():
    assert implementer_facts.is_attention_class is gather.is_attention_class
    assert implementer_facts.is_causal_lm_class is gather.is_causal_lm_class
    assert implementer_facts.FA_CALL is gather.FA_CALL
    assert tuple(lint_fa.FA_OPS) == gather.FA_OPS


def _transformers_source(model_type: str) -> str:
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return Path(module.__file__).read_text(encoding="utf-8")


@pytest.mark.parametrize(
    "model_type",
    ["llama", "qwen3", "mistral", "mixtral", "gpt_oss", "qwen3_moe", "qwen3_next", "gemma3"],
)
def test_analyze_and_apply_find_the_same_attention_classes(model_type):
    source = _transformers_source(model_type)
    analyzed = find_roles(scan_source(source, path=f"modeling_{model_type}.py")).attention
    module = cst.parse_module(source)
    rewritten = [
        c.name.value
        for c in module.body
        if isinstance(c, cst.ClassDef) and gather.is_attention_class(c)
    ]
    assert analyzed and sorted(analyzed) == sorted(rewritten)


# already converted: caches declared, written with a cache-write operator, read with the FA ---

_DECLARE = """\
    def __init__(self, config):
        super().__init__()
        self.k_cache = torch.Tensor([])
        self.cache_entries = [CacheEntry(cache_name="k_cache", attn_type="FullAttention",
                                         dim=64, num_head=1, dtype=None, tensor_setter=None)]
"""
_HELPER = """\
    def update_cache(self, slots, key):
        torch_npu.npu_scatter_nd_update_(self.k_cache, slots, key)
"""
_FORWARD = """\
    def forward(self, q, k, v, cache=None):
{body}
"""
_WRITE = "        self.update_cache(slots, k)\n"
_DIRECT_WRITE = (
    "        torch_npu.npu_kv_rmsnorm_rope_cache(kv, w, cos, sin, slots, self.k_cache)\n"
)
_READ = "        out = torch_npu.npu_fused_infer_attention_score(q, self.k_cache, self.k_cache)\n"
_SOURCE_ATTENTION = (
    "        k, v = cache.update(k, v, self.layer_idx)\n"
    "        out = F.scaled_dot_product_attention(q, k, v)\n"
)
_NPU_BRANCH = (
    "        if self.use_npu:\n"
    "            out = torch_npu.npu_fused_infer_attention_score(q, k, v)[0]\n"
    "        else:\n"
    "            k, v = cache.update(k, v, self.layer_idx)\n"
    "            out = F.scaled_dot_product_attention(q, k, v)\n"
)


def _class(*parts: str, body: str = "") -> cst.ClassDef:
    code = "class A(nn.Module):\n" + "\n".join([*parts, _FORWARD.format(body=body.rstrip("\n"))])
    return cst.ensure_type(cst.parse_statement(code), cst.ClassDef)


@pytest.mark.parametrize(
    ("cls", "converted"),
    [
        (_class(_DECLARE, _HELPER, body=_WRITE + _READ), True),
        (_class(_DECLARE, body=_DIRECT_WRITE + _READ), True),
        # entries declared, forward as written: the half conversion of issue 27
        (_class(_DECLARE, body=_NPU_BRANCH), False),
        (_class(_DECLARE, _HELPER, body=_SOURCE_ATTENTION), False),
        # written, never read with the fused attention
        (_class(_DECLARE, _HELPER, body=_WRITE), False),
        # the fused attention alone (an NPU branch over a dense cache)
        (_class(body=_NPU_BRANCH), False),
        # a write helper that is never called
        (_class(_DECLARE, _HELPER, body=_READ), False),
    ],
    ids=[
        "helper-write",
        "fused-write",
        "entries-and-npu-branch",
        "entries-and-source",
        "write-only",
        "npu-branch-only",
        "read-only",
    ],
)
def test_a_class_is_converted_only_when_declared_written_and_read(cls, converted):
    assert gather.is_converted_attention(cls) is converted


@pytest.mark.parametrize("body", [_SOURCE_ATTENTION, _NPU_BRANCH], ids=["source", "npu-branch"])
def test_every_attention_rewrite_skips_by_the_same_rule(body):
    # the init and forward rewrites must never disagree about a class (issue 27: the init
    # rewrite served a class the forward rewrite skipped)
    from kvskill.implementer._command import AttentionForwardRewrite, AttentionInitRewrite
    from kvskill.implementer.mla.codemods import MlaAttentionForwardCommand, MlaAttentionInitCommand

    classes = [
        _class(body=body),
        _class(_DECLARE, body=body),
        _class(_DECLARE, _HELPER, body=_WRITE + _READ),
    ]
    rewrites = [
        AttentionInitRewrite,
        AttentionForwardRewrite,
        MlaAttentionInitCommand,
        MlaAttentionForwardCommand,
    ]
    for cls in classes:
        picks = {rewrite.selects(None, cls) for rewrite in rewrites}  # type: ignore[arg-type]
        assert len(picks) == 1
    assert [AttentionInitRewrite.selects(None, c) for c in classes] == [True, True, False]  # type: ignore[arg-type]


def test_an_npu_branch_without_a_kernel_still_makes_an_attention_class():
    # so a forward that attends only through the fused operator is converted or refused by name
    body = "        k, v = cache.update(k, v, self.layer_idx)\n" + _READ.replace(
        "self.k_cache, self.k_cache", "k, v"
    )
    assert gather.is_attention_class(_class(body=body))

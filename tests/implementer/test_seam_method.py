"""Attention computed in a method of the class (``self._attn(q, k, v, mask)``, GPT-2 and
Qwen-7B style remote code): the seam runs from the cache write to that call, and the method's
scores (scale, what is added to them) are read in its own names and mapped back to the
call's arguments."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.facts import KernelStyle, attention_facts, module_classes
from kvskill.implementer.pipeline import convert_source, parse
from kvskill.implementer.spec import ConversionSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from vendor_fixtures import VENDOR_ROOT, convert_and_verify  # noqa: E402

SPEC = ConversionSpec(
    fa_version="v1",
    input_layout="TND",
    uniform_attn_type="FullAttention",
    sparse_mode={"FullAttention": {"prefill": 3, "decode": 3}},
)

SOURCE = """
import math

import torch
from torch import nn


class VendorAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.c_attn = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.c_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def _attn(self, query, key, value, attention_mask=None):
        attn_weights = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(value.size(-1))
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value)
        return attn_output, attn_weights

    def forward(self, hidden_states, layer_past=None, attention_mask=None, use_cache=False):
        b, s, _ = hidden_states.shape
        query, key, value = self.c_attn(hidden_states).split(hidden_states.shape[-1], dim=2)
        query = query.view(b, s, -1, self.head_dim).transpose(1, 2)
        key = key.view(b, s, -1, self.head_dim).transpose(1, 2)
        value = value.view(b, s, -1, self.head_dim).transpose(1, 2)
        if layer_past is not None:
            key = torch.cat((layer_past[0], key), dim=-2)
            value = torch.cat((layer_past[1], value), dim=-2)
        present = (key, value) if use_cache else None
        attn_output, attn_weights = self._attn(query, key, value, attention_mask)
        attn_output = attn_output.transpose(1, 2).reshape(b, s, -1)
        return self.c_proj(attn_output), present


class VendorForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.h = nn.ModuleList([VendorAttention(config)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)
"""


def test_the_kernel_is_the_method_call_with_its_scale_in_the_callers_names():
    module = parse(SOURCE)
    classes = module_classes(module)
    facts = attention_facts(classes["VendorAttention"], classes)
    assert facts.problems == [] and facts.fused_limits == []
    seam = facts.seam
    assert seam.style is KernelStyle.METHOD
    assert (seam.query, seam.key, seam.value) == ("query", "key", "value")
    # the method divides by math.sqrt(value.size(-1)): its parameter value is the call's value
    assert seam.scale == "1 / math.sqrt(value.size(-1))"
    assert seam.targets == ["attn_output", "attn_weights"]


def test_the_method_call_is_replaced_by_the_paged_seam():
    out = convert_source(SOURCE, SPEC, filename="modeling_vendor.py")
    forward = out.split("    def forward(")[1].split("\nclass ")[0]
    assert "self._attn(" not in forward and "torch.cat(" not in forward
    assert "torch_npu.npu_fused_infer_attention_score(" in forward
    assert "scale=1 / math.sqrt(value.size(-1))," in forward
    # the method returned [b, n, s, d]; the seam hands its output back in that layout
    assert "attn_output = attn_output.unsqueeze(0).transpose(1, 2)" in forward
    assert "attn_weights = None" in forward and "present = None" in forward
    assert convert_source(out, SPEC, filename="modeling_vendor.py") == out


@pytest.mark.parametrize(
    ("old", "new", "reason"),
    [
        (
            "            attn_weights = attn_weights + attention_mask\n",
            "            attn_weights = attn_weights + attention_mask + self.alibi\n",
            "VendorAttention._attn adds self.alibi to its attention scores (a position bias",
        ),
        (
            "        return attn_output, attn_weights\n",
            "        return attn_output * attn_weights.sum(-1, keepdim=True), attn_weights\n",
            "VendorAttention._attn returns ['attn_weights'] computed from its attention weights, which the fused operator does not produce",
        ),
        (
            "        attn_weights = torch.matmul(query, key.transpose(-1, -2))",
            "        query = query * 2\n        attn_weights = torch.matmul(query, key.transpose(-1, -2))",
            "VendorAttention._attn changes its parameters ['query'] before attention (`query = query * 2`), beyond a permute, transpose or cast",
        ),
        (
            "        attn_output = torch.matmul(attn_weights, value)\n",
            "        attn_output = torch.matmul(attn_weights, value)\n        if self.training:\n            attn_output = attn_output * 2\n",
            "VendorAttention._attn does more than re-lay out its attention output before returning it (`if self.training:`)",
        ),
        (
            "self._attn(query, key, value, attention_mask)",
            "self._attn(query, key.float(), value, attention_mask)",
            "VendorAttention.forward hands its attention method key.float(), value, not the keys and values its cache write holds (key, value)",
        ),
    ],
)  # fmt: skip
def test_a_method_the_fused_operator_cannot_stand_for_is_refused_naming_it(old, new, reason):
    assert SOURCE.count(old) == 1
    source = SOURCE.replace(old, new)
    with pytest.raises(UnsupportedModelError, match=re.escape(reason)):
        convert_source(source, SPEC, filename="modeling_vendor.py")
    # the construct the refusal names is in the file
    assert "def _attn(self" in source and new.strip() in source


def test_what_the_method_does_to_its_output_runs_after_the_seam():
    """Qwen-7B's ``_attn`` returns ``attn_output.transpose(1, 2)``: the converted forward does
    the same to the fused output, so the code after the call receives [b, s, h, d] again."""
    source = SOURCE.replace(
        "        return attn_output, attn_weights\n",
        "        attn_output = attn_output.transpose(1, 2)\n        return attn_output, attn_weights\n",
    ).replace(
        "        attn_output = attn_output.transpose(1, 2).reshape(b, s, -1)\n",
        "        attn_output = attn_output.reshape(b, s, -1)\n",
    )
    out = convert_source(source, SPEC, filename="modeling_vendor.py")
    forward = out.split("    def forward(")[1].split("\nclass ")[0]
    assert "self._attn(" not in forward
    seam_end = forward.index("attn_output = attn_output.unsqueeze(0).transpose(1, 2)")
    tail = forward.index("attn_output = attn_output.transpose(1, 2)\n", seam_end)
    assert tail < forward.index("attn_output = attn_output.reshape(b, s, -1)")
    # the method stays, unused by the converted forward
    assert "    def _attn(self, query, key, value, attention_mask=None):" in out
    assert convert_source(out, SPEC, filename="modeling_vendor.py") == out


def _attention_in_a_method(model: Path) -> None:
    """The Baichuan-shape fixture's inline matmul attention moved into ``self._attn``."""
    modeling = next(model.glob("modeling_*.py"))
    text = modeling.read_text(encoding="utf-8")
    start = text.index(
        "        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3))"
    )
    end = text.index("        attn_output = attn_output.transpose(1, 2)\n")
    inline = text[start:end]
    call = "        attn_output, attn_weights = self._attn(query_states, key_states, value_states, attention_mask)\n\n"
    method = (
        "    def _attn(self, query_states, key_states, value_states, attention_mask=None):\n"
        + inline.rstrip("\n")
        + "\n        return attn_output, attn_weights\n\n"
    )
    text = text[:start] + call + text[end:]
    # the method goes right before the attention class's forward
    at = text.index("    def forward(", text.index("class VendorPackAttention("))
    text = text[:at] + method + text[at:]
    modeling.write_text(text, encoding="utf-8")


@pytest.mark.slow
def test_attention_in_a_method_verifies_token_exact(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(VENDOR_ROOT / "w_pack_matmul_bhsd", model)
    _attention_in_a_method(model)
    report = convert_and_verify("", tmp_path / "out", "framework", "paged", model=model)
    assert report.passed, report.failures()
    assert report.tokens_identical
    assert report.max_logit_diff < 1e-4


EINSUM_BMM = """        # [sq, b, np, hn] . [sk, b, np, hn] -> [b, np, sq, sk]
        scores = torch.einsum("sbhd,tbhd->bhst", query_layer, key_layer)
        scores = scores / (self.hidden_size_per_attention_head**0.5)
        if attention_mask is None and scores.shape[2] == scores.shape[3]:
            # the model passes no mask for a plain causal prefill: build it here
            attention_mask = torch.ones(
                scores.shape[2], scores.shape[3], dtype=torch.bool, device=scores.device
            ).triu(1)
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        b, heads, sq, sk = probs.shape
        values = value_layer.permute(1, 2, 0, 3).reshape(b * heads, sk, -1)
        context_layer = torch.bmm(probs.reshape(b * heads, sq, sk), values).view(b, heads, sq, -1)

"""


def _einsum_model(tmp_path: Path, kernel: str = EINSUM_BMM) -> tuple[Path, str]:
    """The ChatGLM-shape fixture (seq-first tuple cache, dim=0) with its SDPA kernel
    computed by hand instead (KERNEL); the model directory and its modeling text."""
    model = tmp_path / "model"
    shutil.copytree(VENDOR_ROOT / "mqa_groups_sbhd", model)
    modeling = next(model.glob("modeling_*.py"))
    text = modeling.read_text(encoding="utf-8")
    start = text.index("        query_layer, key_layer, value_layer = [\n")
    end = text.index("        # [b, np, sq, hn] -> [sq, b, hp]\n")
    text = text[:start] + kernel + text[end:]
    modeling.write_text(text, encoding="utf-8")
    return model, text


def _einsum_facts(text: str):
    classes = module_classes(parse(text))
    return attention_facts(classes["VendorGlmSelfAttention"], classes)


def test_einsum_and_bmm_attention_is_read_as_scaled_dot_product_attention(tmp_path):
    _, text = _einsum_model(tmp_path)
    facts = _einsum_facts(text)
    assert facts.problems == [] and facts.fused_limits == []
    seam = facts.seam
    assert seam.style is KernelStyle.EINSUM
    assert (seam.query, seam.key, seam.value) == ("query_layer", "key_layer", "value_layer")
    # the scale the scores are divided by after the product, as the operator's scale
    assert seam.scale == "1 / (self.hidden_size_per_attention_head**0.5)"
    assert seam.targets == ["context_layer", "scores", "probs"]
    # bmm over [b * n, sq, sk] and [b * n, sk, d], viewed as [b, n, sq, d]: the fused
    # output [1, T, N, D] goes back to that order
    (after,) = seam.after
    assert "context_layer = context_layer.permute(0, 2, 1, 3)" in _code(after)


def _code(node) -> str:
    from kvskill.implementer.facts import code

    return code(node)


EINSUM_EINSUM = """        scores = torch.einsum("sbhd,tbhd->bhst", query_layer.float(), key_layer.float()) * (
            self.hidden_size_per_attention_head**-0.5
        )
        if attention_mask is None and scores.shape[2] == scores.shape[3]:
            attention_mask = torch.ones(
                scores.shape[2], scores.shape[3], dtype=torch.bool, device=scores.device
            ).triu(1)
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, float("-inf"))
        probs = scores.softmax(-1).type_as(value_layer)
        context_layer = torch.einsum("bhst,tbhd->sbhd", probs, value_layer)
        context_layer = context_layer.permute(1, 2, 0, 3)

"""


def test_an_einsum_output_is_handed_back_in_the_order_its_subscripts_give(tmp_path):
    _, text = _einsum_model(tmp_path, EINSUM_EINSUM)
    facts = _einsum_facts(text)
    assert facts.problems == [] and facts.fused_limits == []
    seam = facts.seam
    # the factor as the file spells it (parenthesised over three lines)
    assert " ".join(seam.scale.split()) == "( self.hidden_size_per_attention_head**-0.5 )"
    # "->sbhd": [1, T, N, D] -> [T, 1, N, D]
    (after,) = seam.after
    assert "context_layer = context_layer.permute(1, 0, 2, 3)" in _code(after)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode", [("framework", "paged"), ("standalone", "paged"), ("standalone", "contiguous")]
)
def test_einsum_and_bmm_attention_after_a_seq_first_tuple_cache_verifies_token_exact(
    mode, tmp_path
):
    model, _ = _einsum_model(tmp_path)
    out = tmp_path / "out"
    report = convert_and_verify("", out, *mode, model=model)
    assert report.passed, report.failures()
    assert report.tokens_identical and report.max_logit_diff < 1e-4
    forward = (out / "modeling_vendor_glm.py").read_text(encoding="utf-8")
    forward = forward.split("class VendorGlmSelfAttention(")[1].split("\nclass ")[0]
    assert "torch.einsum(" not in forward and "torch.bmm(" not in forward


@pytest.mark.slow
def test_an_einsum_output_verifies_token_exact(tmp_path):
    model, _ = _einsum_model(tmp_path, EINSUM_EINSUM)
    report = convert_and_verify("", tmp_path / "out", "framework", "paged", model=model)
    assert report.passed, report.failures()
    assert report.tokens_identical and report.max_logit_diff < 1e-4


@pytest.mark.parametrize(
    ("old", "new", "reason"),
    [
        (
            '"sbhd,tbhd->bhst"',
            '"sbhd,tbhd->bhsd"',
            'VendorGlmSelfAttention.forward: `torch.einsum("sbhd,tbhd->bhsd", query_layer, '
            "key_layer)` does not contract the query/key channel axis alone",
        ),
        (
            '"sbhd,tbhd->bhst"',
            '"sbhd,tbhd->hbst"',
            # b, heads = probs.shape[:2] are now the head and batch sizes: the values merged
            # by them do not pair with the weights
            "VendorGlmSelfAttention.forward: `value_layer.permute(1, 2, 0, 3).reshape(b * heads, "
            "sk, -1)` does not merge or split adjacent axes in order",
        ),
        (
            "torch.softmax(scores, dim=-1)",
            "torch.softmax(scores, dim=-2)",
            "VendorGlmSelfAttention.forward: `torch.softmax(scores, dim=-2)` does not run over "
            "the key-position axis of the scores (their subscripts put it at dim 3)",
        ),
        (
            "value_layer.permute(1, 2, 0, 3).reshape(b * heads,",
            "value_layer.permute(2, 1, 0, 3).reshape(heads * b,",
            "pairs the weights' and the values' batch axes differently (bn against nb)",
        ),
        (
            "scores.masked_fill(attention_mask,",
            "scores.masked_fill(scores < 0,",
            "VendorGlmSelfAttention.forward: `scores = scores.masked_fill(scores < 0, "
            'float("-inf"))` changes the scores beyond a mask or a cast',
        ),
        (
            "        probs = torch.softmax(scores, dim=-1)\n",
            "        scores.add_(self.position_bias)\n        probs = torch.softmax(scores, dim=-1)\n",
            "VendorGlmSelfAttention.forward: `scores.add_(self.position_bias)` changes the scores "
            "in place beyond a mask",
        ),
    ],
    ids=["contracts-positions", "heads-first-scores", "softmax-over-queries", "heads-first-values", "not-a-mask", "in-place-bias"],
)  # fmt: skip
def test_einsum_attention_the_seam_cannot_prove_is_refused_naming_it(old, new, reason, tmp_path):
    """An einsum whose subscripts, softmax axis or reshapes the seam cannot prove to be the
    fused operator's attention is refused; none of these converts."""
    from kvskill.implementer.convert import ApplyOptions
    from kvskill.implementer.writer import apply_model

    assert EINSUM_BMM.count(old) == 1
    model, text = _einsum_model(tmp_path, EINSUM_BMM.replace(old, new))
    with pytest.raises(UnsupportedModelError) as refused:
        apply_model(str(model), tmp_path / "out", ApplyOptions())
    message = str(refused.value)
    assert reason in message and "\n" not in message
    assert new.strip() in text
    assert not (tmp_path / "out").exists()


def test_a_query_changed_inside_the_seam_is_a_fused_limit_naming_the_statement():
    """Qwen-7B scales its query by logn between the cache write and ``_attn``: the seam reads
    the query before that statement, so converting would drop it silently."""
    source = SOURCE.replace(
        "        present = (key, value) if use_cache else None\n",
        "        present = (key, value) if use_cache else None\n        query = query * 2.0\n",
    )
    with pytest.raises(UnsupportedModelError, match=re.escape("(`query = query * 2.0`)")):
        convert_source(source, SPEC, filename="modeling_vendor.py")
    # a relayout of the query there is the seam's own business
    relaid = SOURCE.replace(
        "        present = (key, value) if use_cache else None\n",
        "        present = (key, value) if use_cache else None\n        query = query.contiguous()\n",
    )
    assert "torch_npu." in convert_source(relaid, SPEC, filename="modeling_vendor.py")


def test_kv_heads_copied_before_the_head_axis_are_not_read_as_the_operators_grouping(tmp_path):
    """``unsqueeze(2)`` puts the copies of each KV head before the heads: merged, query head
    h reads KV head h % KVN, where the fused operator pairs it with h // G. The original
    runs; converting it would change its output, so it is refused."""
    from kvskill.implementer.convert import ApplyOptions
    from kvskill.implementer.writer import apply_model

    model, text = _einsum_model(tmp_path)
    old = "key_layer.unsqueeze(-2).expand(-1, -1, -1, ratio, -1)"
    assert text.count(old) == 1
    modeling = next(model.glob("modeling_*.py"))
    modeling.write_text(
        text.replace(old, "key_layer.unsqueeze(2).expand(-1, -1, ratio, -1, -1)"),
        encoding="utf-8",
    )
    with pytest.raises(UnsupportedModelError, match="the key operand `key_layer` is not read"):
        apply_model(str(model), tmp_path / "out", ApplyOptions())


def test_kv_heads_copied_before_the_head_axis_are_refused_for_an_sdpa_kernel_too(tmp_path):
    """The same grouping before SDPA (the fixture's own kernel): the original runs and its
    query head h reads KV head h % KVN; the fused operator would read h // G."""
    from kvskill.implementer.convert import ApplyOptions
    from kvskill.implementer.writer import apply_model

    model = tmp_path / "model"
    shutil.copytree(VENDOR_ROOT / "mqa_groups_sbhd", model)
    modeling = next(model.glob("modeling_*.py"))
    text = modeling.read_text(encoding="utf-8")
    for name in ("key_layer", "value_layer"):
        old = f"{name}.unsqueeze(-2).expand(-1, -1, -1, ratio, -1)"
        assert text.count(old) == 1
        text = text.replace(old, f"{name}.unsqueeze(2).expand(-1, -1, ratio, -1, -1)")
    modeling.write_text(text, encoding="utf-8")
    with pytest.raises(UnsupportedModelError) as refused:
        apply_model(str(model), tmp_path / "out", ApplyOptions())
    assert (
        "VendorGlmSelfAttention.forward copies its KV heads before the head axis "
        "(`key_layer.unsqueeze(2)`): merged, query head h reads KV head h % KVN"
    ) in str(refused.value)
    assert not (tmp_path / "out").exists()


BADDBMM = """        # ChatGLM-6B's form: scores into an empty buffer, [b * np, sq, sk]
        output_size = (query_layer.size(1), query_layer.size(2), query_layer.size(0), key_layer.size(0))
        q2 = query_layer.reshape(output_size[2], output_size[0] * output_size[1], -1)
        k2 = key_layer.reshape(output_size[3], output_size[0] * output_size[1], -1)
        matmul_result = torch.baddbmm(
            torch.empty(output_size[0] * output_size[1], output_size[2], output_size[3]),
            q2.transpose(0, 1),
            k2.transpose(0, 1).transpose(1, 2),
            beta=0.0,
            alpha=1.0 / (self.hidden_size_per_attention_head**0.5),
        )
        scores = matmul_result.view(*output_size)
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        v2 = value_layer.reshape(value_layer.size(0), output_size[0] * output_size[1], -1)
        context_layer = torch.bmm(probs.view(-1, output_size[2], output_size[3]), v2.transpose(0, 1))
        context_layer = context_layer.view(*output_size[:3], -1)

"""


def test_scores_into_an_empty_buffer_with_baddbmm_are_refused_naming_the_products(tmp_path):
    """ChatGLM-6B (v1) computes its scores with ``torch.baddbmm`` into an empty buffer: not
    read by the seam, refused naming what the file does."""
    from kvskill.implementer.convert import ApplyOptions
    from kvskill.implementer.writer import apply_model

    model, text = _einsum_model(tmp_path, BADDBMM)
    with pytest.raises(UnsupportedModelError) as refused:
        apply_model(str(model), tmp_path / "out", ApplyOptions())
    message = str(refused.value)
    assert (
        "VendorGlmSelfAttention.forward writes the KV cache, then computes attention by hand "
        "with torch.bmm and torch.baddbmm and a softmax, which the seam does not read"
    ) in message
    assert "torch.baddbmm(" in text and "torch.bmm(" in text and "torch.einsum(" not in text

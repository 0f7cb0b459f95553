"""Attention run in a submodule of the same file (ChatGLM2/3's ``self.core_attention(q, k, v,
mask)``): the seam runs from the cache write to that call, the submodule's kernel is read in
its own names, and what it does to its output afterwards runs after the seam."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.convert import ApplyOptions
from kvskill.implementer.facts import KernelStyle, attention_facts, code, module_classes
from kvskill.implementer.pipeline import parse
from kvskill.implementer.writer import apply_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from vendor_fixtures import VENDOR_ROOT, convert_and_verify  # noqa: E402

FIXTURE = VENDOR_ROOT / "core_attention_sbhd"
MODELING = "modeling_vendor_coreattn.py"


def _source() -> str:
    return (FIXTURE / MODELING).read_text(encoding="utf-8")


def _mutated(tmp_path: Path, old: str, new: str) -> Path:
    model = tmp_path / "model"
    shutil.copytree(FIXTURE, model)
    text = _source()
    assert text.count(old) == 1, old
    (model / MODELING).write_text(text.replace(old, new), encoding="utf-8")
    return model


def test_the_kernel_is_the_submodule_call_and_its_tail_is_rebound_to_the_submodule():
    classes = module_classes(parse(_source()))
    facts = attention_facts(classes["VendorCoreAttnSelfAttention"], classes)
    assert facts.problems == [] and facts.fused_limits == []
    seam = facts.seam
    assert seam.style is KernelStyle.SUBMODULE
    assert (seam.query, seam.key, seam.value) == ("query_layer", "key_layer", "value_layer")
    assert seam.scale is None  # SDPA's default, head_dim ** -0.5, as the seam's
    tail = [code(stmt) for stmt in seam.after]
    # the submodule's comment travels with its statement
    assert tail == [
        "# [b, np, sq, hn] -> [sq, b, np, hn] -> [sq, b, hp]\n"
        "context_layer = context_layer.permute(2, 0, 1, 3)",
        "new_context_layer_shape = context_layer.size()[:-2] + "
        "(self.core_attention.hidden_size_per_partition,)",
        "context_layer = context_layer.reshape(*new_context_layer_shape)",
    ]


def test_the_converted_forward_no_longer_calls_the_submodule(tmp_path):
    out = tmp_path / "out"
    apply_model(str(FIXTURE), out, ApplyOptions())
    text = (out / MODELING).read_text(encoding="utf-8")
    forward = text.split("class VendorCoreAttnSelfAttention(")[1].split("\nclass ")[0]
    assert "self.core_attention(" not in forward
    assert "torch_npu.npu_fused_infer_attention_score(" in forward
    # the submodule stays as written (built, unused by the converted forward)
    core = _source().split("class VendorCoreAttention(")[1].split("\nclass ")[0]
    assert core in text
    assert "self.core_attention = VendorCoreAttention(config, self.layer_number)" in forward
    # applying to the converted file changes nothing
    again = tmp_path / "again"
    apply_model(str(out), again, ApplyOptions())
    assert (again / MODELING).read_text(encoding="utf-8") == text


MATMUL_CORE = """        scores = torch.matmul(query_layer, key_layer.transpose(-1, -2)) / self.norm_factor
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, float("-inf"))
        else:
            scores = scores + self.causal_mask(scores)
        probs = F.softmax(scores.float(), dim=-1).type_as(value_layer)
        probs = self.attention_dropout(probs)
        context_layer = torch.matmul(probs, value_layer)
"""


def _matmul_core(text: str) -> str:
    """The fixture's CoreAttention with SDPA replaced by matmul attention (ChatGLM's
    pre-PyTorch-2 path, over [b, np, s, hn])."""
    start = text.index("        if attention_mask is None and query_layer.shape[2] ==")
    end = text.index("        # [b, np, sq, hn] -> [sq, b, np, hn] -> [sq, b, hp]")
    helper = (
        "    def causal_mask(self, scores):\n"
        "        sq, sk = scores.shape[-2:]\n"
        "        allowed = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)\n"
        "        return torch.zeros(sq, sk).masked_fill(~allowed, float('-inf'))\n\n"
    )
    text = text[:start] + MATMUL_CORE + text[end:]
    at = text.index("    def forward(self, query_layer, key_layer, value_layer, attention_mask):")
    return text[:at] + helper + text[at:]


def test_a_submodule_running_matmul_attention_is_read_with_its_scale(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(FIXTURE, model)
    (model / MODELING).write_text(_matmul_core(_source()), encoding="utf-8")
    text = (model / MODELING).read_text(encoding="utf-8")
    classes = module_classes(parse(text))
    facts = attention_facts(classes["VendorCoreAttnSelfAttention"], classes)
    assert facts.problems == [] and facts.fused_limits == []
    # the submodule's own attribute, reached from the attention class
    assert facts.seam.scale == "1 / self.core_attention.norm_factor"


@pytest.mark.slow
def test_a_submodule_running_matmul_attention_verifies_token_exact(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(FIXTURE, model)
    (model / MODELING).write_text(_matmul_core(_source()), encoding="utf-8")
    report = convert_and_verify("", tmp_path / "out", "framework", "paged", model=model)
    assert report.passed, report.failures()
    assert report.tokens_identical and report.max_logit_diff < 1e-4


#: (old, new, the refusal): what a submodule does that the fused operator cannot stand for
SUBMODULE_REFUSALS = [
    (
        "            k.permute(1, 2, 0, 3) for k in [query_layer, key_layer, value_layer]\n        ]\n",
        "            k.permute(1, 2, 0, 3) for k in [query_layer, key_layer, value_layer]\n        ]\n"
        "        query_layer = query_layer * self.layer_number\n",
        "VendorCoreAttention.forward changes its parameters ['query_layer'] before attention "
        "(`query_layer = query_layer * self.layer_number`), beyond a permute, transpose or cast",
    ),
    (
        "        self.core_attention = VendorCoreAttention(config, self.layer_number)\n",
        "        self.core_attention = ExternalCoreAttention(config, self.layer_number)\n",
        "VendorCoreAttnSelfAttention.forward hands query, key and value to self.core_attention "
        "(ExternalCoreAttention), which is not a class of this file with a forward",
    ),
    (
        "        context_layer = context_layer.permute(2, 0, 1, 3)\n",
        "        if self.training:\n            context_layer = context_layer * 2\n"
        "        context_layer = context_layer.permute(2, 0, 1, 3)\n",
        "VendorCoreAttention.forward does more than re-lay out its attention output before "
        "returning it (`if self.training:`)",
    ),
]


@pytest.mark.parametrize(("old", "new", "reason"), SUBMODULE_REFUSALS)
def test_a_submodule_the_fused_operator_cannot_stand_for_is_refused_naming_it(
    old, new, reason, tmp_path
):
    model = _mutated(tmp_path, old, new)
    with pytest.raises(UnsupportedModelError, match=re.escape(reason)) as refused:
        apply_model(str(model), tmp_path / "out", ApplyOptions())
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("old", "new", "reason"),
    [
        (
            "            scores = scores + self.causal_mask(scores)\n",
            "            scores = scores + self.causal_mask(scores) + self.alibi\n",
            "VendorCoreAttention.forward adds self.alibi to its attention scores (a position "
            "bias such as ALiBi); the paged seam adds only the causal mask",
        ),
        (
            "        probs = F.softmax(scores.float(), dim=-1)",
            "        scores = torch.tanh(scores / 30.0) * 30.0\n"
            "        probs = F.softmax(scores.float(), dim=-1)",
            "VendorCoreAttention.forward soft-caps its attention scores (tanh); the fused "
            "operator has no soft-capping input",
        ),
    ],
)
def test_a_matmul_submodule_with_a_bias_or_a_cap_is_refused_naming_it(old, new, reason, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(FIXTURE, model)
    text = _matmul_core(_source())
    assert text.count(old) == 1
    (model / MODELING).write_text(text.replace(old, new), encoding="utf-8")
    with pytest.raises(UnsupportedModelError, match=re.escape(reason)):
        apply_model(str(model), tmp_path / "out", ApplyOptions())

"""transformers 4.46 code shapes: hand-written matmul attention, the flash helper, and attention
families sharing one ``__init__`` (``rewrites/before_family_4x.py``), converted on the paged path.

The compatibility suite (tests/compat) runs real 4.46 families end to end; these pin the
rewrite itself under the main suite's transformers.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from kvskill.analyzer.gather import is_attention_class
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.facts import KernelStyle, attention_facts, module_classes
from kvskill.implementer.pipeline import convert_source, parse
from kvskill.implementer.spec import ConversionSpec, FaVersion

HERE = Path(__file__).resolve().parent / "rewrites"
BEFORE = (HERE / "before_family_4x.py").read_text(encoding="utf-8")
AFTER = HERE / "family_4x.paged.after.py"

FULL = ConversionSpec(
    fa_version=FaVersion.V1,
    input_layout="TND",
    uniform_attn_type="FullAttention",
    sparse_mode={"FullAttention": {"prefill": 3, "decode": 3}},
)


def _facts(source: str):
    module = parse(source)
    classes = module_classes(module)
    return {name: attention_facts(cls, classes) for name, cls in classes.items()}


def test_every_variant_is_an_attention_class_with_its_kernel_style():
    classes = module_classes(parse(BEFORE))
    assert [n for n, c in classes.items() if is_attention_class(c)] == [
        "MiniAttention",
        "MiniSdpaAttention",
        "MiniFlashAttention2",
    ]
    facts = _facts(BEFORE)
    styles = {n: f.seam.style for n, f in facts.items() if f.seam is not None}
    assert styles == {
        "MiniAttention": KernelStyle.MATMUL,
        "MiniSdpaAttention": KernelStyle.SDPA,
        "MiniFlashAttention2": KernelStyle.FLASH,
    }
    eager = facts["MiniAttention"].seam
    assert eager.query == "query_states" and eager.key == "key_states"
    assert eager.scale == "1 / math.sqrt(self.head_dim)"
    assert eager.targets == ["attn_output", "attn_weights"]
    # the variants take their __init__ facts from the base that owns them
    assert facts["MiniSdpaAttention"].problems == []
    assert facts["MiniFlashAttention2"].config_param == "config"
    assert facts["MiniFlashAttention2"].layer_idx_param == "layer_idx"


def test_the_family_is_converted_once_per_init_and_once_per_forward():
    out = convert_source(BEFORE, FULL, package="transformers.models.mini")
    if os.environ.get("KVSKILL_WRITE_REWRITES"):
        AFTER.write_text(out, encoding="utf-8")
    assert out == AFTER.read_text(encoding="utf-8")
    assert out.count("self.cache_entries = [") == 1
    assert out.count("torch_npu.npu_fused_infer_attention_score(") == 3
    assert ".update(key_states, value_states, self.layer_idx" not in out
    assert "torch.matmul" not in out and "_flash_attention_forward(" not in out.split("import")[-1]
    assert "scale=1 / math.sqrt(self.head_dim)," in out
    # the eager weights, returned under output_attentions, are defined again as None
    assert "attn_weights = None\n\n        attn_output = attn_output.transpose(1, 2)" in out
    # converting the converted file changes nothing
    assert convert_source(out, FULL, package="transformers.models.mini") == out


def _eager_variant(old: str, new: str) -> str:
    assert old in BEFORE
    return BEFORE.replace(old, new, 1)


SCORES = "attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)\n"


@pytest.mark.parametrize(
    ("scores", "scale"),
    [
        ("torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling", "self.scaling"),
        ("torch.matmul(query_states, key_states.transpose(2, 3))", "1.0"),
        ("torch.matmul(query_states, key_states.transpose(2, 3)) / (self.head_dim**0.5)", "1 / (self.head_dim**0.5)"),
    ],
)  # fmt: skip
def test_the_softmax_scale_is_read_from_the_scores(scores, scale):
    source = _eager_variant(SCORES, f"attn_weights = {scores}\n")
    assert _facts(source)["MiniAttention"].seam.scale == scale
    assert f"scale={scale}," in convert_source(source, FULL)


@pytest.mark.parametrize(
    ("inserted", "reason"),
    [
        ("attn_weights = torch.tanh(attn_weights / 50.0) * 50.0\n", "soft-caps its attention scores (tanh)"),
        ("attn_weights = attn_weights * self.temperature\n", "rescales its attention scores after the product"),
        ("attn_weights = attn_weights + self.alibi[:, : key_states.shape[-2]]\n", "adds self.alibi[:, : key_states.shape[-2]] to its attention scores (a position bias such as ALiBi)"),
    ],
)  # fmt: skip
def test_scores_the_fused_operator_cannot_express_are_refused_with_the_reason(inserted, reason):
    source = _eager_variant(
        "        # upcast to fp32 for the softmax\n", f"        {inserted}        # upcast\n"
    )
    with pytest.raises(UnsupportedModelError, match=re.escape("MiniAttention.forward " + reason)):
        convert_source(source, FULL)


def test_a_variant_without_init_whose_base_is_no_attention_class_is_refused():
    source = BEFORE.replace(
        "class MiniSdpaAttention(MiniAttention):", "class MiniSdpaAttention(Base):"
    )
    source = source.replace(
        "class MiniAttention(nn.Module):",
        "class Base(nn.Module):\n    pass\n\n\nclass MiniAttention(nn.Module):",
    )
    with pytest.raises(UnsupportedModelError, match="MiniSdpaAttention has no __init__"):
        convert_source(source, FULL)


MODEL_WITH_MASK_METHOD = """
class MiniModel(nn.Module):
    def forward(self, input_ids, attention_mask=None, cache_position=None, past_key_values=None):
        hidden_states = self.embed_tokens(input_ids)
        causal_mask = self._update_causal_mask(attention_mask, hidden_states, cache_position, past_key_values)
        return self.layer(hidden_states, causal_mask)

    def _update_causal_mask(self, attention_mask, input_tensor, cache_position, past_key_values):
        return torch.full((input_tensor.shape[1], input_tensor.shape[1]), float("-inf")).triu(1)
"""


def test_the_dense_mask_method_of_a_4x_model_is_skipped_in_the_paged_runtime():
    out = convert_source(BEFORE + MODEL_WITH_MASK_METHOD, FULL)
    assert "causal_mask = (None if _in_paged_runtime() else self._update_causal_mask(" in out
    assert "def _in_paged_runtime() -> bool:" in out
    # the method itself still builds the mask outside the runtime
    assert "return torch.full((input_tensor.shape[1]" in out

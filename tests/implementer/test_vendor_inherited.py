"""Attention classes a remote file imports from transformers (subclassed or used as they are).

The rewrite converts the code of the file it is given. A class that inherits its forward from
transformers has no cache write in the file: refused, naming the classes and their origin. A
subclass that brings its own forward converts like any attention class, and one without an
``__init__`` of its own is refused with what to add.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.convert import ApplyOptions
from kvskill.implementer.pipeline import convert_source
from kvskill.implementer.spec import ConversionSpec
from kvskill.implementer.writer import apply_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from vendor_fixtures import VENDOR_ROOT  # noqa: E402

SPEC = ConversionSpec(
    fa_version="v1",
    input_layout="TND",
    uniform_attn_type="FullAttention",
    sparse_mode={"FullAttention": {"prefill": 3, "decode": 3}},
)


def test_attention_inherited_from_transformers_is_refused_naming_class_and_origin(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(UnsupportedModelError) as refused:
        apply_model(str(VENDOR_ROOT / "inherited_llama_attention"), out, ApplyOptions())
    message = str(refused.value)
    assert "\n" not in message
    assert (
        "VendorSubAttention subclasses LlamaAttention from "
        "transformers.models.llama.modeling_llama" in message
    )
    assert "VendorSubDecoderLayer subclasses LlamaDecoderLayer" in message
    assert "copy the inherited forward" in message
    assert not out.exists()


OWN_FORWARD = """
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb
from torch import nn


class VendorAttention(LlamaAttention):
{init}
    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_value=None):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_value is not None:
            k, v = past_key_value.update(k, v, self.layer_idx)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1)), None


class VendorForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([VendorAttention(config, 0)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)
"""


def test_a_subclass_with_its_own_forward_but_no_init_is_refused_with_what_to_add():
    with pytest.raises(UnsupportedModelError) as refused:
        convert_source(OWN_FORWARD.format(init=""), SPEC, filename="modeling_vendor.py")
    assert (
        "VendorAttention has no __init__ (it inherits LlamaAttention's, defined outside the "
        "file: give it one that calls super().__init__(...)" in str(refused.value)
    )


def test_a_subclass_with_its_own_forward_and_init_converts():
    init = (
        "    def __init__(self, config, layer_idx):\n        super().__init__(config, layer_idx)\n"
    )
    converted = convert_source(OWN_FORWARD.format(init=init), SPEC, filename="modeling_vendor.py")
    init_text = converted[converted.index("def __init__") : converted.index("def forward")]
    assert "super().__init__(config, layer_idx)" in init_text
    assert "self.cache_entries = [" in init_text
    assert "torch_npu.npu_fused_infer_attention_score(" in converted
    assert "past_key_value.update(" not in converted

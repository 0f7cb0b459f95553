"""libcst facts with line numbers, from source strings written here."""

from __future__ import annotations

import textwrap

import pytest
from kvskill.analyzer.roles import find_roles
from kvskill.analyzer.scan import scan_source
from kvskill.core.errors import UnsupportedModelError

SOURCE = textwrap.dedent(
    """\
    import torch
    from transformers.cache_utils import Cache


    class AAttention(nn.Module):
        def __init__(self, config, layer_idx):
            self.sinks = nn.Parameter(torch.empty(4))
            self.sliding_window = config.sliding_window

        def forward(self, x, cache=None, **kwargs):
            kwargs.update({"a": 1})
            if cache is not None:
                k, v = cache.update(k, v, self.layer_idx)
            else:
                k, v = cache.update(k, v, self.layer_idx)
            out, _ = attention_interface(self, q, k, v, s_aux=self.sinks, sliding_window=4)
            return out


    class ADecoderLayer(nn.Module):
        def __init__(self, config, layer_idx):
            self.self_attn = AAttention(config, layer_idx)


    class AModel(APreTrainedModel):
        def __init__(self, config):
            self.layers = nn.ModuleList([ADecoderLayer(config, i) for i in range(4)])

        def forward(self, x, past_key_values=None):
            return past_key_values.update(x, x, 0)


    class AForCausalLM(APreTrainedModel):
        def __init__(self, config):
            self.model = AModel(config)
    """
)


def test_calls_classes_and_lines():
    facts = scan_source(SOURCE, path="/x/modeling_a.py")
    attention = facts.classes["AAttention"]
    updates = [c for c in attention.calls if c.kind == "cache_update"]
    # dict.update with one argument is not a cache write; identical calls get their own lines
    assert [c.line for c in updates] == [13, 15]
    assert updates[0].receiver == "cache" and updates[0].method == "forward"
    call = attention.first_call("attention_call")
    assert call.line == 16 and call.callee == "attention_interface"
    assert set(call.keywords) == {"s_aux", "sliding_window"}
    assert attention.self_attrs["sinks"] == 7 and attention.names_used["s_aux"] == 16
    assert attention.methods == {"__init__": 6, "forward": 10}
    assert facts.config_reads["sliding_window"] == 8
    assert "transformers.cache_utils" in facts.imports
    assert facts.where(13) == "modeling_a.py:13"
    # the model's forward body is not scanned (only constructors of model classes matter)
    assert facts.classes["AModel"].calls == []
    assert facts.classes["AModel"].attr_classes["layers"] == ["ModuleList", "ADecoderLayer"]


def test_roles_follow_the_constructor_chain():
    roles = find_roles(scan_source(SOURCE), "AForCausalLM")
    assert roles.causal_lm == "AForCausalLM" and roles.model == "AModel"
    assert roles.decoder_layer == "ADecoderLayer" and roles.attention == ["AAttention"]
    assert roles.linear_attention == []


def test_syntax_errors_are_refusals_with_the_line():
    with pytest.raises(UnsupportedModelError, match="modeling_b.py at line 2"):
        scan_source("x = 1\ndef broken(:\n", path="/y/modeling_b.py")

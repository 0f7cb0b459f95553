"""Short-convolution mixers (LFM2): a paged conv state, run by torch_npu's fused causal conv.

A short conv is a gated depthwise causal conv with no state besides its last kernel-1
inputs. It is recognised by what its ``forward`` does: a causal conv (``causal_conv1d_fn`` /
``causal_conv1d_update``) whose cache read is ``get_conv_state`` alone (no recurrent state:
that would be a Mamba mixer). The projections and gates stay as written; two top-level
statements of the forward are replaced:

    read   ``if cache is not None: conv_state = cache.get_conv_state(...)``
           -> the step's metadata, each request's state row; rows of requests new to the
              cache are zeroed, since the operator always starts from the row
    conv   ``if conv_state is not None and seq_len == 1: x = causal_conv1d_update(...)
           else: ... x = causal_conv1d_fn(...)``
           -> one ``torch_npu.npu_fused_causal_conv1d`` over the packed requests (prefill,
              decode and mixed steps alike), its bias added after the call (the operator
              takes none)

``__init__`` declares one ``MambaCacheEntry`` (the conv state) under attn_type "Mamba".
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import once_per_node
from kvskill.implementer._command import StateMixerCommand
from kvskill.implementer.facts import (
    CACHE_ENTRIES_ASSIGN,
    _assigned_names,
    _method,
    _used_names,
    class_assigns,
)
from kvskill.implementer.gated_delta import (
    CONV_CALL,
    EMITTED_LOCALS,
    RULE_CALL,
    ConvMixerFacts,
    _call_of,
    _conv_facts,
    mixer_forward,
    splice_forward,
    statement_order,
)
from kvskill.implementer.mamba_mixer import SCAN_CALL
from kvskill.implementer.snippets import statements
from kvskill.implementer.state_entries import (
    StateEntry,
    declare_states,
)

CONV_STATE_READ = m.Call(func=m.Attribute(attr=m.Name("get_conv_state")))
OTHER_STATE_READ = m.Call(func=m.Attribute(attr=m.Name("get_recurrent_state")))
#: what a Mamba-2 mixer calls besides its conv (its class is that kind, not a short conv)
MAMBA2_CALL = _call_of("chunk_scan_combined", "chunk_scan", "selective_state_update")
#: the operator the converted conv calls
FUSED_CONV_CALL = _call_of("npu_fused_causal_conv1d")


@dataclass(kw_only=True)
class ShortConvFacts(ConvMixerFacts):
    """One short-conv class and the statements its forward rewrite replaces (a conv state only:
    no kernel after the conv, no state write of its own)."""

    #: the short conv's activation is its own argument; None when it passes none
    activation: str = "None"


@once_per_node
def is_short_conv_class(cls: cst.ClassDef) -> bool:
    """A class whose forward runs a causal conv on a cached conv state and nothing else of a
    state mixer, or one this rewrite converted (cache entries and the fused conv)."""
    forward = _method(cls, "forward")
    if forward is None:
        return False
    if m.findall(forward, FUSED_CONV_CALL) and class_assigns(cls, CACHE_ENTRIES_ASSIGN):
        return True
    return (
        bool(m.findall(forward, CONV_CALL))
        and bool(m.findall(forward, CONV_STATE_READ))
        and not m.findall(forward, OTHER_STATE_READ | RULE_CALL | SCAN_CALL)
        and not m.findall(cls, MAMBA2_CALL)
    )


def short_conv_facts(cls: cst.ClassDef) -> ShortConvFacts:
    """Gather what the rewrite needs; ``problems`` lists what blocks it."""
    facts = ShortConvFacts(name=cls.name.value, converted=class_assigns(cls, CACHE_ENTRIES_ASSIGN))
    if facts.converted:
        return facts
    params, body = mixer_forward(cls)
    if len(params) >= 2:
        facts.hidden = params[1]
    (facts.read_index, facts.conv_index), ordered = statement_order(
        body, CONV_STATE_READ, CONV_CALL
    )
    if not ordered:
        facts.problems.append(
            f"{facts.name}.forward does not read its cached conv state and then run the causal "
            "conv in two separate statements"
        )
        return facts
    before = set(params) | _assigned_names(list(body.body[: facts.conv_index]))
    _conv_facts(facts, body.body[facts.conv_index], before)
    if facts.problems:
        return facts
    if facts.activation not in ("None", '"None"', "'None'"):
        facts.problems.append(
            f"{facts.name}.forward's short conv applies activation {facts.activation}; "
            "npu_fused_causal_conv1d applies none (its activation argument is unsupported)"
        )
    if not facts.conv_weight.startswith("self."):
        facts.problems.append(
            f"{facts.name}.forward's conv weight {facts.conv_weight!r} is not an attribute of "
            "the layer, from which the conv state's shape is written"
        )
    _check_names(facts, body)
    return facts


def _check_names(facts: ShortConvFacts, body: cst.IndentedBlock) -> None:
    replaced_at = {facts.read_index, facts.conv_index}
    replaced = [s for i, s in enumerate(body.body) if i in replaced_at]
    kept = [s for i, s in enumerate(body.body) if i not in replaced_at]
    clash = EMITTED_LOCALS & (_used_names(kept) | _assigned_names(kept))
    if clash:
        facts.problems.append(
            f"{facts.name}.forward uses {sorted(clash)}, names the rewrite binds for the "
            "paged state"
        )
    leaked = (_assigned_names(replaced) - {facts.conv_target}) & _used_names(kept)
    if leaked:
        facts.problems.append(
            f"{facts.name}.forward uses {sorted(leaked)} outside the cache statements the "
            "rewrite replaces"
        )


class ShortConvCommand(StateMixerCommand):
    """Declare the conv state entry and run the fused causal conv on the paged states."""

    DESCRIPTION = "Keep short-conv states in the paged runtime's Mamba group."
    KIND = "short conv"
    is_kind = staticmethod(is_short_conv_class)
    gather = staticmethod(short_conv_facts)

    def convert(
        self, updated: cst.ClassDef, facts: ShortConvFacts, config: cst.PartialParserConfig
    ) -> cst.ClassDef:
        values = {
            "hidden": facts.hidden,
            "target": facts.conv_target,
            "source": facts.conv_source,
            "weight": facts.conv_weight,
            "bias": None if facts.conv_bias == "None" else facts.conv_bias,
        }
        entries = [
            StateEntry(
                name="conv_state",
                shape=(f"{facts.conv_weight}.size(-1) - 1", f"{facts.conv_weight}.size(0)"),
                comment="token-major: npu_fused_causal_conv1d's conv_states [lines, "
                "state_len, dim]",
            )
        ]
        replacements = {
            facts.read_index: statements("framework_shortconv_state.py.j2", config, **values),
            facts.conv_index: statements("framework_shortconv_conv.py.j2", config, **values),
        }
        return declare_states(
            updated,
            self.KIND,
            entries,
            config,
            lambda forward: splice_forward(forward, replacements),
        )


__all__ = ["ShortConvCommand", "ShortConvFacts", "is_short_conv_class", "short_conv_facts"]

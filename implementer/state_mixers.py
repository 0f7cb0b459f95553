"""Recurrent-state mixers: which kinds the tool converts, and the check that every planned
state layer has one.

Each kind is one predicate over a class (what its forward calls) here, next to the others,
and one rewrite in the registry. The check runs before any rewrite: a Plan with state
(Mamba group) layers whose modeling file holds no mixer of a known kind is refused with the
kinds looked for.
"""

from __future__ import annotations

from collections.abc import Callable

import libcst as cst
import libcst.matchers as m
from kvskill.implementer._command import FrameworkCommand
from kvskill.implementer.gated_delta import is_gated_delta_class
from kvskill.implementer.mamba2 import is_mamba2_class
from kvskill.implementer.mamba_mixer import is_mamba1_class
from kvskill.implementer.short_conv import is_short_conv_class

#: kind -> (what identifies it, the predicate)
STATE_MIXERS: dict[str, tuple[str, Callable[[cst.ClassDef], bool]]] = {
    "gated delta net": (
        "a forward that calls causal_conv1d_fn/update and a *gated_delta_rule or a Kimi "
        "delta attention",
        is_gated_delta_class,
    ),
    "Mamba-2 mixer": (
        "methods that call mamba_chunk_scan_combined (or mamba2_chunk_scan) and "
        "selective_state_update",
        is_mamba2_class,
    ),
    "Mamba-1 mixer": (
        "a forward that calls causal_conv1d_fn/update and a *selective_scan",
        is_mamba1_class,
    ),
    "short conv": (
        "a forward that calls causal_conv1d_fn/update on a cached conv state only",
        is_short_conv_class,
    ),
}


def state_mixer_classes(module: cst.Module) -> list[tuple[str, cst.ClassDef]]:
    """(kind, class) of every class of MODULE that is a known state mixer."""
    found = []
    for node in m.findall(module, m.ClassDef()):
        cls = cst.ensure_type(node, cst.ClassDef)
        for kind, (_, is_kind) in STATE_MIXERS.items():
            if is_kind(cls):
                found.append((kind, cls))
                break
    return found


def state_layer_problems(module: cst.Module, has_state_layers: bool) -> list[str]:
    """Planned state layers need a mixer of a known kind.

    NOTE: mixer code the Plan lists no state layer for is converted all the same: a hybrid
    family's file serves configs without state layers (nemotron_h with attention only), and
    a class no layer instantiates declares nothing to the runtime.
    """
    mixers = state_mixer_classes(module)
    if has_state_layers and not mixers:
        looked_for = "; ".join(f"a {kind}: {what}" for kind, (what, _) in STATE_MIXERS.items())
        return [
            "the Plan has Mamba (recurrent-state) layers but no state mixer the tool converts "
            f"was found ({looked_for}); see SKILL.md, state caches, to convert it by hand"
        ]
    return []


class StateLayersCheck(FrameworkCommand):
    """Changes nothing: refuses a conversion whose state layers have no known mixer."""

    DESCRIPTION = "Check that every planned state layer has a mixer the tool converts."

    @classmethod
    def problems(cls, module: cst.Module, spec) -> list[str]:
        return state_layer_problems(module, spec.has_state_layers)

    def visit_Module(self, node: cst.Module) -> bool:
        return False  # nothing to rewrite


__all__ = ["STATE_MIXERS", "StateLayersCheck", "state_layer_problems", "state_mixer_classes"]

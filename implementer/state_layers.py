"""Recurrent-state mixers: every kind the rewrites know, under one registry entry (KVR008).

Each kind is recognised by what its forward does and rewritten by its own command (see its
module): gated delta nets (``gated_delta.py``), Mamba-1 mixers (``mamba_mixer.py``), short convs
(``short_conv.py``). This
module checks that the code and the Plan agree on state layers and hands each class to its
kind's rewrite. A new kind adds one line to ``STATE_MIXERS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import libcst as cst
import libcst.matchers as m
from kvskill.implementer._command import ClassRewriteCommand
from kvskill.implementer.gated_delta import GatedDeltaCommand, is_gated_delta_class
from kvskill.implementer.mamba_mixer import Mamba1MixerCommand, is_mamba1_class
from kvskill.implementer.short_conv import ShortConvCommand, is_short_conv_class


@dataclass(frozen=True)
class StateMixerKind:
    """One kind of state mixer: how a refusal names it, its recogniser and its rewrite."""

    what: str
    recognise: Any
    command: type[ClassRewriteCommand]


STATE_MIXERS = (
    StateMixerKind(
        "a gated delta net (causal_conv1d_fn/update and a *gated_delta_rule or a Kimi "
        "delta attention)",
        is_gated_delta_class,
        GatedDeltaCommand,
    ),
    StateMixerKind(
        "a Mamba-1 mixer (causal_conv1d_fn/update and a *selective_scan)",
        is_mamba1_class,
        Mamba1MixerCommand,
    ),
    StateMixerKind(
        "a short conv (causal_conv1d_fn/update on a cached conv state only)",
        is_short_conv_class,
        ShortConvCommand,
    ),
)


def state_mixer_classes(module: cst.Module) -> list[cst.ClassDef]:
    """The classes of MODULE that are a state mixer of any known kind, in source order."""
    classes = [c for c in m.findall(module, m.ClassDef()) if isinstance(c, cst.ClassDef)]
    return [c for c in classes if any(kind.recognise(c) for kind in STATE_MIXERS)]


def state_layer_problems(module: cst.Module, has_state_layers: bool) -> list[str]:
    """The code and the Plan must agree that state layers exist."""
    state = state_mixer_classes(module)
    if has_state_layers and not state:
        kinds = "; ".join(kind.what for kind in STATE_MIXERS)
        return [
            "the Plan has Mamba (recurrent-state) layers but no state mixer class the "
            f"rewrites know was found ({kinds}); other state mixers (Mamba-2) are not "
            "rewritten yet"
        ]
    if state and not has_state_layers:
        return [
            f"{', '.join(c.name.value for c in state)}: recurrent-state mixer code, but the "
            "Plan lists no Mamba layer"
        ]
    return []


class StateMixersCommand(ClassRewriteCommand):
    """Every state mixer class, rewritten by its kind's command."""

    DESCRIPTION = (
        "Keep recurrent-state mixers' states (gated delta nets, Mamba-1, short convs) in the paged "
        "runtime's Mamba group."
    )

    @classmethod
    def problems(cls, module: cst.Module, spec) -> list[str]:
        found = state_layer_problems(module, spec.has_state_layers)
        return found or [p for kind in STATE_MIXERS for p in kind.command.problems(module, spec)]

    def _kind(self, cls: cst.ClassDef) -> ClassRewriteCommand | None:
        for kind in STATE_MIXERS:
            command = kind.command(self.context, self.spec, self.package)
            if command.selects(cls):
                return command
        return None

    def selects(self, cls: cst.ClassDef) -> bool:
        return self._kind(cls) is not None

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        command = self._kind(original)
        assert command is not None, "selects found the class's kind"
        return command.rewrite(original, updated)


__all__ = [
    "STATE_MIXERS",
    "StateMixerKind",
    "StateMixersCommand",
    "state_layer_problems",
    "state_mixer_classes",
]

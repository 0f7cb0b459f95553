"""The state caches a recurrent mixer declares: one generic ``__init__`` snippet for any kind.

A state mixer (Mamba-1, Mamba-2, short convolution, ...) keeps a fixed-size state per
request instead of per-token K/V. Its rewrite lists the states as ``StateEntry`` values, each
shape written as expressions over attributes the source ``__init__`` sets from the config
(``self.conv_kernel_size - 1``), and this module renders the declarations: ``attn_type``
"Mamba", one placeholder and one ``MambaCacheEntry`` per state, the dtypes the model pins,
and one ``set_<name>`` tensor setter per state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import libcst as cst
from kvskill.implementer._command import append_statements, replace_method, with_body
from kvskill.implementer.snippets import methods, statements


@dataclass(frozen=True, kw_only=True)
class StateEntry:
    """One state tensor of one request."""

    #: the cache name and the layer attribute that holds the tensor, e.g. "ssm_state"
    name: str
    #: the per-request shape as Python expressions, e.g. ("self.num_heads", "self.head_dim")
    shape: tuple[str, ...]
    #: one line the emitted code carries above the shape (orientation, what it holds)
    comment: str
    #: a dtype expression the source keeps this state in whatever the weights' dtype
    #: (``"torch.float32"``), or None for the layer's dtype
    pinned_dtype: str | None = None

    @property
    def shape_text(self) -> str:
        """The shape as a list expression (``[a, b]``): MambaCacheEntry takes a list."""
        return "[" + ", ".join(self.shape) + "]"


def with_pinned_dtypes(entries: list[StateEntry], pinned: dict[str, str]) -> list[StateEntry]:
    """ENTRIES with the dtypes PINNED names ({state name: "float32"}) pinned; an entry whose
    source already fixes its dtype keeps it."""
    return [
        replace(e, pinned_dtype=f"torch.{pinned[e.name]}")
        if e.name in pinned and not e.pinned_dtype
        else e
        for e in entries
    ]


def _pinned_text(entries: list[StateEntry]) -> str:
    pairs = [f'"{e.name}": {e.pinned_dtype}' for e in entries if e.pinned_dtype]
    return "{" + ", ".join(pairs) + "}"


def state_init_statements(
    mixer: str, entries: list[StateEntry], config: cst.PartialParserConfig
) -> list[cst.BaseStatement]:
    """The statements appended to the mixer's ``__init__``."""
    return statements(
        "framework_state_init.py.j2",
        config,
        mixer=mixer,
        entries=entries,
        pinned=_pinned_text(entries),
    )


def state_setter_methods(
    entries: list[StateEntry], config: cst.PartialParserConfig
) -> list[cst.FunctionDef]:
    """One ``set_<name>(tensor)`` method per state."""
    return methods("framework_state_methods.py.j2", config, entries=entries)


def declare_states(
    cls: cst.ClassDef,
    kind: str,
    entries: list[StateEntry],
    config: cst.PartialParserConfig,
    convert_forward: Callable[[cst.FunctionDef], cst.FunctionDef],
) -> cst.ClassDef:
    """CLS declaring ENTRIES at the end of ``__init__``, its forward converted by
    CONVERT_FORWARD, and one setter per state appended to the class."""
    init_stmts = state_init_statements(kind, entries, config)
    cls = with_body(
        cls, replace_method(cls, "__init__", lambda init: append_statements(init, init_stmts))
    )
    body = replace_method(cls, "forward", convert_forward)
    return with_body(cls, [*body, *state_setter_methods(entries, config)])


__all__ = [
    "StateEntry",
    "declare_states",
    "state_init_statements",
    "state_setter_methods",
    "with_pinned_dtypes",
]

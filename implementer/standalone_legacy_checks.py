"""Checks of the standalone-Legacy path: before the rewrites (what the Plan and the file must
be) and after them (the emitted file holds no Legacy piece and every attention reads paged).

The generic self-check (``self_check.py``) knows attention classes by a ``forward`` that
writes a cache; the standalone models write in a helper method (``exec_qkv``), so this path
checks its own result too: no silent half-conversion.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import FA_CALL, LEGACY_ROW_WRITE, method
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.spec import ConversionSpec
from kvskill.implementer.standalone_legacy_facts import standalone_attention_classes, writer_method

#: the paged write KVR024 emits
PAGED_WRITE = m.Call(func=m.Attribute(attr=m.Name("npu_scatter_nd_update_")))
#: ``block_table=md.block_table[...]``: a fused attention call reading the step's table (the
#: Legacy MLA call passes the model's own ``self.block_table``)
_BLOCK_TABLE = m.Arg(
    keyword=m.Name("block_table"),
    value=m.Subscript(value=m.Attribute(value=m.Name("md"), attr=m.Name("block_table"))),
)
_OWN_TABLE = m.Attribute(value=m.Name("self"), attr=m.Name("block_table"))


def check_standalone_legacy_module(
    module: cst.Module, spec: ConversionSpec, filename: str, problems: list[str]
) -> None:
    """PROBLEMS (the rewrites' own) plus what mode 2 needs of the Plan (full attention only).

    Raises:
        UnsupportedModelError: with every reason found, before anything is rewritten.
    """
    problems = list(problems)
    others = sorted(set(spec.attn_types) - {"FullAttention"})
    if others:
        problems.append(
            f"the Plan has {', '.join(others)} layers; the standalone-Legacy rewrite converts "
            "full-attention layers only so far"
        )
    if problems:
        raise UnsupportedModelError(f"{filename}: cannot convert: " + "; ".join(problems))


def standalone_legacy_self_check(
    original: cst.Module, converted: cst.Module, filename: str
) -> None:
    """Refuse an output that still writes or reads a Legacy row anywhere.

    Raises:
        UnsupportedModelError: naming every piece left over.
    """
    problems = []
    if m.findall(converted, LEGACY_ROW_WRITE):
        problems.append("a scatter_update_ row write is left")
    classes = {
        c.name.value: c for c in m.findall(converted, m.ClassDef()) if isinstance(c, cst.ClassDef)
    }
    for cls in standalone_attention_classes(original):
        name = cls.name.value
        before = writer_method(cls)
        after = method(classes[name], before.name.value) if before and name in classes else None
        if after is None:
            problems.append(f"{name}: its write method is gone")
            continue
        writes = m.findall(after, PAGED_WRITE)
        kernels = [cst.ensure_type(c, cst.Call) for c in m.findall(after, FA_CALL)]
        unpaged = [c for c in kernels if not any(m.matches(a, _BLOCK_TABLE) for a in c.args)]
        if len(writes) != 2 or len(kernels) != 1 or unpaged:
            problems.append(
                f"{name}.{after.name.value} writes {len(writes)} paged caches and makes "
                f"{len(kernels)} fused attention calls ({len(unpaged)} without the step's "
                "block_table); expected 2 writes and one paged call"
            )
        if m.findall(classes[name], _OWN_TABLE):
            problems.append(f"{name} still reads its own self.block_table")
    paged_heads = [c for c in classes.values() if method(c, "set_paged_step_metadata") is not None]
    if not paged_heads:
        problems.append("no model class sets the paged step metadata")
    if problems:
        raise UnsupportedModelError(
            f"{filename}: cannot convert (standalone_legacy path): the converted code failed "
            "its self-check, so nothing is written: " + "; ".join(problems)
        )


__all__ = ["check_standalone_legacy_module", "standalone_legacy_self_check"]

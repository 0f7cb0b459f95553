"""The framework's own Legacy models to its Paged contract, in place (codes KVR020, KVR021).

Input: a cann-recipes-infer model that runs the Legacy path (``framework_legacy_facts.py``
reads its attention). Output: the same file in the executor's Paged contract:

* KVR020, attention ``__init__``: ``self.cache_unit = ...`` becomes ``self.attn_type`` and
  ``cache_entries`` (``CacheEntry`` k_cache / v_cache, ``needs_block=True``) with their
  ``tensor_setter`` methods; the empty ``k_cache`` / ``v_cache`` placeholders stay.
* KVR020, attention ``forward``: the TND -> BSH packing becomes one BSH row of the packed
  step, the ``scatter_update_`` writes at ``kv_len`` and the BSH fused attention become
  ``npu_scatter_nd_update_`` at ``slot_mapping[self.attn_type]`` and a TND fused attention
  over ``block_table[self.attn_type]`` with the executor's length fields, the BSH -> TND
  unpacking becomes its decode arm; assignments only the removed code read go with it.
* KVR021, the model class: ``init_cache`` is removed, ``self.block_size`` is read from the
  scheduler config and ``get_cache_info()`` is added; with it the executor allocates paged
  caches instead of Legacy rows. The per-request states ``init_cache`` also allocates are
  KVR022's (``framework_legacy_state_codemods.py``), which runs first: it reads them there.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import is_framework_legacy_attention, method
from kvskill.implementer._command import (
    ClassRewriteCommand,
    ModelClassRewrite,
    append_statements,
    with_body,
)
from kvskill.implementer.fa_call import (
    FA_OPS,
    tnd_paged_kwargs,
)
from kvskill.implementer.framework_legacy_facts import (
    LegacyAttentionFacts,
    LegacyForward,
    gather_legacy_attention,
)
from kvskill.implementer.framework_legacy_state_facts import gather_legacy_states
from kvskill.implementer.snippets import methods, statements
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import MetadataWrapper, PositionProvider

#: where the executor defines what the converted file uses
KV_CACHE_MODULE = "executor.core.kv_cache"
METADATA_MODULE = "executor.utils.forward_metadata"
#: what ``init_cache`` may allocate for the rewrite to remove it (other states: refused)
LEGACY_CACHE_ATTRS = ("k_cache", "v_cache")


def legacy_problems(module: cst.Module) -> list[str]:
    """Why the framework-Legacy rewrite cannot convert MODULE (all reasons)."""
    found = gather_legacy_attention(module)
    if not found:
        return [
            "no framework Legacy attention found (a class whose __init__ sets self.cache_unit "
            "and whose forward writes with scatter_update_ and calls the fused attention)"
        ]
    return [problem for facts in found for problem in facts.problems]


class _LegacyAttentionRewrite(ClassRewriteCommand):
    def selects(self, cls: cst.ClassDef) -> bool:
        return is_framework_legacy_attention(cls)

    @classmethod
    def problems(cls, module: cst.Module, spec) -> list[str]:
        return legacy_problems(module)

    def visit_Module(self, node: cst.Module) -> bool:
        self.facts: dict[str, LegacyAttentionFacts] = {
            f.name: f for f in gather_legacy_attention(node)
        }
        return True


class FrameworkLegacyAttentionCommand(_LegacyAttentionRewrite):
    """Every framework Legacy attention class to Paged: ``__init__`` and ``forward`` together.

    NOTE: one rewrite for both methods, since the class stops being a Legacy attention (its
    selection rule) as soon as either is converted.
    """

    DESCRIPTION = (
        "Declare the framework Legacy attention's caches as cache_entries; replace "
        "scatter_update_ at kv_len and the BSH fused attention with npu_scatter_nd_update_ at "
        "slot_mapping and the TND paged fused attention; drop the TND <-> BSH packing."
    )

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        facts = self.facts[original.name.value]
        assert facts.forward is not None and facts.cache_unit is not None, "checked first"
        return self._convert_forward(self._convert_init(updated, facts), facts.forward)

    def _convert_init(self, updated: cst.ClassDef, facts: LegacyAttentionFacts) -> cst.ClassDef:
        """``self.cache_unit = ...`` -> ``attn_type`` and ``cache_entries``, with setters."""
        assert facts.forward is not None and facts.cache_unit is not None, "checked first"
        config = self.parser_config()
        declared = statements(
            "framework_legacy_paged_init.py.j2",
            config,
            cache_unit=facts.cache_unit,
            num_kv_heads=facts.forward.num_kv_heads,
        )
        AddImportsVisitor.add_needed_import(self.context, KV_CACHE_MODULE, "CacheEntry")
        body = []
        for stmt in updated.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
                stmt = _replace_cache_unit(stmt, declared)
            body.append(stmt)
        setters = [
            f
            for f in methods("framework_attn_methods.py.j2", config)
            if f.name.value in ("set_k_cache", "set_v_cache")
        ]
        return with_body(updated, [*body, *setters])

    def _convert_forward(self, updated: cst.ClassDef, seam: LegacyForward) -> cst.ClassDef:
        """The Legacy BSH forward -> the Paged TND seam."""
        AddImportsVisitor.add_needed_import(self.context, METADATA_MODULE, "get_forward_metadata")
        body = []
        for stmt in updated.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
                stmt = self._convert(stmt, seam)
            body.append(stmt)
        return with_body(updated, body)

    def _fa_kwargs(self, seam: LegacyForward) -> list[tuple[str, str]]:
        return tnd_paged_kwargs(
            self.spec.fa_version,
            self.spec.sparse_mode["FullAttention"],
            num_heads=seam.num_heads,
            num_kv_heads=seam.num_kv_heads,
            scale=seam.scale or "(query_tnd.shape[-1] ** -0.5)",
            block_table="md.block_table[self.attn_type]",
            block_size="block_size",
        )

    def _convert(self, forward: cst.FunctionDef, seam: LegacyForward) -> cst.FunctionDef:
        config = self.parser_config()
        old = list(cst.ensure_type(forward.body, cst.IndentedBlock).body)
        rows = statements(
            "framework_legacy_paged_rows.py.j2",
            config,
            rows=seam.rows,
            q_len=seam.q_len,
            total=seam.total,
            repacked=seam.repacked,
        )
        seam_stmts = statements(
            "framework_legacy_paged_seam.py.j2",
            config,
            query=seam.query,
            key=seam.key,
            value=seam.value,
            output=seam.output,
            rows=seam.rows,
            q_len=seam.q_len,
            num_heads=seam.num_heads,
            num_kv_heads=seam.num_kv_heads,
            op=FA_OPS[self.spec.fa_version],
            kwargs=self._fa_kwargs(seam),
        )
        removed = [old[i] for i in (*seam.write_indexes, seam.kernel_index)]
        new: list[cst.BaseStatement] = []
        for index, stmt in enumerate(old):
            if index == seam.pack_index:
                new.extend(led_by(stmt, rows))
            elif index == seam.write_indexes[0]:
                new.extend(led_by(stmt, seam_stmts))
            elif index in seam.write_indexes or index == seam.kernel_index:
                continue
            elif index == seam.unpack_index:
                arm = cst.ensure_type(cst.ensure_type(stmt, cst.If).orelse, cst.Else)
                new.extend(led_by(stmt, list(cst.ensure_type(arm.body, cst.IndentedBlock).body)))
            else:
                new.append(stmt)
        new = drop_dead_assignments(new, names_read(removed))
        block = cst.ensure_type(forward.body, cst.IndentedBlock)
        return forward.with_changes(body=block.with_changes(body=new))


def _replace_cache_unit(init: cst.FunctionDef, declared: list[cst.BaseStatement]):
    block = cst.ensure_type(init.body, cst.IndentedBlock)
    body = []
    for stmt in block.body:
        if m.matches(stmt, m.SimpleStatementLine(body=[_CACHE_UNIT])):
            first = declared[0].with_changes(
                leading_lines=[*stmt.leading_lines, *declared[0].leading_lines]
            )
            body.extend([first, *declared[1:]])
        else:
            body.append(stmt)
    return init.with_changes(body=block.with_changes(body=body))


_CACHE_UNIT = m.Assign(
    targets=[m.AssignTarget(m.Attribute(value=m.Name("self"), attr=m.Name("cache_unit")))]
)


def led_by(old: cst.BaseStatement, new: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
    """NEW, keeping the blank lines and comments that led into OLD."""
    if not new:
        return new
    lead = getattr(old, "leading_lines", ())
    return [new[0].with_changes(leading_lines=[*lead, *new[0].leading_lines]), *new[1:]]


def names_read(stmts: list[cst.BaseStatement]) -> set[str]:
    return {cst.ensure_type(n, cst.Name).value for s in stmts for n in m.findall(s, m.Name())}


def _targets(stmt: cst.BaseStatement) -> set[str] | None:
    """Names a plain ``a = ...`` / ``a, b = ...`` statement binds, else None."""
    if not m.matches(stmt, m.SimpleStatementLine(body=[m.Assign()])):
        return None
    assign = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Assign)
    names: set[str] = set()
    for target in assign.targets:
        node = target.target
        elements = node.elements if isinstance(node, cst.Tuple) else [cst.Element(node)]
        for element in elements:
            if not isinstance(element.value, cst.Name):
                return None
            names.add(element.value.value)
    return names


def drop_dead_assignments(body: list[cst.BaseStatement], candidates: set[str]):
    """BODY without the assignments to CANDIDATES (names the removed Legacy code read) that
    nothing left reads; repeated, since one removal can leave another unread."""
    while True:
        for index, stmt in enumerate(body):
            bound = _targets(stmt)
            if not bound or not bound <= candidates:
                continue
            rest = body[:index] + body[index + 1 :]
            if not bound & names_read(rest):
                body = rest
                break
        else:
            return body


class FrameworkLegacyModelCommand(ModelClassRewrite):
    """The model class: ``init_cache`` gone, ``block_size`` and ``get_cache_info()`` added."""

    DESCRIPTION = "Replace the model's Legacy init_cache with get_cache_info() (Paged caches)."

    @classmethod
    def problems(cls, module: cst.Module, spec) -> list[str]:
        found = []
        positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
        for head in m.findall(module, m.ClassDef()):
            head = cst.ensure_type(head, cst.ClassDef)
            init_cache = method(head, "init_cache")
            if init_cache is None:
                continue
            # states a layer class holds are KVR022's (its problems name what it cannot take)
            states = gather_legacy_states(module)
            converted = states.converted_attrs | set(states.unconverted)
            others = sorted(_allocated_attrs(init_cache) - set(LEGACY_CACHE_ATTRS) - converted)
            if others:
                line = positions[init_cache].start.line
                found.append(
                    f"{head.name.value}.init_cache (line {line}) also allocates "
                    f"{', '.join(others)}, not as a per-request state the state rewrite "
                    "(KVR022) reads (`<layer>.<state> = torch.<alloc>((batch, ...), ...)` on a "
                    "layer whose __init__ sets it to None); only k_cache / v_cache rows and "
                    "such states are converted to Paged entries"
                )
        return found

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        config = self.parser_config()
        init = method(updated, "__init__")
        params = [p.name.value for p in init.params.params] if init is not None else []
        if "infer_config" not in params:
            # checked by the module check: the executor builds the model with infer_config
            raise AssertionError("the framework model class takes infer_config")
        AddImportsVisitor.add_needed_import(self.context, KV_CACHE_MODULE, "LayerCacheInfo")
        AddImportsVisitor.add_needed_import(self.context, KV_CACHE_MODULE, "ModelCacheInfo")
        block_size = cst.parse_statement(
            "# the caches' tokens per block: get_cache_info() stamps it on every entry\n"
            "self.block_size = infer_config.scheduler_config.block_size\n",
            config,
        )
        body = []
        for stmt in updated.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "init_cache":
                continue
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
                stmt = append_statements(stmt, [block_size])
            body.append(stmt)
        cache_info = methods(
            "framework_cache_info.py.j2", config, shared_kv=False, compressed=False
        )
        return with_body(updated, [*body, *cache_info])


def _allocated_attrs(function: cst.FunctionDef) -> set[str]:
    """Attributes of other objects a method assigns (``layer.self_attn.k_cache = ...``)."""
    found = set()
    for target in m.findall(function, m.AssignTarget(target=m.Attribute())):
        attr = cst.ensure_type(cst.ensure_type(target, cst.AssignTarget).target, cst.Attribute)
        if not m.matches(attr.value, m.Name("self")):
            found.add(attr.attr.value)
    return found


__all__ = [
    "FrameworkLegacyAttentionCommand",
    "FrameworkLegacyModelCommand",
    "legacy_problems",
]

"""The framework's Legacy per-request states to Paged ``MambaCacheEntry`` entries (KVR022).

Input: a state layer of a cann-recipes-infer Legacy model (``framework_legacy_state_facts.py``
reads it): ``__init__`` sets its states to ``None``, ``init_cache`` gives each a
``[batch, *row]`` tensor, its methods use the whole tensor with row b = request b. Output:

* ``__init__``: ``self.<state> = None`` becomes ``attn_type = "Mamba"``, an empty placeholder
  and one ``MambaCacheEntry(shape=<row>)`` per state, with a ``set_<state>`` tensor setter;
  the executor allocates ``[num_blocks, *row]`` and ``block_table["Mamba"][b, 0]`` is request
  b's block.
* each method using a state: ``md`` / ``state_index`` (the step's blocks) are bound before
  its first alias, and every use is made at those blocks::

      rows.copy_(x)                      ->  rows[state_index] = x.to(rows.dtype)
      y = f(h, rows, ...)                ->  rows_step = rows[state_index]
                                             y = f(h, rows_step, ...)
                                             rows[state_index] = rows_step
      npu_recurrent_gated_delta_rule(q, k, v, rows, ..., actual_seq_lengths=<batch ones>,
          ssm_state_indices=<arange(batch)>)
                                         ->  the same call with actual_seq_lengths=
                                             md.actual_seq_lengths_q, ssm_state_indices=
                                             state_index (int32): the kernel reads the blocks

  A method that only overwrites states (the Legacy prefill) refuses, at run time, a step
  with tokens already cached: it would drop their state.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from kvskill.implementer._command import ClassRewriteCommand, with_body
from kvskill.implementer.framework_legacy_state_facts import (
    INDEX_KEYWORD,
    LENGTHS_KEYWORD,
    StateLayerFacts,
    StateMethodFacts,
    UseKind,
    gather_legacy_states,
)
from kvskill.implementer.snippets import statements
from kvskill.implementer.state_entries import (
    StateEntry,
    state_init_statements,
    state_setter_methods,
)
from libcst.codemod.visitors import AddImportsVisitor

KV_CACHE_MODULE = "executor.core.kv_cache"
METADATA_MODULE = "executor.utils.forward_metadata"


def legacy_state_problems(module: cst.Module) -> list[str]:
    """Why the Legacy states of MODULE cannot be converted (all reasons; none: no states)."""
    return gather_legacy_states(module).problems


class FrameworkLegacyStatesCommand(ClassRewriteCommand):
    """Every framework Legacy state layer to Paged: entries in ``__init__``, uses at blocks."""

    DESCRIPTION = (
        "Declare the framework Legacy layer's per-batch-row init_cache states as "
        "MambaCacheEntry entries and use them at block_table['Mamba'][:, 0] instead of row b."
    )

    @classmethod
    def problems(cls, module: cst.Module, spec) -> list[str]:
        return legacy_state_problems(module)

    def visit_Module(self, node: cst.Module) -> bool:
        self.layers: dict[str, StateLayerFacts] = {
            layer.name: layer for layer in gather_legacy_states(node).layers
        }
        return True

    def selects(self, cls: cst.ClassDef) -> bool:
        return cls.name.value in self.layers

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        layer = self.layers[original.name.value]
        config = self.parser_config()
        AddImportsVisitor.add_needed_import(self.context, KV_CACHE_MODULE, "MambaCacheEntry")
        AddImportsVisitor.add_needed_import(self.context, METADATA_MODULE, "get_forward_metadata")
        entries = [
            StateEntry(
                name=s.attr,
                shape=s.row_shape,
                comment=f"one request's row of the Legacy {s.attr} (init_cache line {s.line})",
            )
            for s in layer.states
        ]
        declared = state_init_statements("framework Legacy state layer", entries, config)
        body = []
        for stmt in updated.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
                stmt = _declare(stmt, layer, declared)
            elif isinstance(stmt, cst.FunctionDef) and stmt.name.value in layer.methods:
                stmt = self._convert_method(stmt, layer, layer.methods[stmt.name.value])
            body.append(stmt)
        return with_body(updated, [*body, *state_setter_methods(entries, config)])

    def _convert_method(
        self, function: cst.FunctionDef, layer: StateLayerFacts, facts: StateMethodFacts
    ) -> cst.FunctionDef:
        config = self.parser_config()
        replacements: dict[int, list[cst.BaseStatement]] = {}
        for use in facts.uses:
            if use.kind is UseKind.WRITE:
                replacements[id(use.node)] = [_indexed_write(use.node, use.alias, config)]
            elif use.kind is UseKind.INDEXED:
                replacements[id(use.node)] = [_indexed_kernel(use.node, config)]
            elif use.kind is UseKind.PASSED:
                replacements[id(use.node)] = _through_step_rows(use.node, use.alias, config)
        # NOTE: the facts hold the statements of the tree this command visits, and method
        # bodies are not visited (skip_function_bodies), so each is found by identity
        replacer = _ReplaceStatements(replacements)
        bound = statements(
            "framework_legacy_state_index.py.j2",
            config,
            fresh=facts.overwrites_only,
            where=f"{layer.name}.{facts.name}",
        )
        block = cst.ensure_type(function.body, cst.IndentedBlock)
        body: list[cst.BaseStatement] = []
        for index, stmt in enumerate(block.body):
            if id(stmt) in replacements:
                replacer.done.add(id(stmt))
                new = replacements[id(stmt)]
            else:
                new = [cst.ensure_type(stmt.visit(replacer), cst.BaseStatement)]
            if index == facts.first_index:
                # the step's blocks are bound first, led by what led into the statement
                new = [*_led_by(new[0], bound), new[0].with_changes(leading_lines=()), *new[1:]]
            body.extend(new)
        assert replacer.done == set(replacements), "every state use found in the method"
        return function.with_changes(body=block.with_changes(body=body))


class _ReplaceStatements(cst.CSTTransformer):
    """Replaces statements, found by identity, with lists of statements (in any block)."""

    def __init__(self, replacements: dict[int, list[cst.BaseStatement]]) -> None:
        super().__init__()
        self.replacements = replacements
        self.done: set[int] = set()

    def on_leave(self, original, updated):
        new = self.replacements.get(id(original))
        if new is None:
            return updated
        self.done.add(id(original))
        return cst.FlattenSentinel(new)


def _led_by(old: cst.BaseStatement, new: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
    """NEW, with the blank lines and comments that led into OLD moved before it."""
    lead = getattr(old, "leading_lines", ())
    return [new[0].with_changes(leading_lines=[*lead, *new[0].leading_lines]), *new[1:]]


def _declare(init: cst.FunctionDef, layer: StateLayerFacts, declared) -> cst.FunctionDef:
    """``self.<state> = None`` lines go; the declarations take the first one's place."""
    names = {s.attr for s in layer.states}
    none_assign = m.SimpleStatementLine(
        body=[
            m.Assign(
                targets=[
                    m.AssignTarget(
                        target=m.Attribute(
                            value=m.Name("self"),
                            attr=m.Name(value=m.MatchIfTrue(lambda v: v in names)),
                        )
                    )
                ],
                value=m.Name("None"),
            )
        ]
    )
    block = cst.ensure_type(init.body, cst.IndentedBlock)
    body: list[cst.BaseStatement] = []
    placed = False
    for stmt in block.body:
        if m.matches(stmt, none_assign):
            if not placed:
                lead = cst.ensure_type(stmt, cst.SimpleStatementLine).leading_lines
                body.append(declared[0].with_changes(leading_lines=[*lead]))
                body.extend(declared[1:])
                placed = True
            continue
        body.append(stmt)
    assert placed, "is_framework_legacy_state_layer saw the None assignments"
    return init.with_changes(body=block.with_changes(body=body))


def _indexed_write(stmt: cst.BaseStatement, alias: str, config) -> cst.BaseStatement:
    call = cst.ensure_type(
        cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Expr).value,
        cst.Call,
    )
    value = call.args[0].value
    source = cst.Module(body=[]).code_for_node(value)
    if not isinstance(value, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)):
        source = f"({source})"
    new = cst.parse_statement(f"{alias}[state_index] = {source}.to({alias}.dtype)\n", config)
    return new.with_changes(leading_lines=stmt.leading_lines)


def _indexed_kernel(stmt: cst.BaseStatement, config) -> cst.BaseStatement:
    replaced = {
        INDEX_KEYWORD: "state_index.to(torch.int32)",
        # one token per request, as the Legacy decode fed (its lengths were per batch row)
        LENGTHS_KEYWORD: "md.actual_seq_lengths_q.to(torch.int32)",
    }

    class _Keywords(cst.CSTTransformer):
        def leave_Arg(self, original: cst.Arg, updated: cst.Arg) -> cst.Arg:
            if updated.keyword is not None and updated.keyword.value in replaced:
                value = cst.parse_expression(replaced[updated.keyword.value], config)
                return updated.with_changes(value=value)
            return updated

    return cst.ensure_type(stmt.visit(_Keywords()), cst.BaseStatement)


def _through_step_rows(stmt: cst.BaseStatement, alias: str, config) -> list[cst.BaseStatement]:
    step = f"{alias}_step"

    class _Rename(cst.CSTTransformer):
        def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
            return updated.with_changes(value=step) if updated.value == alias else updated

    gather = cst.parse_statement(
        f"{step} = {alias}[state_index]  # this step's requests' states, in step order\n",
        config,
    )
    scatter = cst.parse_statement(f"{alias}[state_index] = {step}\n", config)
    call = cst.ensure_type(stmt.visit(_Rename()), cst.BaseStatement)
    return [
        gather.with_changes(leading_lines=stmt.leading_lines),
        call.with_changes(leading_lines=[]),
        scatter,
    ]


__all__ = ["FrameworkLegacyStatesCommand", "legacy_state_problems"]

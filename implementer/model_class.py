"""Model class: the ``*ForCausalLM`` holds ``block_size`` and implements ``get_cache_info``.

The class is found by structure (its ``__init__`` assigns ``self.lm_head``). ``block_size`` is
a plain attribute, so a launcher can change it before the runtime allocates the pools.
"""

from __future__ import annotations

import libcst as cst
from kvskill.implementer._command import FrameworkCommand, replace_method
from kvskill.implementer.facts import LM_HEAD_ASSIGN, is_causal_lm_class, m
from kvskill.implementer.snippets import methods

#: ``def get_cache_info`` already present: the class is converted
GET_CACHE_INFO = m.FunctionDef(name=m.Name("get_cache_info"))


def insert_after_lm_head(init: cst.FunctionDef, stmt: cst.BaseStatement) -> cst.FunctionDef:
    """INIT with STMT right after its ``self.lm_head = ...`` line."""
    block = cst.ensure_type(init.body, cst.IndentedBlock)
    inner = []
    for line in block.body:
        inner.append(line)
        if m.matches(line, m.SimpleStatementLine(body=[LM_HEAD_ASSIGN])):
            inner.append(stmt)
    return init.with_changes(body=block.with_changes(body=inner))


class CacheInfoCommand(FrameworkCommand):
    """Add ``self.block_size`` after ``self.lm_head`` and the ``get_cache_info`` method."""

    DESCRIPTION = "Report every layer's cache entries through get_cache_info()."

    def skip_function_bodies(self) -> bool:
        return True

    def leave_ClassDef(
        self, original_node: cst.ClassDef, updated_node: cst.ClassDef
    ) -> cst.ClassDef:
        if not is_causal_lm_class(original_node) or m.findall(original_node.body, GET_CACHE_INFO):
            return updated_node
        config = self.parser_config()
        block_size = cst.parse_statement(
            f"self.block_size = {self.spec.block_size}  # tokens per KV block; the runtime may change it\n",
            config,
        )
        body = replace_method(
            updated_node, "__init__", lambda init: insert_after_lm_head(init, block_size)
        )
        body.extend(methods("framework_cache_info.py.j2", config))
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))

"""Model class: the ``*ForCausalLM`` holds ``block_size`` and implements ``get_cache_info``.

The class is found by structure (``gather.causal_lm_classes``: it assigns ``self.lm_head``, or
it is the class the config names, or it assigns a Linear to the vocabulary). ``block_size`` is
a plain attribute, so a launcher can change it before the runtime allocates the pools.
"""

from __future__ import annotations

import libcst as cst
from kvskill.analyzer.gather import VOCAB_HEAD_ASSIGN
from kvskill.implementer._command import ModelClassRewrite, replace_method, with_body
from kvskill.implementer.facts import LM_HEAD_ASSIGN, m
from kvskill.implementer.snippets import methods


def add_cache_info(
    cls: cst.ClassDef,
    block_size: int,
    cache_info: list[cst.FunctionDef],
    parser_config: cst.PartialParserConfig,
) -> cst.ClassDef:
    """CLS with ``self.block_size`` right after its head (``self.lm_head = ...``, else a Linear
    to the vocabulary, else the end of ``__init__``) and CACHE_INFO added."""
    block_size_stmt = cst.parse_statement(
        f"self.block_size = {block_size}  # tokens per KV block; the runtime may change it\n",
        parser_config,
    )

    def after_lm_head(init: cst.FunctionDef) -> cst.FunctionDef:
        block = cst.ensure_type(init.body, cst.IndentedBlock)
        for head in (LM_HEAD_ASSIGN, VOCAB_HEAD_ASSIGN):
            line = m.SimpleStatementLine(body=[head])
            if any(m.matches(stmt, line) for stmt in block.body):
                inner = []
                for stmt in block.body:
                    inner.append(stmt)
                    if m.matches(stmt, line):
                        inner.append(block_size_stmt)
                return init.with_changes(body=block.with_changes(body=inner))
        return init.with_changes(body=block.with_changes(body=[*block.body, block_size_stmt]))

    return with_body(cls, [*replace_method(cls, "__init__", after_lm_head), *cache_info])


class CacheInfoCommand(ModelClassRewrite):
    """Add ``self.block_size`` after the head and the ``get_cache_info`` method."""

    DESCRIPTION = "Report every layer's cache entries through get_cache_info()."

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        config = self.parser_config()
        cache_info = methods(
            "framework_cache_info.py.j2",
            config,
            shared_kv=self.spec.reads_shared_kv is not None,
            compressed=getattr(self.spec, "compressed_attention", False),
        )
        return add_cache_info(updated, self.spec.block_size, cache_info, config)

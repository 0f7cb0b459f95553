"""The base of every codemod, and the class-body edits the codemods share.

``FrameworkCommand`` is a libcst command that carries the spec of its conversion path (and the
dotted package of the source file). ``ClassRewriteCommand`` is the shape most rewrites have:
pick the classes it serves, skip those already converted, rewrite each whole class. Every
attention rewrite skips by one rule, ``gather.is_converted_attention`` (declared caches that
the forward writes and reads), so the ``__init__`` and ``forward`` rewrites never disagree
about a class; a class that meets only half of it is refused by the checks before any runs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import (
    causal_lm_classes,
    is_attention_class,
    is_converted_attention,
)
from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import MetadataWrapper

#: ``def get_cache_info`` already present: the model class is converted
GET_CACHE_INFO = m.FunctionDef(name=m.Name("get_cache_info"))


class FrameworkCommand(VisitorBasedCodemodCommand):
    """A codemod with one concern, parameterised by the analyzer's decisions."""

    def __init__(self, context: CodemodContext, spec: Any, package: str | None = None) -> None:
        super().__init__(context)
        #: ConversionSpec or MlaSpec: the values the emitted code depends on
        self.spec = spec
        #: dotted package of the source file ("transformers.models.qwen3"); None for a
        #: model directory
        self.package = package

    @classmethod
    def problems(cls, module: cst.Module, spec: Any) -> list[str]:
        """Why this rewrite cannot convert MODULE; checked for every rewrite of a path before
        any of them runs, so a refusal names every reason and nothing is half-converted."""
        return []

    def skip_function_bodies(self) -> bool:
        """Commands that rewrite whole classes do not descend into function bodies (they
        inspect them with matchers on ``original_node``); visiting every expression of a
        large modeling file several times is most of the cost of a conversion."""
        return False

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return not self.skip_function_bodies()

    @contextmanager
    def _handle_metadata_reference(self, module: cst.Module) -> Iterator[cst.Module]:
        # NOTE: libcst wraps the module for metadata before every transform, and the wrapper
        # deep-copies the whole tree; no command here reads metadata, so the tree is wrapped
        # as it is (libcst's own hook, pinned in constraints.txt)
        if self.METADATA_DEPENDENCIES:
            with super()._handle_metadata_reference(module) as tree:
                yield tree
            return
        old = self.context.wrapper
        wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
        self.context = dataclasses.replace(self.context, wrapper=wrapper)
        try:
            yield wrapper.module
        finally:
            self.context = dataclasses.replace(self.context, wrapper=old)

    def _instantiate_and_run(self, transform: type, tree: cst.Module) -> cst.Module:
        if transform is AddImportsVisitor:
            return add_imports_at_top(self.context, tree)
        return super()._instantiate_and_run(transform, tree)

    def parser_config(self) -> cst.PartialParserConfig:
        """Parse snippets with the file's own newline and indentation conventions."""
        module = self.context.module
        if module is None:
            return cst.PartialParserConfig()
        return module.config_for_parsing


def add_imports_at_top(context: CodemodContext, tree: cst.Module) -> cst.Module:
    """TREE with the imports CONTEXT asks for (``AddImportsVisitor``), visiting only its
    top-level statements.

    ``AddImportsVisitor`` reads and edits only the import lines at the top of a module, and
    inserts after them; it walks every class and function body to find that out, which costs
    as much as a rewrite. Each compound statement is replaced by a one-line stand-in carrying
    its leading lines (the visitor may add an empty line before the first statement after the
    imports), the visitor runs on that skeleton, and the statements are put back.
    """
    held: dict[str, cst.BaseCompoundStatement] = {}
    skeleton = []
    for index, stmt in enumerate(tree.body):
        if isinstance(stmt, cst.BaseCompoundStatement):
            marker = f"__kvskill_statement_{index}"
            held[marker] = stmt
            stmt = cst.SimpleStatementLine(
                body=[cst.Expr(cst.Name(marker))], leading_lines=stmt.leading_lines
            )
        skeleton.append(stmt)
    added = AddImportsVisitor(context).transform_module(tree.with_changes(body=skeleton))
    body = []
    for stmt in added.body:
        marker = _stand_in_marker(stmt)
        if marker in held:
            original = held[marker]
            if stmt.leading_lines != original.leading_lines:
                original = original.with_changes(leading_lines=stmt.leading_lines)
            stmt = original
        body.append(stmt)
    return added.with_changes(body=body)


def _stand_in_marker(stmt: cst.BaseStatement) -> str | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        expr = stmt.body[0]
        if isinstance(expr, cst.Expr) and isinstance(expr.value, cst.Name):
            return expr.value.value
    return None


class ClassRewriteCommand(FrameworkCommand):
    """Rewrites every class ``selects`` picks, as a whole; leaves all others untouched."""

    def selects(self, cls: cst.ClassDef) -> bool:
        raise NotImplementedError

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        raise NotImplementedError

    def skip_function_bodies(self) -> bool:
        return True

    def leave_ClassDef(
        self, original_node: cst.ClassDef, updated_node: cst.ClassDef
    ) -> cst.ClassDef:
        if not self.selects(original_node):
            return updated_node
        return self.rewrite(original_node, updated_node)


@functools.lru_cache(maxsize=64)
def _gathered(gather: Callable[[cst.ClassDef], Any], node: cst.ClassDef) -> Any:
    """GATHER's facts of NODE. libcst nodes compare and hash by identity, so a class the
    earlier rewrites left untouched is read once for its problems, selection and rewrite."""
    return gather(node)


class StateMixerCommand(ClassRewriteCommand):
    """The rewrite of one kind of recurrent-state mixer (gated delta net, Mamba-1, Mamba-2,
    short conv): which classes are of the kind, their facts, and the conversion of one class
    from its facts. The facts carry ``problems`` (why the class cannot be converted) and
    ``converted`` (already declares its states)."""

    #: the kind, as messages name it ("Mamba-2 mixer")
    KIND = ""

    @staticmethod
    def is_kind(node: cst.ClassDef) -> bool:
        raise NotImplementedError

    @staticmethod
    def gather(node: cst.ClassDef) -> Any:
        raise NotImplementedError

    def convert(
        self, updated: cst.ClassDef, facts: Any, config: cst.PartialParserConfig
    ) -> cst.ClassDef:
        raise NotImplementedError

    @classmethod
    def facts_of(cls, node: cst.ClassDef) -> Any:
        return _gathered(cls.gather, node)

    @classmethod
    def problems(cls, module: cst.Module, spec: Any) -> list[str]:
        # NOTE: whether the Plan's state layers have a mixer at all is state_mixers' check
        classes = [c for c in m.findall(module, m.ClassDef()) if isinstance(c, cst.ClassDef)]
        return [p for c in classes if cls.is_kind(c) for p in cls.facts_of(c).problems]

    def selects(self, cls: cst.ClassDef) -> bool:
        return self.is_kind(cls) and not self.facts_of(cls).converted

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        facts = self.facts_of(original)
        assert not facts.problems, f"the pipeline validates {self.KIND} facts first"
        return self.convert(updated, facts, self.parser_config())


def selects_attention(cls: cst.ClassDef) -> bool:
    """The skip rule of every attention rewrite: an attention class not yet converted."""
    return is_attention_class(cls) and not is_converted_attention(cls)


class AttentionInitRewrite(ClassRewriteCommand):
    """Serves attention classes not yet converted: declares their caches in ``__init__``."""

    def selects(self, cls: cst.ClassDef) -> bool:
        return selects_attention(cls)


class AttentionForwardRewrite(ClassRewriteCommand):
    """Serves attention classes not yet converted: rewrites their ``forward``."""

    def selects(self, cls: cst.ClassDef) -> bool:
        return selects_attention(cls)


class ModelClassRewrite(ClassRewriteCommand):
    """Serves the causal-LM head class (``gather.causal_lm_classes``) until it has
    ``get_cache_info``."""

    def visit_Module(self, node: cst.Module) -> bool:
        #: the head classes are a fact of the whole file (the head may sit in an inner module)
        self.heads = set(causal_lm_classes(node, getattr(self.spec, "causal_lm_class", None)))
        return True

    def selects(self, cls: cst.ClassDef) -> bool:
        return cls.name.value in self.heads and not m.findall(cls.body, GET_CACHE_INFO)


def replace_method(
    cls: cst.ClassDef, name: str, change: Callable[[cst.FunctionDef], cst.FunctionDef]
) -> list[cst.BaseStatement]:
    """The statements of CLS's body, with the method NAME replaced by ``change(method)``."""
    body = []
    for stmt in cls.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == name:
            stmt = change(stmt)
        body.append(stmt)
    return body


def with_body(cls: cst.ClassDef, body: list[cst.BaseStatement]) -> cst.ClassDef:
    """CLS with its body statements replaced by BODY."""
    return cls.with_changes(body=cls.body.with_changes(body=body))


def append_statements(function: cst.FunctionDef, stmts: list[cst.BaseStatement]) -> cst.FunctionDef:
    """FUNCTION with STMTS added after its last statement."""
    block = cst.ensure_type(function.body, cst.IndentedBlock)
    return function.with_changes(body=block.with_changes(body=[*block.body, *stmts]))

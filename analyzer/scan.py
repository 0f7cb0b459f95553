"""Facts from a modeling file, read with libcst (never imported or executed).

The scan records what the decisions need, each with its line number: the attention classes
and their cache write (``cache.update`` in transformers 5, ``past_key_value.update`` in
transformers 4 style code), the attention call (``attention_interface(...)``, SDPA, eager),
learnable sinks, soft-capping, the rope style, the decoder layer / model / ``*ForCausalLM``
classes, and signs of code that is already paged (``cache_entries``, ``get_cache_info``) or
uses the Legacy framework path (``cache_unit`` + ``scatter_update_``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.config_branch import ConfigBranch, config_branches
from kvskill.analyzer.gather import cache_cat_growth, classify_call, dotted_name, parsed_module
from kvskill.core.errors import UnsupportedModelError

_SINK_NAMES = ("sinks", "s_aux", "learnable_sink", "attention_sinks")
_SOFTCAP_NAMES = ("softcap", "attn_logit_softcapping", "logit_softcapping")


@dataclass(frozen=True, kw_only=True)
class CallFact:
    """One call found in a class method."""

    #: "cache_update" | "attention_call" | "linear_attention_call" | "scatter_update" | "fa_call"
    #: | "sparse_fa_call"
    kind: str
    callee: str
    #: the receiver of a method call ("cache", "past_key_value", "self"), or ""
    receiver: str
    method: str
    line: int
    #: keyword argument names passed
    keywords: tuple[str, ...] = ()


@dataclass(kw_only=True)
class ClassFacts:
    """What one class in the modeling file contains."""

    name: str
    line: int
    bases: list[str]
    methods: dict[str, int] = field(default_factory=dict)
    calls: list[CallFact] = field(default_factory=list)
    #: ``self.X = ...`` assignments anywhere in the class -> first line
    self_attrs: dict[str, int] = field(default_factory=dict)
    #: ``self.X = <expr>`` in ``__init__`` -> the source of the first such expression
    init_attr_exprs: dict[str, str] = field(default_factory=dict)
    #: names read anywhere in the class (``self.sinks``, ``softcap=``) -> first line
    names_used: dict[str, int] = field(default_factory=dict)
    #: ``self.X = SomeClass(...)`` (also inside ModuleList comprehensions) -> class names
    attr_classes: dict[str, list[str]] = field(default_factory=dict)
    #: ``self.X = nn.ModuleList([...])`` / ``nn.ModuleDict({...})`` whose length is written in
    #: the code (a literal list or dict, or a comprehension over a literal or ``range(N)``):
    #: X -> that length (LongCat-Flash's two attention sublayers per decoder layer)
    attr_counts: dict[str, int] = field(default_factory=dict)
    #: ``num_key_value_heads = config.num_key_value_heads * N if <sliding test> else ...``
    #: in ``__init__`` (MiMo-V2-Flash): (N, line)
    sliding_kv_head_factor: tuple[int, int] | None = None
    #: names of plain functions called anywhere in the class (``apply_rotary_pos_emb``)
    function_calls: set[str] = field(default_factory=set)
    #: ``self.<module>(...)`` calls in ``forward``, in source order: (attribute, line)
    module_calls: list[tuple[str, int]] = field(default_factory=list)

    def first_call(self, kind: str) -> CallFact | None:
        return next((c for c in self.calls if c.kind == kind), None)


@dataclass(kw_only=True)
class ModuleFacts:
    """Facts of one modeling file."""

    path: str
    file_name: str
    num_lines: int
    classes: dict[str, ClassFacts] = field(default_factory=dict)
    #: module-level functions -> line
    functions: dict[str, int] = field(default_factory=dict)
    #: parameter names of module-level functions (for ``s_aux`` in eager attention)
    function_params: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: imported module paths ("transformers.cache_utils", "kvskill.runtime") -> line
    imports: dict[str, int] = field(default_factory=dict)
    #: names taken with ``from module import name``, as "module.name" -> line
    imported_names: dict[str, int] = field(default_factory=dict)
    #: ``config.X`` attributes read anywhere -> first line
    config_reads: dict[str, int] = field(default_factory=dict)
    #: ``if <param> is [not] None:`` branches of attention forwards the config decides
    #: (``analyzer/config_branch.py``): Falcon's ``if alibi is None:``
    config_branches: list[ConfigBranch] = field(default_factory=list)

    def where(self, line: int) -> str:
        return f"{self.file_name}:{line}"


@lru_cache(maxsize=512)
def _scan_cached(path: str, mtime_ns: int, size: int) -> ModuleFacts:
    from kvskill.core.inputs import read_source

    return scan_source(read_source(Path(path)), path=path)


def scan_file(path: str) -> ModuleFacts:
    """Scan a file once per (path, mtime, size); repeated calls return the cached facts."""
    stat = os.stat(path)
    return _scan_cached(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


def scan_source(source: str, *, path: str = "<memory>") -> ModuleFacts:
    """Parse ``source`` with libcst and collect the facts. Unparsable code is refused."""
    from kvskill.core.inputs import check_source_depth

    # libcst's native parser would overflow the C stack on deep nesting (a segfault)
    check_source_depth(source, path=os.path.basename(path))
    try:
        module = parsed_module(source)
    except cst.ParserSyntaxError as exc:
        raise UnsupportedModelError(
            f"cannot parse {os.path.basename(path)} at line {exc.raw_line}: "
            "the modeling code is not valid Python"
        ) from exc
    facts = ModuleFacts(
        path=path, file_name=os.path.basename(path), num_lines=source.count("\n") + 1
    )
    _Collector(module, _LineLocator(source), facts).collect()
    facts.config_branches = config_branches(module, source)
    return facts


class _LineLocator:
    """Line numbers without libcst's position metadata (which costs ~3x the parse).

    Definitions are found by their ``class``/``def`` line; a call is found as the n-th
    occurrence of its first source line after the enclosing definition. libcst visits in
    source order, so the n-th visited identical call is the n-th occurrence in the text.
    """

    def __init__(self, source: str) -> None:
        self.lines = source.splitlines()

    def definition(self, keyword: str, name: str, start: int = 1, indent: str | None = None) -> int:
        pattern = re.compile(rf"^(\s*){keyword}\s+{re.escape(name)}\b")
        for number in range(max(start, 1), len(self.lines) + 1):
            match = pattern.match(self.lines[number - 1])
            if match and (indent is None or match.group(1) == indent):
                return number
        return start

    def occurrence(self, snippet: str, start: int, nth: int) -> int:
        seen = 0
        for number in range(max(start, 1), len(self.lines) + 1):
            if snippet in self.lines[number - 1]:
                if seen == nth:
                    return number
                seen += 1
        return start


class _Collector(cst.CSTVisitor):
    """One traversal of the module; tracks the enclosing class and method."""

    def __init__(self, module: cst.Module, locator: _LineLocator, facts: ModuleFacts) -> None:
        super().__init__()
        self.module = module
        self.locator = locator
        self.facts = facts
        self.cls: ClassFacts | None = None
        self.method: str | None = None
        self.method_line = 1
        self.depth = 0  # nesting of classes/functions (only top-level classes are recorded)
        self.seen: dict[str, int] = {}

    def collect(self) -> None:
        self.module.visit(self)

    # -- definitions -------------------------------------------------------------------
    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.depth += 1
        if self.depth != 1:
            return
        name = node.name.value
        line = self.locator.definition("class", name, indent="")
        bases = [dotted_name(arg.value) for arg in node.bases]
        self.cls = ClassFacts(name=name, line=line, bases=[b for b in bases if b])
        self.method_line = line
        self.facts.classes[name] = self.cls

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.cls = None

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.depth += 1
        name = node.name.value
        params = [p.name.value for p in node.params.params + node.params.kwonly_params]
        if self.depth == 1:
            self.facts.functions[name] = self.locator.definition("def", name, indent="")
            self.facts.function_params[name] = tuple(params)
        elif self.depth == 2 and self.cls is not None:
            start = self.locator.definition("def", name, start=self.cls.line)
            self.cls.methods.setdefault(name, start)
            self.method, self.method_line, self.seen = name, start, {}
            for param in params:
                if param in _WATCHED_NAMES:
                    self.cls.names_used.setdefault(param, start)
            if name != "__init__" and _CONTAINER_CLASS.search(self.cls.name):
                # NOTE: only the constructors of model / head classes carry facts (which
                # classes they build); their forward bodies are large and skipped for speed.
                return False
        return True

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.depth -= 1
        if self.depth == 1 and self.cls is not None:
            self.method = None

    # NOTE: subtrees that never hold a fact are not descended into (speed).
    def visit_Annotation(self, node: cst.Annotation) -> bool:
        return False

    def visit_Decorator(self, node: cst.Decorator) -> bool:
        return False

    def visit_SimpleString(self, node: cst.SimpleString) -> bool:
        return False

    # -- imports -----------------------------------------------------------------------
    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        module = "." * len(node.relative) + (dotted_name(node.module) if node.module else "")
        if module:
            self._import(module)
        if module and not isinstance(node.names, cst.ImportStar):
            line = self.facts.imports.get(module, 1)
            for alias in node.names:
                self.facts.imported_names.setdefault(f"{module}.{dotted_name(alias.name)}", line)

    def visit_Import(self, node: cst.Import) -> None:
        for alias in node.names:
            self._import(dotted_name(alias.name))

    def _import(self, name: str) -> None:
        if name and name not in self.facts.imports:
            tail = name.lstrip(".").split(".")[-1]
            self.facts.imports[name] = self.locator.occurrence(tail, 1, 0) if tail else 1

    # -- facts inside classes ----------------------------------------------------------
    def visit_Call(self, node: cst.Call) -> None:
        if self.cls is None:
            return
        if isinstance(node.func, cst.Name):
            self.cls.function_calls.add(node.func.value)
        keywords = tuple(a.keyword.value for a in node.args if a.keyword is not None)
        for keyword in keywords:
            if keyword in _WATCHED_NAMES:
                where = self.locator.occurrence(f"{keyword}=", self.method_line, 0)
                self.cls.names_used.setdefault(keyword, where)
        if self.method == "forward":
            self._forward_call(node)
        fact_kind = classify_call(node)
        if fact_kind is None:
            return
        kind, callee, receiver = fact_kind
        kind = kind.value
        snippet = self.module.code_for_node(node.func).strip().splitlines()[0] + "("
        nth = self.seen.get(snippet, 0)
        self.seen[snippet] = nth + 1
        self.cls.calls.append(
            CallFact(
                kind=kind,
                callee=callee,
                receiver=receiver,
                method=self.method or "",
                line=self.locator.occurrence(snippet, self.method_line, nth),
                keywords=keywords,
            )
        )

    def _forward_call(self, node: cst.Call) -> None:
        """Module calls of an attention forward (``analyzer/qkv_split`` reads the fused
        projection's cut)."""
        assert self.cls is not None
        func = node.func
        if isinstance(func, cst.Attribute) and m.matches(func.value, m.Name("self")):
            snippet = f"self.{func.attr.value}("
            nth = self.seen.get(snippet, 0)
            self.seen[snippet] = nth + 1
            line = self.locator.occurrence(snippet, self.method_line, nth)
            self.cls.module_calls.append((func.attr.value, line))

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        if self.cls is None:
            return
        target = node.target
        if isinstance(target, cst.Attribute) and dotted_name(target.value) == "self":
            name = target.attr.value
        elif isinstance(target, cst.Name) and self.method is None:
            name = target.value  # class attribute
        else:
            return
        if name not in self.cls.self_attrs:
            where = self.locator.occurrence(name, self.method_line, 0)
            self.cls.self_attrs[name] = where

    def visit_Assign(self, node: cst.Assign) -> None:
        if self.cls is None:
            return
        if self.method is not None and cache_cat_growth(node) is not None:
            # a tuple cache grown with torch.cat: the cache write of 4.x-era vendor files
            snippet = self.module.code_for_node(node).strip().splitlines()[0]
            nth = self.seen.get(snippet, 0)
            self.seen[snippet] = nth + 1
            self.cls.calls.append(
                CallFact(
                    kind="cache_update",
                    callee="cat",
                    receiver=dotted_name(cst.ensure_type(node.value, cst.Call).func),
                    method=self.method,
                    line=self.locator.occurrence(snippet, self.method_line, nth),
                )
            )
        if self.method == "__init__" and self.cls.sliding_kv_head_factor is None:
            factor = _sliding_head_factor(node)
            if factor is not None:
                line = self.locator.occurrence("num_key_value_heads", self.method_line, 0)
                self.cls.sliding_kv_head_factor = (factor, line)
        for target in node.targets:
            expr = target.target
            if isinstance(expr, cst.Attribute) and dotted_name(expr.value) == "self":
                if self.method == "__init__":
                    self.cls.init_attr_exprs.setdefault(
                        expr.attr.value, self.module.code_for_node(node.value)
                    )
                called = _CalledNames()
                node.value.visit(called)
                if called.names:
                    self.cls.attr_classes.setdefault(expr.attr.value, called.names)
                count = module_container_count(node.value)
                if count is not None:
                    self.cls.attr_counts.setdefault(expr.attr.value, count)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if isinstance(node.value, cst.Name) and node.value.value == "config":
            attr = node.attr.value
            if attr not in self.facts.config_reads:
                where = self.locator.occurrence(f"config.{attr}", 1, 0)
                self.facts.config_reads[attr] = where

    def visit_Name(self, node: cst.Name) -> None:
        if self.cls is not None and node.value in _WATCHED_NAMES:
            where = self.locator.occurrence(node.value, self.method_line, 0)
            self.cls.names_used.setdefault(node.value, where)


def module_container_count(value: cst.BaseExpression) -> int | None:
    """How many modules ``nn.ModuleList(...)`` / ``nn.ModuleDict(...)`` holds when the code
    says it: a literal list or dict, or one comprehension over a literal or ``range(N)``."""
    if not isinstance(value, cst.Call) or len(value.args) != 1:
        return None
    if dotted_name(value.func).split(".")[-1] not in ("ModuleList", "ModuleDict"):
        return None
    arg = value.args[0].value
    if isinstance(arg, (cst.List, cst.Tuple, cst.Dict)):
        elements = arg.elements
        if any(isinstance(e, (cst.StarredElement, cst.StarredDictElement)) for e in elements):
            return None
        return len(elements)
    if isinstance(arg, (cst.ListComp, cst.DictComp)):
        loop = arg.for_in
        if loop.inner_for_in is not None or loop.ifs:
            return None
        return _literal_length(loop.iter)
    return None


def _literal_length(node: cst.BaseExpression) -> int | None:
    """Length of a literal list / tuple or of ``range(N)`` with an integer N, else None."""
    if isinstance(node, (cst.List, cst.Tuple)):
        if any(isinstance(e, cst.StarredElement) for e in node.elements):
            return None
        return len(node.elements)
    if (
        isinstance(node, cst.Call)
        and dotted_name(node.func) == "range"
        and len(node.args) == 1
        and isinstance(node.args[0].value, cst.Integer)
    ):
        return int(node.args[0].value.evaluated_value)
    return None


class _CalledNames(cst.CSTVisitor):
    """Names of capitalised callees in an expression (the classes it instantiates)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def visit_Call(self, node: cst.Call) -> None:
        name = dotted_name(node.func).split(".")[-1]
        if name[:1].isupper() and name not in self.names:
            self.names.append(name)


#: model / head classes: the analyzer needs their ``__init__`` only
_CONTAINER_CLASS = re.compile(r"(Model|For[A-Z]\w*)$")

#: ``mscale_all_dim`` read in an attention class: the class applies YaRN's attention
#: temperature to its softmax scale itself (DeepSeek's hub files)
_WATCHED_NAMES = frozenset(
    _SINK_NAMES + _SOFTCAP_NAMES + ("cache_unit", "cache_entries", "mscale_all_dim")
)


_SLIDING_WORDS = ("swa", "sliding")


def _sliding_head_factor(node: cst.Assign) -> int | None:
    """N of ``num_key_value_heads = <x> * N if <sliding test> else <x>``, else None."""
    (target,) = node.targets if len(node.targets) == 1 else (None,)
    if target is None or not m.matches(target.target, m.Name("num_key_value_heads")):
        return None
    value = node.value
    if not isinstance(value, cst.IfExp) or not isinstance(value.body, cst.BinaryOperation):
        return None
    test = cst.Module(body=[]).code_for_node(value.test).lower()
    body = value.body
    if not isinstance(body.operator, cst.Multiply) or not any(w in test for w in _SLIDING_WORDS):
        return None
    if "not " in test or "!=" in test:
        return None  # the multiplied branch may be the full layers': not read, not guessed
    factor = body.right if isinstance(body.right, cst.Integer) else body.left
    return int(factor.value) if isinstance(factor, cst.Integer) else None

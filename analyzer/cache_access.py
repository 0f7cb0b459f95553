"""Which declared caches a call writes or reads: the facts behind "the forward touches its
``cache_entries``", shared by lint (KV013) and the implementer's self-check.

A class declares its caches as ``CacheEntry(cache_name="k_cache", ...)`` in ``__init__`` and
holds each one as ``self.<cache_name>``. A call *writes* an entry when it is a cache-write
operator (``npu_scatter_nd_update_``, ``scatter_update_``, ``npu_kv_rmsnorm_rope_cache``)
whose arguments reach ``self.<entry>``, or a call of a helper method that writes it (the
generated ``self.update_cache(...)``); a call *reads* an entry when it is the fused attention
and its arguments reach ``self.<entry>``. "Reach" follows local names bound from it
(``nope_nz = self.nz_view(self.nope_cache)``, ``for cache, value in ((self.k_cache, k), ...)``).

Everything here is per call; whether every path of a forward writes and reads is the
self-check's question (``implementer/self_check.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import (
    CACHE_ENTRIES_ASSIGN,
    CACHE_WRITE_CALL,
    FA_CALL,
    LEGACY_READ_CALL,
    SPARSE_READ_CALL,
    ClassTable,
    class_methods,
    method_chain,
    self_method_name,
)

#: stands for every entry when a class's cache names are not string literals
ANY_ENTRY = "*"
#: ``CacheEntry(...)`` / ``kvskill.runtime.CacheEntry(...)`` (not a recurrent-state entry)
_ENTRY_CALL = m.Call(func=m.Name("CacheEntry") | m.Attribute(attr=m.Name("CacheEntry")))


def cache_entry_names(cls: cst.ClassDef, classes: ClassTable | None = None) -> frozenset[str]:
    """The ``cache_name`` of every entry CLS declares in ``__init__``; ``{ANY_ENTRY}`` when one
    is not a string literal (then any write or fused-attention call counts for all)."""
    names: set[str] = set()
    inits = method_chain(cls, "__init__", classes)
    for assign in (a for init in inits for a in m.findall(init, CACHE_ENTRIES_ASSIGN)):
        for node in m.findall(assign, _ENTRY_CALL):
            value = _cache_name(cst.ensure_type(node, cst.Call))
            if not isinstance(value, cst.SimpleString):
                return frozenset({ANY_ENTRY})
            names.add(str(value.evaluated_value))
    return frozenset(names)


def _cache_name(call: cst.Call) -> cst.BaseExpression | None:
    """The ``cache_name`` argument of ``CacheEntry(...)``: by keyword or first positional."""
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == "cache_name":
            return arg.value
    positional = [a for a in call.args if a.keyword is None and not a.star]
    return positional[0].value if positional else None


#: attributes that describe a tensor without reaching its contents
_METADATA = frozenset(
    {"shape", "dtype", "device", "size", "dim", "ndim", "numel", "is_contiguous", "stride"}
)


class _Refs(cst.CSTVisitor):
    """``self.<attr>`` names and bare local names an expression refers to; ``x.shape`` and
    the like describe ``x`` without reaching its contents, so they refer to nothing."""

    def __init__(self) -> None:
        self.self_attrs: set[str] = set()
        self.names: set[str] = set()

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        if node.attr.value in _METADATA:
            return False
        if m.matches(node.value, m.Name("self")):
            self.self_attrs.add(node.attr.value)
            return False
        node.value.visit(self)
        return False  # the attribute's own name is no local

    def visit_Name(self, node: cst.Name) -> bool:
        self.names.add(node.value)
        return False


# NOTE: the helpers below are memoised by node identity (libcst nodes are immutable and hash
# by identity): the helper fixpoints of lint's KV013 ask about the same methods again and
# again, and the executor's large model files made that the slowest rule.
@lru_cache(maxsize=4096)
def _refs(node: cst.CSTNode) -> _Refs:
    found = _Refs()
    node.visit(found)
    return found


def _names(node: cst.CSTNode) -> set[str]:
    return {cst.ensure_type(n, cst.Name).value for n in m.findall(node, m.Name())}


@dataclass(frozen=True)
class EntryRefs:
    """How the expressions of one function reach the declared entries."""

    entries: frozenset[str]
    #: local name -> entries its value was built from
    aliases: Mapping[str, frozenset[str]]
    #: method name -> entries its body reads (``reader_methods``): what ``self.<method>(...)``
    #: returns is built from them (the MLA prefill gathers the cached latent that way)
    readers: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def reached(self, node: cst.CSTNode) -> frozenset[str]:
        """Entries NODE refers to, through ``self.<entry>``, a local alias of one, or a call
        of a method that reads them."""
        if ANY_ENTRY in self.entries:
            return self.entries
        refs = _refs(node)
        found = refs.self_attrs & self.entries
        for name in refs.self_attrs & set(self.readers):
            found |= self.readers[name]
        for name in refs.names & set(self.aliases):
            found |= self.aliases[name]
        return frozenset(found)


@lru_cache(maxsize=512)
def _bindings(func: cst.FunctionDef) -> list[tuple[set[str], cst.CSTNode]]:
    """(names bound, the expression they are bound from) for every binding in FUNC."""
    out: list[tuple[set[str], cst.CSTNode]] = []
    for node in m.findall(func, m.Assign() | m.AnnAssign() | m.For() | m.WithItem()):
        if isinstance(node, cst.Assign):
            targets = set().union(*(_names(t.target) for t in node.targets))
            out.append((targets, node.value))
        elif isinstance(node, cst.AnnAssign) and node.value is not None:
            out.append((_names(node.target), node.value))
        elif isinstance(node, cst.For):
            out.append((_names(node.target), node.iter))
        elif isinstance(node, cst.WithItem) and node.asname is not None:
            out.append((_names(node.asname.name), node.item))
    return out


def entry_refs(
    func: cst.FunctionDef,
    entries: frozenset[str],
    readers: Mapping[str, frozenset[str]] | None = None,
) -> EntryRefs:
    """The aliases of ENTRIES among FUNC's local names (a fixpoint over its bindings);
    READERS are the class's methods that read entries (``reader_methods``)."""
    bindings = _bindings(func)
    readers = dict(readers or {})
    refs = EntryRefs(entries=entries, aliases={}, readers=readers)
    while True:
        aliases: dict[str, frozenset[str]] = dict(refs.aliases)
        for targets, value in bindings:
            reached = refs.reached(value)
            for name in targets if reached else ():
                aliases[name] = aliases.get(name, frozenset()) | reached
        if aliases == refs.aliases:
            return refs
        refs = EntryRefs(entries=entries, aliases=aliases, readers=readers)


def reader_methods(
    cls: cst.ClassDef, entries: frozenset[str], classes: ClassTable | None = None
) -> dict[str, frozenset[str]]:
    """Method name -> the entries its body reaches (beyond their shape or dtype), for every
    method of CLS but ``forward`` and ``__init__`` that reaches any; a value such a method
    returns is read from those caches."""
    found: dict[str, frozenset[str]] = {}
    for name, func in class_methods(cls, classes).items():
        if name in ("forward", "__init__"):
            continue
        reached = entry_refs(func, entries).reached(func.body)
        if reached:
            found[name] = reached
    return found


@dataclass(frozen=True)
class Access:
    """What one call does to the declared caches."""

    writes: frozenset[str] = frozenset()
    reads: frozenset[str] = frozenset()


NO_ACCESS = Access()


def call_access(
    call: cst.Call, refs: EntryRefs, helper_writes: Mapping[str, frozenset[str]]
) -> Access:
    """The entries CALL writes (a cache-write operator on them, or a helper in HELPER_WRITES)
    and reads (the fused attention over them)."""
    if m.matches(call, CACHE_WRITE_CALL):
        return Access(writes=refs.reached(_args(call)))
    if m.matches(call, FA_CALL | SPARSE_READ_CALL | LEGACY_READ_CALL):
        return Access(reads=refs.reached(_args(call)))
    helper = self_method_name(call)
    if helper is not None and helper in helper_writes:
        return Access(writes=helper_writes[helper])
    return NO_ACCESS


def may_touch(
    func: cst.FunctionDef,
    entries: frozenset[str],
    helper_writes: Mapping[str, frozenset[str]],
    helper_reads: Mapping[str, frozenset[str]] | None = None,
    readers: Mapping[str, frozenset[str]] | None = None,
    attr_methods: Mapping[str, frozenset[str]] | None = None,
) -> Access:
    """Every entry some call of FUNC writes or reads, on any path.

    A call of a helper method (``self.exec_qkv(...)``, ``fn(...)`` after
    ``fn = self.forward_absorb``, or ``self.attn_func(...)`` with ATTR_METHODS from
    ``attribute_methods``) does what HELPER_WRITES / HELPER_READS say that method does;
    READERS (``reader_methods``) make a value a helper returns count as the cache."""
    refs = entry_refs(func, entries, readers)
    helper_reads = helper_reads or {}
    methods = method_aliases(func, frozenset(helper_writes) | frozenset(helper_reads))
    attr_methods = attr_methods or {}
    writes: frozenset[str] = frozenset()
    reads: frozenset[str] = frozenset()
    for call in _calls(func):
        access = call_access(call, refs, helper_writes)
        writes, reads = writes | access.writes, reads | access.reads
        for name in _called_methods(call, methods, attr_methods):
            writes |= helper_writes.get(name, frozenset())
            reads |= helper_reads.get(name, frozenset())
    return Access(writes=writes, reads=reads)


@lru_cache(maxsize=512)
def _calls(func: cst.FunctionDef) -> tuple[cst.Call, ...]:
    return tuple(cst.ensure_type(n, cst.Call) for n in m.findall(func, m.Call()))


def method_aliases(func: cst.FunctionDef, methods: frozenset[str]) -> dict[str, frozenset[str]]:
    """Local name -> the METHODS bound to it in FUNC: the executor's MLA forward picks its
    path as ``fn = self.forward_page_attention_absorb`` (one per branch), then ``fn(...)``."""
    found: dict[str, frozenset[str]] = {}
    for targets, value in _bindings(func):
        bound = _self_methods(value, methods)
        for name in targets if bound else ():
            found[name] = found.get(name, frozenset()) | bound
    return found


def attribute_methods(
    cls: cst.ClassDef, classes: ClassTable | None = None
) -> dict[str, frozenset[str]]:
    """``self.<attr>`` -> the methods of CLS assigned to it in any method: the executor's
    Kimi attention sets ``self.attn_func = self.apply_attention_fusion`` in ``__init__``."""
    methods = class_methods(cls, classes)
    names = frozenset(methods)
    found: dict[str, frozenset[str]] = {}
    for func in methods.values():
        for node in m.findall(func, _SELF_ATTR_ASSIGN):
            assign = cst.ensure_type(node, cst.Assign)
            bound = _self_methods(assign.value, names)
            for target in assign.targets if bound else ():
                attr = cst.ensure_type(target.target, cst.Attribute).attr.value
                found[attr] = found.get(attr, frozenset()) | bound
    return found


_SELF_ATTR_ASSIGN = m.Assign(targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self")))])


def _self_methods(value: cst.CSTNode, methods: frozenset[str]) -> frozenset[str]:
    """The METHODS ``value`` is: ``self.<method>``, or either side of a conditional of them."""
    options = (value.body, value.orelse) if isinstance(value, cst.IfExp) else (value,)
    return frozenset(
        o.attr.value
        for o in options
        if m.matches(o, m.Attribute(value=m.Name("self"))) and o.attr.value in methods
    )


def _called_methods(
    call: cst.Call,
    aliases: Mapping[str, frozenset[str]],
    attr_methods: Mapping[str, frozenset[str]],
) -> frozenset[str]:
    """The class's methods CALL runs: ``self.<name>(...)`` (or the methods ``self.<name>``
    was set to) or a local alias of some."""
    name = self_method_name(call)
    if name is not None:
        return frozenset({name}) | attr_methods.get(name, frozenset())
    if isinstance(call.func, cst.Name):
        return aliases.get(call.func.value, frozenset())
    return frozenset()


def helper_may_writes(
    cls: cst.ClassDef, entries: frozenset[str], classes: ClassTable | None = None
) -> dict[str, frozenset[str]]:
    """Method name -> entries it may write (directly or through other helpers), for every
    method of CLS that writes any."""
    methods = class_methods(cls, classes)
    attrs = attribute_methods(cls, classes)
    writes: dict[str, frozenset[str]] = {}
    while True:  # NOTE: a fixpoint, so helpers that call helpers count too
        grown = {
            name: found
            for name, func in methods.items()
            if (found := may_touch(func, entries, writes, attr_methods=attrs).writes)
        }
        if grown == writes:
            return writes
        writes = grown


def helper_may_reads(
    cls: cst.ClassDef,
    entries: frozenset[str],
    classes: ClassTable | None = None,
    readers: Mapping[str, frozenset[str]] | None = None,
) -> dict[str, frozenset[str]]:
    """Method name -> entries it may pass to the fused attention (directly or through other
    helpers), for every method of CLS that reads any. The executor's qwen3_moe reads in
    ``exec_qkv``, which the forward calls, over the caches ``kv_cache_update`` returns."""
    methods = class_methods(cls, classes)
    attrs = attribute_methods(cls, classes)
    reads: dict[str, frozenset[str]] = {}
    while True:  # NOTE: a fixpoint, as for the writes
        grown = {
            name: found
            for name, func in methods.items()
            if (found := may_touch(func, entries, {}, reads, readers, attrs).reads)
        }
        if grown == reads:
            return reads
        reads = grown


def _args(call: cst.Call) -> cst.CSTNode:
    """The call's arguments as one node (the callee's own name is no reference)."""
    return cst.Tuple(elements=[cst.Element(value=a.value) for a in call.args])


__all__ = [
    "ANY_ENTRY",
    "NO_ACCESS",
    "Access",
    "EntryRefs",
    "attribute_methods",
    "cache_entry_names",
    "call_access",
    "entry_refs",
    "helper_may_reads",
    "helper_may_writes",
    "may_touch",
    "method_aliases",
    "reader_methods",
]

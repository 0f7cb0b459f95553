"""Cache entries a layer declares but hands to a submodule that writes and reads them.

The DSA attention declares its indexer's key cache (one entry of the layer, paged with the
latent), and the entry's ``tensor_setter`` gives the tensor to the indexer module
(``self.indexer.key_cache = tensor``), whose forward writes this step's keys into it and
selects over it. For the self-check a call ``self.indexer(...)`` in the layer's forward then
writes and reads that entry - but only when the submodule's own forward surely does both on
every path (the self-check's must-analysis, or lint's may-analysis, run on the submodule's
attribute), so an indexer that forgets its write still fails the check.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import method, self_module_calls

#: ``self.<sub>.<attr> = tensor``: the setter body that hands the cache to a submodule
_HAND_OVER = m.Assign(
    targets=[m.AssignTarget(target=m.Attribute(value=m.Attribute(value=m.Name("self"))))]
)
_CACHE_ENTRY = m.Call(func=m.Name("CacheEntry") | m.Attribute(attr=m.Name("CacheEntry")))


def _setters(cls: cst.ClassDef) -> dict[str, str]:
    """{entry name: its tensor_setter method} from the class's ``CacheEntry(...)`` calls."""
    init = method(cls, "__init__")
    found: dict[str, str] = {}
    if init is None:
        return found
    for node in m.findall(init, _CACHE_ENTRY):
        keywords = {
            a.keyword.value: a.value for a in cst.ensure_type(node, cst.Call).args if a.keyword
        }
        name, setter = keywords.get("cache_name"), keywords.get("tensor_setter")
        if (
            isinstance(name, cst.SimpleString)
            and isinstance(setter, cst.Attribute)
            and m.matches(setter.value, m.Name("self"))
        ):
            found[name.evaluated_value] = setter.attr.value
    return found


def _submodule_classes(cls: cst.ClassDef, classes: Mapping[str, cst.ClassDef]) -> dict[str, str]:
    """{attribute: class name} of ``self.<attr> = <Class of this file>(...)`` in __init__."""
    init = method(cls, "__init__")
    calls = self_module_calls(init) if init is not None else {}
    return {
        attr: call.func.value
        for attr, call in calls.items()
        if isinstance(call.func, cst.Name) and call.func.value in classes
    }


def delegated_entries(
    cls: cst.ClassDef,
    classes: Mapping[str, cst.ClassDef],
    surely_writes_and_reads: Callable[[cst.FunctionDef, str], bool],
) -> dict[str, frozenset[str]]:
    """{submodule attribute: entries a call of it writes and reads} for CLS.

    SURELY_WRITES_AND_READS(forward, attr) is the self-check's must-analysis of the
    submodule's forward for ``self.<attr>``.
    """
    subs = _submodule_classes(cls, classes)
    found: dict[str, set[str]] = {}
    for entry, setter_name in _setters(cls).items():
        setter = method(cls, setter_name)
        if setter is None:
            continue
        for node in m.findall(setter, _HAND_OVER):
            target = cst.ensure_type(
                cst.ensure_type(node, cst.Assign).targets[0].target, cst.Attribute
            )
            sub = cst.ensure_type(target.value, cst.Attribute).attr.value
            sub_cls = classes.get(subs.get(sub, ""))
            forward = method(sub_cls, "forward") if sub_cls is not None else None
            if forward is not None and surely_writes_and_reads(forward, target.attr.value):
                found.setdefault(sub, set()).add(entry)
    return {sub: frozenset(entries) for sub, entries in found.items()}


def calls_submodule(func: cst.FunctionDef, sub: str) -> bool:
    """Whether FUNC calls ``self.<sub>(...)`` anywhere."""
    return bool(m.findall(func, m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(sub)))))

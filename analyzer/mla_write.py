"""How an MLA model's latent reaches its caches: fused RMSNorm + rope write, or a plain scatter.

``npu_kv_rmsnorm_rope_cache`` takes the raw down-projection ``[latent | rope]`` and does three
things at once: RMSNorm of the latent with ``gamma``, rope of the last 64 channels, and the
paged write. Its rope reads the 64 channels as *interleaved pairs* and writes them
*de-interleaved* (rotate-half order) with cos/sin tables (npu_ops §4). It can replace the
source's own norm + rope + cache write only when the source computes exactly that:

* the latent comes first in the split of the down-projection and is normalised by an
  RMSNorm module before it is cached;
* the rope key is rotated by a function that pairs channels (0, 1), (2, 3), ... and emits
  ``cat(even', odd')`` from cos/sin tables (DeepSeek-V3 ``rope_interleave``); a rotate-half
  rope on non-interleaved channels, or a complex-number rope that keeps pairs interleaved in
  its output, would be cached in a different channel order than the source's query uses;
* the rope head dim is 64 (the operator's only size).

Otherwise the source's normalised latent and rotated key are written as they are with
``npu_scatter_nd_update_``, which is always exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import libcst as cst
import libcst.matchers as m

FUSED = "fused"
SCATTER = "scatter"
ROPE_DIM = 64

_UPDATE = m.Call(func=m.Attribute(attr=m.Name("update")), args=[m.Arg(), m.Arg(), m.ZeroOrMore()])
_EMPTY = cst.Module(body=[])


@dataclass(frozen=True, kw_only=True)
class MlaCacheWrite:
    """The decision and why."""

    #: "fused" (npu_kv_rmsnorm_rope_cache, cache_mode="PA_NZ") or "scatter"
    mode: str
    reason: str
    #: "modeling_x.py:LINE" of the fact that decided it
    source: str


def _code(node: cst.CSTNode) -> str:
    return _EMPTY.code_for_node(node).strip()


def _name_of(node: cst.BaseExpression) -> str | None:
    return node.value if isinstance(node, cst.Name) else None


def decide_mla_cache_write(source: str, config: dict[str, Any], file_name: str) -> MlaCacheWrite:
    """Decide the cache write for the MLA attention in ``source`` under ``config``."""
    wrapper = cst.metadata.MetadataWrapper(cst.parse_module(source))
    positions = wrapper.resolve(cst.metadata.PositionProvider)
    module = wrapper.module
    functions = {f.name.value: f for f in module.body if isinstance(f, cst.FunctionDef)}
    classes = {c.name.value: c for c in module.body if isinstance(c, cst.ClassDef)}

    def where(node: cst.CSTNode) -> str:
        return f"{file_name}:{positions[node].start.line}"

    attention = _mla_attention(classes)
    if attention is None:
        return MlaCacheWrite(
            mode=SCATTER,
            reason="no attention class writing a latent cache was found; scatter is exact",
            source=file_name,
        )
    forward = _method(attention, "forward")
    assert forward is not None
    update = cst.ensure_type(m.findall(forward, _UPDATE)[0], cst.Call)
    latent, rope_key = _name_of(update.args[0].value), _name_of(update.args[1].value)
    decompress = _decompressed_before_cache(attention, forward)
    if decompress is not None:
        return MlaCacheWrite(
            mode=SCATTER,
            reason=f"the source caches per-head keys and values that self.{decompress[0]} "
            "decompresses from the latent before its cache write (DeepSeek-V2/V3 hub code): the "
            "converted layer caches that normalised latent and the rotated rope key with "
            "npu_scatter_nd_update_ (NZ layout); the fused write replaces a source that caches "
            "the latent itself",
            source=where(decompress[1]),
        )
    flags = config.get("no_rope_layers")
    if isinstance(flags, list) and not all(flags):
        return MlaCacheWrite(
            mode=SCATTER,
            reason="NoPE layers (no_rope_layers 0) have no rope key; the fused write rotates "
            "a 64-wide one in every layer",
            source=where(update),
        )
    rope_dim = config.get("qk_rope_head_dim")
    if rope_dim != ROPE_DIM:
        return MlaCacheWrite(
            mode=SCATTER,
            reason=f"qk_rope_head_dim is {rope_dim}; the fused write handles 64 only",
            source=where(update),
        )
    rope_call = _active_rope_call(forward, rope_key, config)
    if rope_call is None:
        return MlaCacheWrite(
            mode=SCATTER,
            reason=f"the rotation of the rope key `{rope_key}` is not one call the analyzer can "
            "pick for this config; the source's rotated key is scattered as is",
            source=where(update),
        )
    call, branch = rope_call
    func = functions.get(_name_of(call.func) or "")
    style = _rope_style(func) if func is not None else None
    if style != "interleaved":
        why = {
            "complex": "rotates interleaved pairs as complex numbers and keeps the pairs "
            "interleaved in its output, while the fused operator emits rotate-half order",
            "half": "uses rotate-half on non-interleaved channels, while the fused operator "
            "de-interleaves its input first",
            None: "is not a module-level function the analyzer can read",
        }[style]
        return MlaCacheWrite(
            mode=SCATTER,
            reason=f"the rope `{_code(call.func)}`{branch} {why}; the source's normalised latent "
            "and rotated key are written with npu_scatter_nd_update_ (NZ layout)",
            source=where(call),
        )
    tables = [_code(a.value) for a in call.args]
    if not (any("cos" in t for t in tables) and any("sin" in t for t in tables)):
        return MlaCacheWrite(
            mode=SCATTER,
            reason=f"the rope `{_code(call.func)}` takes no cos/sin tables",
            source=where(call),
        )
    norm = _latent_norm(forward, attention, classes, latent)
    if norm is None:
        return MlaCacheWrite(
            mode=SCATTER,
            reason=f"the cached latent `{latent}` is not the output of an RMSNorm module applied "
            "to the latent split; the fused operator's RMSNorm would not match",
            source=where(update),
        )
    return MlaCacheWrite(
        mode=FUSED,
        reason=f"the latent is RMSNorm-ed by self.{norm} and the rope key is rotated by "
        f"`{_code(call.func)}`{branch} (interleaved pairs in, rotate-half order out, cos/sin "
        "tables), exactly what npu_kv_rmsnorm_rope_cache computes; the raw down-projection "
        "is written through it",
        source=where(call),
    )


def _method(cls: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    for stmt in cls.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == name:
            return stmt
    return None


def _mla_attention(classes: dict[str, cst.ClassDef]) -> cst.ClassDef | None:
    """The class whose __init__ reads kv_lora_rank and whose forward updates a cache."""
    for cls in classes.values():
        init, forward = _method(cls, "__init__"), _method(cls, "forward")
        if init is None or forward is None:
            continue
        if "kv_lora_rank" in _EMPTY.code_for_node(init) and m.findall(forward, _UPDATE):
            return cls
    return None


def _decompressed_before_cache(
    attention: cst.ClassDef, forward: cst.FunctionDef
) -> tuple[str, cst.Call] | None:
    """(attribute, call) of the Linear over the latent (in-features from kv_lora_rank) when
    forward calls it before the cache write, else None."""
    init = _method(attention, "__init__")
    assert init is not None
    up = set()
    for node in m.findall(
        init, m.Assign(targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self")))])
    ):
        assign = cst.ensure_type(node, cst.Assign)
        value = assign.value
        if not isinstance(value, cst.Call) or _code(value.func).split(".")[-1] != "Linear":
            continue
        positional = [a for a in value.args if a.keyword is None]
        if positional and "kv_lora_rank" in _code(positional[0].value):
            up.add(cst.ensure_type(assign.targets[0].target, cst.Attribute).attr.value)
    for stmt in cst.ensure_type(forward.body, cst.IndentedBlock).body:
        if m.findall(stmt, _UPDATE):
            return None
        for node in m.findall(stmt, m.Call(func=m.Attribute(value=m.Name("self")))):
            call = cst.ensure_type(node, cst.Call)
            attr = cst.ensure_type(call.func, cst.Attribute).attr.value
            if attr in up:
                return attr, call
    return None


def _config_flag(test: cst.BaseExpression, config: dict[str, Any]) -> bool | None:
    """Value of ``self.config.<flag>`` / ``config.<flag>`` (optionally negated) or None."""
    negate = False
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        negate, test = True, test.expression
    if not isinstance(test, cst.Attribute):
        return None
    owner = _code(test.value)
    if owner not in ("self.config", "config"):
        return None
    flag = test.attr.value
    if flag not in config:
        return None
    return bool(config[flag]) != negate


def _active_rope_call(
    forward: cst.FunctionDef, rope_key: str | None, config: dict[str, Any]
) -> tuple[cst.Call, str] | None:
    """The call that assigns the rope key, choosing the ``if`` branch the config takes."""
    found: list[tuple[cst.Call, str]] = []
    ambiguous = False

    def scan(stmts, branch: str) -> None:
        nonlocal ambiguous
        for stmt in stmts:
            if isinstance(stmt, cst.If):
                flag = _config_flag(stmt.test, config)
                cond = _code(stmt.test)
                if flag is None:
                    # a branch the config does not decide: both sides may run
                    before = len(found)
                    scan(stmt.body.body, branch)
                    if isinstance(stmt.orelse, cst.Else):
                        scan(stmt.orelse.body.body, branch)
                    ambiguous |= len(found) > before
                elif flag:
                    scan(stmt.body.body, f" (taken: {cond} is true)")
                elif isinstance(stmt.orelse, cst.Else):
                    scan(stmt.orelse.body.body, f" (taken: {cond} is false)")
                continue
            if not isinstance(stmt, cst.SimpleStatementLine):
                continue
            for small in stmt.body:
                if not isinstance(small, cst.Assign) or not isinstance(small.value, cst.Call):
                    continue
                targets = {n.value for t in small.targets for n in m.findall(t.target, m.Name())}
                call = small.value
                if rope_key in targets and isinstance(call.func, cst.Name):
                    found.append((call, branch))

    scan(cst.ensure_type(forward.body, cst.IndentedBlock).body, "")
    if len(found) != 1 or ambiguous:
        return None
    return found[0]


def _rope_style(func: cst.FunctionDef) -> str:
    text = _EMPTY.code_for_node(func)
    if "view_as_complex" in text:
        return "complex"
    steps = m.findall(func, m.Slice(step=m.Integer("2")))
    if steps and "cat" in text:
        return "interleaved"
    return "half"


def _latent_norm(
    forward: cst.FunctionDef,
    attention: cst.ClassDef,
    classes: dict[str, cst.ClassDef],
    latent: str | None,
) -> str | None:
    """``self.<norm>`` when the cached latent is ``self.<norm>(...)`` of an RMSNorm class."""
    init = _method(attention, "__init__")
    assert init is not None
    modules: dict[str, str] = {}
    for assign in m.findall(
        init, m.Assign(targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self")))])
    ):
        assign = cst.ensure_type(assign, cst.Assign)
        target = cst.ensure_type(assign.targets[0].target, cst.Attribute)
        if isinstance(assign.value, cst.Call) and isinstance(assign.value.func, cst.Name):
            modules[target.attr.value] = assign.value.func.value
    norm: str | None = None
    for stmt in cst.ensure_type(forward.body, cst.IndentedBlock).body:
        if m.findall(stmt, _UPDATE):
            break  # only what happens to the latent before it is cached
        for assign in m.findall(
            stmt, m.Assign(targets=[m.AssignTarget(target=m.Name(latent or ""))])
        ):
            value = cst.ensure_type(assign, cst.Assign).value
            here = _rms_norm_call(value, modules, classes)
            if here is not None:
                norm = here
            elif norm is not None and not m.matches(value, _reshape_of(latent or "")):
                # the normalised latent changes again (e.g. a scale) before it is cached
                return None
    return norm


def _rms_norm_call(
    value: cst.BaseExpression, modules: dict[str, str], classes: dict[str, cst.ClassDef]
) -> str | None:
    for call in m.findall(value, m.Call(func=m.Attribute(value=m.Name("self")))):
        attr = cst.ensure_type(cst.ensure_type(call, cst.Call).func, cst.Attribute).attr.value
        cls = classes.get(modules.get(attr, ""))
        if cls is not None and _is_rms_norm(cls):
            return attr
    return None


def _reshape_of(name: str) -> m.Call:
    """``name.view(...)`` / ``.reshape`` / ``.contiguous`` / ``.unsqueeze``: same values."""
    shapes = m.Name("view") | m.Name("reshape") | m.Name("contiguous") | m.Name("unsqueeze")
    return m.Call(func=m.Attribute(value=m.Name(name), attr=shapes))


def _is_rms_norm(cls: cst.ClassDef) -> bool:
    forward = _method(cls, "forward")
    if forward is None:
        return False
    text = _EMPTY.code_for_node(forward)
    return "rsqrt" in text and "pow(2)" in text and "mean(" in text

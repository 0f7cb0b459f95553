"""The ``code`` section of the Plan: class names and line numbers the implementer needs."""

from __future__ import annotations

from typing import Any

from kvskill.analyzer.config import ModelSpec
from kvskill.analyzer.inputs import ModelSource
from kvskill.analyzer.rules import CodeView
from kvskill.analyzer.scale import scaling_line_of
from kvskill.analyzer.scan import ClassFacts


def _line(cls: ClassFacts | None, kind: str) -> int | None:
    call = cls.first_call(kind) if cls else None
    return call.line if call else None


def fused_projection(cls: ClassFacts) -> dict[str, Any] | None:
    """The one Linear that projects query, key and value together, when the forward calls a
    single Linear of its own before the cache write (``wqkv``, ``W_pack``,
    ``query_key_value``, ``c_attn``); its layout says how a tensor-parallel split must cut
    it: ``grouped`` (per KV group its queries, then one key and one value: InternLM2) or
    ``blocks`` (all queries, then all keys, then all values)."""
    linears = {attr for attr, names in cls.attr_classes.items() if "Linear" in names}
    write = cls.first_call("cache_update")
    before = {
        attr
        for attr, line in cls.module_calls
        if attr in linears and (write is None or line < write.line)
    }
    if len(before) != 1:
        return None
    (attr,) = before
    return {
        "attr": attr,
        "layout": "grouped" if cls.grouped_qkv_split else "blocks",
        "line": cls.self_attrs.get(attr, cls.line),
    }


def _attention_entry(cls: ClassFacts) -> dict[str, Any]:
    update = cls.first_call("cache_update")
    call = cls.first_call("attention_call") or cls.first_call("fa_call")
    fused = fused_projection(cls)
    extra = {"fused_qkv": fused} if fused is not None else {}
    return {
        **extra,
        "line": cls.line,
        "init_line": cls.methods.get("__init__"),
        "forward_line": cls.methods.get("forward"),
        "cache_update_line": update.line if update else None,
        "cache_update_receiver": update.receiver if update else None,
        "attention_call_line": call.line if call else None,
        "attention_callee": call.callee if call else None,
        "attention_call_keywords": list(call.keywords) if call else [],
        "scaling_line": scaling_line_of(cls),
        "sinks_line": cls.self_attrs.get("sinks"),
        "sliding_window_line": cls.self_attrs.get("sliding_window"),
    }


def code_facts(code: CodeView, source: ModelSource) -> dict[str, Any]:
    facts, roles = code.facts, code.roles
    classes = facts.classes
    primary = code.attention_class()
    attention = {name: _attention_entry(classes[name]) for name in roles.attention}
    update = primary.first_call("cache_update") if primary else None
    result: dict[str, Any] = {
        "modeling_file": facts.file_name,
        "causal_lm_class": roles.causal_lm,
        "causal_lm_line": classes[roles.causal_lm].line if roles.causal_lm in classes else None,
        "model_class": roles.model,
        "model_line": classes[roles.model].line if roles.model in classes else None,
        "decoder_layer_class": roles.decoder_layer,
        "decoder_layer_line": (
            classes[roles.decoder_layer].line if roles.decoder_layer in classes else None
        ),
        "attention_classes": list(roles.attention),
        "attention": attention,
        "linear_attention_classes": list(roles.linear_attention),
        "cache_update_line": update.line if update else None,
        "attention_interface_line": _line(primary, "attention_call"),
        "cache_api": "tuple_cat"
        if update and update.callee == "cat"
        else _cache_api(update.receiver if update else None),
        "cache_update_source": facts.where(update.line) if update else None,
    }
    fused = fused_projection(primary) if primary else None
    if fused is not None:
        result["fused_qkv"] = {**fused, "class": primary.name, "source": facts.where(fused["line"])}
    _converted(facts, result)
    return result


def _cache_api(receiver: str | None) -> str | None:
    if receiver is None:
        return None
    return "transformers4" if receiver in ("past_key_value", "layer_past") else "transformers5"


def _converted(facts, result: dict[str, Any]) -> None:
    converted = None
    legacy = None
    for cls in facts.classes.values():
        if converted is None:
            if "cache_entries" in cls.self_attrs:
                converted = facts.where(cls.self_attrs["cache_entries"])
            elif "get_cache_info" in cls.methods:
                converted = facts.where(cls.methods["get_cache_info"])
        scatter = next((c for c in cls.calls if c.callee == "scatter_update_"), None)
        if legacy is None and "cache_unit" in cls.self_attrs and scatter is not None:
            legacy = f"{facts.where(cls.self_attrs['cache_unit'])}, {facts.where(scatter.line)}"
    result["already_converted"] = converted is not None
    result["already_converted_source"] = converted
    result["legacy_framework"] = legacy is not None and converted is None
    result["legacy_framework_source"] = legacy


def rope_style(code: CodeView, spec: ModelSpec) -> tuple[str, str]:
    """ "interleaved" | "half" | "none", and where that was read."""
    functions = code.facts.functions
    if spec.rope_interleave:
        return "interleaved", "config rope_interleave=true"
    rotations = {n: line for n, line in functions.items() if "rotary" in n or "rope" in n}
    for name, line in rotations.items():
        if "view_as_complex" in _function_text(code.facts.path, line):
            # (x[2i], x[2i+1]) taken as one complex number: rotation of adjacent pairs.
            return "interleaved", f"{code.facts.where(line)} ({name}: view_as_complex pairs)"
    if "rotate_half" in functions:
        return "half", code.facts.where(functions["rotate_half"])
    for line in rotations.values():
        return "half", code.facts.where(line)
    if not spec.rope_parameters:
        return "none", "config has no rope parameters"
    return "half", "config rope_parameters (rotation helper not found in the file)"


def _function_text(path: str, line: int) -> str:
    """The source of the module-level function defined at ``line`` (1-based), up to the next
    top-level statement; empty when the file cannot be read."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return ""
    body = [lines[line - 1]] if 0 < line <= len(lines) else []
    for text in lines[line:]:
        if text and not text[0].isspace() and not text.startswith((")", "#")):
            break
        body.append(text)
    return "\n".join(body)

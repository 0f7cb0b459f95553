"""The ``code`` section of the Plan: class names and line numbers the implementer needs."""

from __future__ import annotations

import os
import re
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import libcst as cst
from kvskill.analyzer.config import ModelSpec, text_config
from kvskill.analyzer.inputs import ModelSource
from kvskill.analyzer.qkv_split import QkvLayout, QkvSplit, classify_qkv_split
from kvskill.analyzer.rotary import (
    INTERLEAVED_SHAPES,
    RotationFacts,
    function_facts,
    half_width_rotary,
)
from kvskill.analyzer.rules import CodeView
from kvskill.analyzer.scale import scaling_line_of
from kvskill.analyzer.scan import ClassFacts


def _line(cls: ClassFacts | None, kind: str) -> int | None:
    call = cls.first_call(kind) if cls else None
    return call.line if call else None


def fused_projection(cls: ClassFacts, path: str) -> dict[str, Any] | None:
    """The one Linear that projects query, key and value together, when the forward calls a
    single Linear of its own before the cache write (``wqkv``, ``W_pack``,
    ``query_key_value``, ``c_attn``), with the layout its output is cut by (``qkv_split``):
    ``contiguous``, ``per_head`` or ``per_kv_group``, and the line of that cut. A
    tensor-parallel split must cut the rows the same way."""
    # FalconLinear and the like: Linear subclasses a forward calls the same way
    linears = {
        attr for attr, names in cls.attr_classes.items() if any(n.endswith("Linear") for n in names)
    }
    write = cls.first_call("cache_update")
    before = {
        attr
        for attr, line in cls.module_calls
        if attr in linears and (write is None or line < write.line)
    }
    if len(before) != 1:
        return None
    (attr,) = before
    split = _qkv_split(path, cls.name, attr)
    return {
        "attr": attr,
        "layout": split.layout.value,
        "line": cls.self_attrs.get(attr, cls.line),
        "split_line": split.line,
        "split": split.cut,
    }


def _qkv_split(path: str, class_name: str, attr: str) -> QkvSplit:
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError:
        return QkvSplit(layout=QkvLayout.UNKNOWN, line=None)
    return _qkv_split_cached(path, stamp, class_name, attr)


@lru_cache(maxsize=64)
def _qkv_split_cached(path: str, mtime_ns: int, class_name: str, attr: str) -> QkvSplit:
    """Parsed once per file version: every attention class of a family asks."""
    try:
        with open(path, encoding="utf-8") as handle:
            return classify_qkv_split(handle.read(), class_name, attr)
    except (OSError, cst.ParserSyntaxError):
        return QkvSplit(layout=QkvLayout.UNKNOWN, line=None)


def _attention_entry(cls: ClassFacts, path: str) -> dict[str, Any]:
    update = cls.first_call("cache_update")
    call = cls.first_call("attention_call") or cls.first_call("fa_call")
    fused = fused_projection(cls, path)
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
    attention = {name: _attention_entry(classes[name], facts.path) for name in roles.attention}
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
    fused = fused_projection(primary, facts.path) if primary else None
    if fused is not None:
        split_line = fused["split_line"]
        result["fused_qkv"] = {
            **fused,
            "class": primary.name,
            "source": facts.where(fused["line"]),
            "split_source": facts.where(split_line) if split_line else None,
        }
    _converted(facts, result)
    return result


def _cache_api(receiver: str | None) -> str | None:
    if receiver is None:
        return None
    return "transformers4" if receiver in ("past_key_value", "layer_past") else "transformers5"


def _converted(facts, result: dict[str, Any]) -> None:
    converted = None
    legacy = None
    # the standalone models' Legacy: scatter_update_ rows the model's init_cache allocates
    standalone_write = init_cache = None
    for cls in facts.classes.values():
        if converted is None:
            if "cache_entries" in cls.self_attrs:
                converted = facts.where(cls.self_attrs["cache_entries"])
            elif "get_cache_info" in cls.methods:
                converted = facts.where(cls.methods["get_cache_info"])
        scatter = next((c for c in cls.calls if c.callee == "scatter_update_"), None)
        if legacy is None and "cache_unit" in cls.self_attrs and scatter is not None:
            legacy = f"{facts.where(cls.self_attrs['cache_unit'])}, {facts.where(scatter.line)}"
        if standalone_write is None and "cache_unit" not in cls.self_attrs and scatter:
            standalone_write = facts.where(scatter.line)
        if init_cache is None and "init_cache" in cls.methods:
            init_cache = facts.where(cls.methods["init_cache"])
    result["already_converted"] = converted is not None
    result["already_converted_source"] = converted
    result["legacy_framework"] = legacy is not None and converted is None
    result["legacy_framework_source"] = legacy
    standalone = legacy is None and converted is None and None not in (standalone_write, init_cache)
    result["legacy_standalone"] = standalone
    result["legacy_standalone_source"] = f"{init_cache}, {standalone_write}" if standalone else None


@dataclass(frozen=True, kw_only=True)
class RopeDecision:
    """The rotary pairing, and how many channels of a head it turns when not all."""

    style: str
    source: str
    #: rotated channels per head when fewer than head_dim (partial rotary), else None
    rotary_dim: int | None = None
    rotary_source: str | None = None


_ROTATION_NAME = re.compile(r"rot|rope", re.IGNORECASE)


def rope_style(code: CodeView, spec: ModelSpec, config: dict[str, Any]) -> RopeDecision:
    """ "interleaved" | "half" | "none", where that was read, and partial rotation."""
    if spec.mla is not None and not spec.mla["qk_rope_head_dim"]:
        # a latent without a rope key (glm5_next): the text attention rotates nothing, whatever
        # helpers the file's vision tower defines
        return RopeDecision(style="none", source="config qk_rope_head_dim 0")
    style, source = _pairing(code, spec, text_config(config)[0])
    if style == "none" or spec.mla:
        return RopeDecision(style=style, source=source)  # MLA's rope key is its own width
    width, where = _partial_width(code, spec, text_config(config))
    return RopeDecision(style=style, source=source, rotary_dim=width, rotary_source=where)


def _pairing(code: CodeView, spec: ModelSpec, cfg: dict[str, Any]) -> tuple[str, str]:
    facts = code.facts
    functions = facts.functions
    if spec.rope_interleave:
        return "interleaved", "config rope_interleave=true"
    rotations = _rotation_functions(code, skip_interleave_variant="rope_interleave" in cfg)
    seen = _closure(facts, rotations)
    for name, found in seen.items():
        if found.interleaved:
            shape = INTERLEAVED_SHAPES[found.interleaved]
            return "interleaved", f"{facts.where(functions[name])} ({name}: {shape})"
    if "rotate_half" in seen or (not seen and "rotate_half" in functions):
        return "half", facts.where(functions["rotate_half"])
    if seen:  # the innermost rotation helper is where the channels turn
        return "half", facts.where(functions[list(seen)[-1]])
    for name in rotations:
        return "half", facts.where(functions[name])
    if not spec.rope_parameters:
        return "none", "config has no rope parameters"
    return "half", "config rope_parameters (rotation helper not found in the file)"


def _rotation_functions(code: CodeView, *, skip_interleave_variant: bool) -> list[str]:
    """Module functions named like a rotation that the attention classes call; every such
    function of the file when they call none (the rotation may sit in a rotary module)."""
    functions = code.facts.functions
    named = [n for n in functions if _ROTATION_NAME.search(n)]
    if skip_interleave_variant:
        # the config's rope_interleave=false picks the other branch of the attention
        named = [n for n in named if "interleave" not in n]
    called: set[str] = set()
    for name in code.roles.attention:
        cls = code.facts.classes.get(name)
        if cls is not None:
            called |= cls.function_calls
    roots = [n for n in named if n in called]
    return roots or named


def _closure(facts, roots: list[str]) -> dict[str, RotationFacts]:
    """The facts of ``roots`` and of the module functions they call, transitively."""
    seen: dict[str, RotationFacts] = {}
    pending = list(roots)
    while pending and len(seen) < 32:
        name = pending.pop(0)
        if name in seen or name not in facts.functions:
            continue
        found = function_facts(textwrap.dedent(_function_text(facts.path, facts.functions[name])))
        if found is None:
            continue
        seen[name] = found
        pending += sorted(found.callees & set(facts.functions))
    return seen


#: config keys giving the rotated share of a head: a fraction, or channels (GPT-J)
_FRACTION_KEYS = ("partial_rotary_factor", "rotary_pct", "rotary_emb_fraction")


def _partial_width(
    code: CodeView, spec: ModelSpec, text: tuple[dict[str, Any], str]
) -> tuple[int | None, str | None]:
    """Rotated channels per head when fewer than ``head_dim``, and where that was read."""
    cfg, prefix = text
    head_dim = spec.head_dim
    for where, fraction in _fractions(cfg, spec):
        if isinstance(fraction, (int, float)) and 0 < fraction < 1:
            return int(head_dim * fraction), f"config {prefix}{where}={fraction:g}"
    channels = cfg.get("rotary_dim")
    if isinstance(channels, int) and 0 < channels < head_dim:
        return channels, f"config {prefix}rotary_dim={channels}"
    if head_dim and _builds_half_width_tables(code):
        return head_dim // 2, (
            f"{code.facts.file_name}: rotary tables built for half a head (<dim> // 2) and the "
            "rotation passes the rest of the head through"
        )
    return None, None


def _fractions(cfg: dict[str, Any], spec: ModelSpec) -> list[tuple[str, Any]]:
    found = [(f"rope_parameters.{k}", spec.rope_parameters.get(k)) for k in _FRACTION_KEYS]
    return [(k, v) for k, v in found if v is not None] + [
        (k, cfg.get(k)) for k in _FRACTION_KEYS if cfg.get(k) is not None
    ]


def _builds_half_width_tables(code: CodeView) -> bool:
    """ChatGLM's shape: ``RotaryEmbedding(rotary_dim // 2)`` and a rotation that slices the
    rotated part off the head (``x[..., :rot_dim]`` / ``x[..., rot_dim:]``)."""
    facts = code.facts
    seen = _closure(facts, _rotation_functions(code, skip_interleave_variant=False))
    if not any(found.passes_tail for found in seen.values()):
        return False
    try:
        with open(facts.path, encoding="utf-8") as handle:
            return half_width_rotary(handle.read())
    except OSError:
        return False


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

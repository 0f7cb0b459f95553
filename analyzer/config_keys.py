"""Which key of a config holds each size the analyzer and the verify shrink read.

Vendors name the same value differently: the decoder depth is ``num_hidden_layers`` in
transformers' own configs, ``n_layer`` in GPT-2 style ones, ``num_layers`` in ChatGLM's and
``n_layers`` in MPT's. A config class may also declare an ``attribute_map`` (transformers'
``PretrainedConfig.attribute_map``: a standard name -> the attribute the class stores, GPT-2's
``num_attention_heads -> n_head``); the key it maps to is the one the model's code reads, so it
is looked up first. The verify shrink writes its small sizes through the same keys: a small
value under a standard key the model never reads would leave the model full size.

A remote-code config class is read with libcst (never imported): only a class-level
``attribute_map = {"...": "...", ...}`` of string literals counts.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import libcst as cst
from kvskill.core.config_checks import decoder_config

#: value -> config keys that hold it, the standard (transformers) key first, then vendor names
ALIASES: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    # NOTE: multi_query_group_num counts only under multi_query_attention=true (ChatGLM)
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"),
    # kv_channels: ChatGLM's and Qwen-7B's per-head width
    "head_dim": ("head_dim", "attention_head_size", "kv_channels"),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size", "n_inner"),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "max_positions": (
        "max_position_embeddings",
        "seq_length",
        "n_positions",
        "max_seq_len",
        "max_sequence_length",
    ),
    "norm_eps": ("rms_norm_eps", "layer_norm_epsilon", "layernorm_epsilon", "layer_norm_eps"),
}

#: the standard key of each value (what a plain transformers config calls it)
STANDARD = {name: keys[0] for name, keys in ALIASES.items()}

#: A Mamba mixer's sizes -> the config keys that hold them, in the order they are tried
#: (transformers' Mamba, Mamba-2, jamba, bamba, falcon_h1, nemotron_h, zamba, zamba2 and vendor
#: files); read by the state-shape decision and written by the verify shrink.
SSM_ALIASES: dict[str, tuple[str, ...]] = {
    "heads": ("mamba_n_heads", "mamba_num_heads", "num_heads", "n_mamba_heads"),
    "head_dim": ("mamba_d_head", "mamba_head_dim", "head_dim", "mamba_headdim"),
    "state": ("mamba_d_state", "ssm_state_size", "state_size"),
    "groups": ("mamba_n_groups", "n_groups", "mamba_ngroups"),
    "chunk": ("mamba_chunk_size", "chunk_size"),
    "expand": ("mamba_expand", "expand"),
    "conv_kernel": ("mamba_d_conv", "conv_kernel", "mamba_conv_kernel"),
}


def ssm_value(cfg: dict[str, Any], role: str) -> Any:
    """The first set (truthy) value among ``SSM_ALIASES[role]``, or None."""
    for key in SSM_ALIASES[role]:
        if cfg.get(key):
            return cfg[key]
    return None


def _present(value: Any) -> bool:
    return value is not None and not isinstance(value, (dict, list))


def lookup(
    cfg: dict[str, Any], name: str, attribute_map: dict[str, str] | None = None
) -> tuple[Any, str | None]:
    """(value, key) of ``name`` in ``cfg``: the key the class's attribute_map maps the
    standard name to, else the first alias present; (None, None) when there is none."""
    for key in _candidates(name, attribute_map):
        if _present(cfg.get(key)):
            return cfg[key], key
    return None, None


def _candidates(name: str, attribute_map: dict[str, str] | None) -> list[str]:
    aliases = list(ALIASES[name])
    mapped = (attribute_map or {}).get(aliases[0])
    if mapped and mapped not in aliases:
        aliases.insert(0, mapped)
    elif mapped:
        aliases.remove(mapped)
        aliases.insert(0, mapped)
    return aliases


def write_keys(
    cfg: dict[str, Any], name: str, attribute_map: dict[str, str] | None = None
) -> list[str]:
    """The keys a new value of ``name`` must be written to so the model reads it.

    Every alias present that holds the same value as the one ``lookup`` reads (a config may
    carry two names of one value); a present alias with another value names something else
    (a Mamba ``num_heads`` beside ``num_attention_heads``) and is left alone. The standard key
    when the config has none.
    """
    value, key = lookup(cfg, name, attribute_map)
    if key is None:
        return [STANDARD[name]]
    return [k for k in _candidates(name, attribute_map) if _present(cfg.get(k)) and cfg[k] == value]


def kv_heads(
    cfg: dict[str, Any], heads: int, attribute_map: dict[str, str] | None = None
) -> tuple[int, str]:
    """(KV heads, the config key that decided them: "" for none), with the flags vendors
    gate them by (``kv_heads_note`` says how a flag decided).

    ChatGLM's ``multi_query_group_num`` counts only when ``multi_query_attention`` is true.
    Falcon's ``multi_query=true`` means one KV head unless ``new_decoder_architecture`` (then
    ``num_kv_heads`` holds the count); GPT-BigCode's ``multi_query`` has no count at all.
    """
    if cfg.get("multi_query") and not cfg.get("new_decoder_architecture"):
        return 1, "multi_query"
    value, key = lookup(cfg, "num_kv_heads", attribute_map)
    if key == "multi_query_group_num":
        if not cfg.get("multi_query_attention"):
            return heads, "multi_query_attention"
        return int(value), key
    if key is None or not value:
        return heads, ""
    return int(value), key


def kv_heads_note(cfg: dict[str, Any], key: str) -> str | None:
    """Why a vendor flag decided the KV heads read from ``key``, or None for a plain count."""
    if key == "multi_query":
        return "multi_query=true (no new_decoder_architecture): one KV head shared by all"
    if key == "multi_query_attention":
        return "multi_query_attention is not true, so multi_query_group_num is unused: MHA"
    if key == "multi_query_group_num":
        return "multi_query_group_num counts the KV heads under multi_query_attention=true"
    return None


def kv_heads_keys(cfg: dict[str, Any], attribute_map: dict[str, str] | None = None) -> list[str]:
    """Keys a new KV head count goes to: none when a flag, not a count, sets them (Falcon's
    and GPT-BigCode's ``multi_query``, ChatGLM without ``multi_query_attention``)."""
    if cfg.get("multi_query") and not cfg.get("new_decoder_architecture"):
        return []
    value, key = lookup(cfg, "num_kv_heads", attribute_map)
    if key == "multi_query_group_num" and not cfg.get("multi_query_attention"):
        return []
    return write_keys(cfg, "num_kv_heads", attribute_map)


# -- attribute maps ----------------------------------------------------------------------------


def class_attribute_map(model_type: str | None) -> dict[str, str]:
    """The installed transformers config class's ``attribute_map`` for a model type."""
    if not model_type:
        return {}
    from transformers import CONFIG_MAPPING

    try:
        config_class = CONFIG_MAPPING[model_type]
    except KeyError:
        return {}
    mapping = getattr(config_class, "attribute_map", None)
    return {str(k): str(v) for k, v in mapping.items()} if isinstance(mapping, dict) else {}


def source_attribute_map(directory: Path, config: dict[str, Any]) -> dict[str, str]:
    """``attribute_map`` of the config class a model directory ships, read with libcst.

    The class ``auto_map.AutoConfig`` names, else the one whose ``model_type`` is the
    config's; {} when neither declares a literal map.
    """
    auto = (config.get("auto_map") or {}).get("AutoConfig")
    class_name = auto.rsplit(".", 1)[-1] if isinstance(auto, str) else None
    for path in sorted(Path(directory).glob("configuration_*.py")):
        maps = _file_attribute_maps(str(path), path.stat().st_mtime_ns)
        for name, (model_type, mapping) in maps.items():
            if name == class_name or (
                class_name is None and model_type == config.get("model_type")
            ):
                return dict(mapping)
    return {}


def attribute_map_for(
    model_type: str | None, config: dict[str, Any], directory: Path | None, remote: bool
) -> dict[str, str]:
    """The attribute_map of the class that builds ``config``: the directory's own class for
    remote code, else the installed transformers' class for the (text) model type."""
    if remote and directory is not None:
        return source_attribute_map(directory, config)
    inner, prefix = decoder_config(config)
    if prefix:
        model_type = inner.get("model_type") or model_type
    return class_attribute_map(model_type)


def source_config_defaults(directory: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Attribute -> default of the config class a model directory ships, read with libcst:
    ``self.X = param`` in its ``__init__`` where ``param`` has a literal default (an int,
    float, string, bool or None). What transformers' config object holds for a key the
    config.json omits; {} when the class is not found."""
    auto = (config.get("auto_map") or {}).get("AutoConfig")
    class_name = auto.rsplit(".", 1)[-1] if isinstance(auto, str) else None
    for path in sorted(Path(directory).glob("configuration_*.py")):
        defaults = _file_config_defaults(str(path), path.stat().st_mtime_ns)
        for name, (model_type, values) in defaults.items():
            if name == class_name or (
                class_name is None and model_type == config.get("model_type")
            ):
                return dict(values)
    return {}


@lru_cache(maxsize=64)
def _file_config_defaults(
    path: str, mtime_ns: int
) -> dict[str, tuple[str | None, tuple[tuple[str, Any], ...]]]:
    """class name -> (its ``model_type`` literal, its ``__init__``'s literal defaults)."""
    try:
        module = cst.parse_module(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, cst.ParserSyntaxError):
        return {}
    found: dict[str, tuple[str | None, tuple[tuple[str, Any], ...]]] = {}
    for node in module.body:
        if not isinstance(node, cst.ClassDef):
            continue
        model_type, init = None, None
        for stmt in node.body.body:
            assign = _class_assign(stmt)
            if assign and assign[0] == "model_type" and isinstance(assign[1], cst.SimpleString):
                model_type = assign[1].evaluated_value
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
                init = stmt
        if init is not None:
            found[node.name.value] = (model_type, tuple(_init_defaults(init).items()))
    return found


def _init_defaults(init: cst.FunctionDef) -> dict[str, Any]:
    params = {
        p.name.value: _literal(p.default)
        for p in (*init.params.params, *init.params.kwonly_params)
        if p.default is not None
    }
    values: dict[str, Any] = {}
    for stmt in init.body.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if not isinstance(small, cst.Assign) or len(small.targets) != 1:
                continue
            target, value = small.targets[0].target, small.value
            if not (
                isinstance(target, cst.Attribute)
                and isinstance(target.value, cst.Name)
                and target.value.value == "self"
            ):
                continue
            if isinstance(value, cst.Name) and value.value in params:
                values[target.attr.value] = params[value.value]
    return {k: v for k, v in values.items() if v is not _NO_LITERAL}


_NO_LITERAL = object()


def _literal(node: cst.BaseExpression | None) -> Any:
    if isinstance(node, (cst.Integer, cst.Float, cst.SimpleString)):
        return node.evaluated_value
    if isinstance(node, cst.Name) and node.value in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[node.value]
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus):
        inner = _literal(node.expression)
        return -inner if isinstance(inner, (int, float)) else _NO_LITERAL
    return _NO_LITERAL


@lru_cache(maxsize=64)
def _file_attribute_maps(
    path: str, mtime_ns: int
) -> dict[str, tuple[str | None, tuple[tuple[str, str], ...]]]:
    """class name -> (its ``model_type`` literal, its literal ``attribute_map`` items)."""
    try:
        module = cst.parse_module(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, cst.ParserSyntaxError):
        return {}
    found: dict[str, tuple[str | None, tuple[tuple[str, str], ...]]] = {}
    for node in module.body:
        if not isinstance(node, cst.ClassDef):
            continue
        model_type, mapping = None, ()
        for stmt in node.body.body:
            assign = _class_assign(stmt)
            if assign is None:
                continue
            target, value = assign
            if target == "model_type" and isinstance(value, cst.SimpleString):
                model_type = value.evaluated_value
            elif target == "attribute_map" and isinstance(value, cst.Dict):
                mapping = _literal_pairs(value)
        if mapping:
            found[node.name.value] = (model_type, mapping)
    return found


def _class_assign(stmt: cst.CSTNode) -> tuple[str, cst.BaseExpression] | None:
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    small = stmt.body[0]
    if isinstance(small, cst.Assign) and len(small.targets) == 1:
        target = small.targets[0].target
        if isinstance(target, cst.Name):
            return target.value, small.value
    annotated = isinstance(small, cst.AnnAssign) and small.value is not None
    if annotated and isinstance(small.target, cst.Name):
        return small.target.value, small.value
    return None


def _literal_pairs(value: cst.Dict) -> tuple[tuple[str, str], ...]:
    pairs = []
    for element in value.elements:
        if not isinstance(element, cst.DictElement):
            continue
        key, val = element.key, element.value
        if isinstance(key, cst.SimpleString) and isinstance(val, cst.SimpleString):
            k, v = key.evaluated_value, val.evaluated_value
            if isinstance(k, str) and isinstance(v, str):
                pairs.append((k, v))
    return tuple(pairs)


# -- evidence ----------------------------------------------------------------------------------

#: ModelSpec field -> ALIASES name, for the values whose key the evidence names
_SPEC_FIELDS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_heads": "num_heads",
    "num_kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "intermediate_size": "intermediate_size",
    "max_positions": "max_positions",
}


def cite_vendor_keys(spec, attribute_map: dict[str, str], book) -> None:
    """One evidence line per value read from a vendor's key (not the standard one) or decided
    by a vendor flag, naming the key and, when it applies, the class's attribute_map entry."""
    for field_name, name in _SPEC_FIELDS.items():
        source = spec.sources.get(field_name)
        if not source:
            continue
        key = source.rsplit(".", 1)[-1]
        note = kv_heads_note({}, key) if name == "num_kv_heads" else None
        if key == STANDARD[name] and note is None:
            continue
        if key not in ALIASES[name] and key not in attribute_map.values() and note is None:
            continue  # derived (hidden_size / num_attention_heads), not read from a key
        value = getattr(spec, field_name)
        reason = f"{STANDARD[name]} = {value} read from `{key}`"
        mapped = attribute_map.get(STANDARD[name])
        if mapped == key:
            reason += f" (the config class's attribute_map: {STANDARD[name]} -> {key})"
        if note:
            reason += f"; {note}"
        book.cite("config", reason, book.cfg(source))

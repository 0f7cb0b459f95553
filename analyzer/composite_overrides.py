"""Which level of a composite config an override sets: its own keys or its ``text_config``.

A composite (vision-language) config keeps the language model's keys in ``text_config``, and
the decoder reads only that one. An override merged at the top level would instead become a
top-level attribute nothing reads, and a top-level ``num_hidden_layers`` hides ``text_config``
from the analyzer (``core.config_checks.decoder_config``), so ``num_hidden_layers=4`` once
planned a decoder with no heads. The rule, per override ``KEY=VALUE``:

* ``text_config.KEY`` sets KEY in the text config (KEY must be one the text config has,
  takes, or its modeling code reads);
* a plain ``KEY`` goes where the config has it: the text config, the composite's own keys
  (``image_token_id``), or both when both levels hold it (``dtype``, ``tie_word_embeddings``:
  one setting of the whole model, so the levels never disagree); a key neither level stores
  goes to the level whose class takes it, else (a name the modeling code reads) to the text
  config;
* ``text_config=<dict>`` replaces the text config; no other dotted key is taken (exit 2).

A config given without ``text_config`` whose class builds one from top-level keys
(dots3_note's and glm5_next's published flat ``config.json``, or their defaults) is overridden
at the top level, where that class reads every key; otherwise a missing ``text_config`` is
the class's default text config (less the per-layer lists a new layer count makes stale). A config without ``text_config`` is not composite: its overrides are
merged as given.

Example (qwen3_5, whose text keys live in ``text_config``)::

    num_hidden_layers=4,dtype=float32
    -> text_config.num_hidden_layers = 4, text_config.dtype = "float32", dtype = "float32"
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from kvskill.analyzer.override_keys import (
    DTYPE_KEYS,
    READ_BY_KVSKILL,
    canonical_dtype_key,
    init_parameters,
)
from kvskill.core.errors import BadInputError

TEXT_CONFIG = "text_config"
TEXT_PREFIX = f"{TEXT_CONFIG}."
#: keys that name the composite itself, never its text config
_OUTER_ONLY = frozenset({"model_type", TEXT_CONFIG})
#: a text config's decoder layer count (the lists sized by it go stale when it changes)
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


@dataclass(frozen=True, kw_only=True)
class ConfigLevels:
    """The keys each level of a composite config holds (``stored``) or accepts (``known``)."""

    #: what the config is called in messages ("the 'qwen3_5' config")
    where: str
    outer_stored: frozenset[str]
    outer_known: frozenset[str]
    text_stored: frozenset[str]
    text_known: frozenset[str]
    #: the text config the composite builds when the base names none (its class default)
    text_default: dict[str, Any]
    #: the base gives no text_config and the class builds one from top-level keys (its text
    #: keys stored at the top, or a class that forwards them), so overrides stay at the top
    flat: bool = False


@dataclass(frozen=True, kw_only=True)
class RoutedOverrides:
    """The overrides split by level, and the config they give."""

    config: dict[str, Any]
    #: every overridden key as a path into CONFIG ("text_config.num_hidden_layers", "dtype")
    paths: tuple[str, ...]


def route_overrides(
    base: dict[str, Any], overrides: dict[str, Any], levels: ConfigLevels
) -> RoutedOverrides:
    """BASE with OVERRIDES merged at the level each belongs to (module docstring).

    Raises:
        BadInputError: a key neither level has, or a dotted key other than text_config.KEY.
    """
    outer: dict[str, Any] = {}
    text: dict[str, Any] = {}
    for key, value in overrides.items():
        for level in _levels_of(key, levels):
            if level == "outer":
                outer[key] = value
            else:
                text[key.removeprefix(TEXT_PREFIX)] = value
    if levels.flat:
        # its class builds text_config from the top level: every override goes there
        top, base = canonical_dtype_key({**outer, **text}, base, levels.outer_stored)
        return RoutedOverrides(config=merge_overrides(base, top), paths=tuple(top))
    outer, base = canonical_dtype_key(outer, base, levels.outer_stored)
    merged = merge_overrides(base, outer)
    paths = list(outer)
    if text:
        given = merged.get(TEXT_CONFIG)
        if isinstance(given, dict):
            text_base = dict(given)
        else:
            text_base = _without_stale_lists(levels.text_default, text)
        text, text_base = canonical_dtype_key(text, text_base, levels.text_stored)
        merged[TEXT_CONFIG] = merge_overrides(text_base, text)
        paths += [TEXT_PREFIX + key for key in text]
    return RoutedOverrides(config=merged, paths=tuple(paths))


def class_levels(
    config_class: type,
    base: dict[str, Any],
    built: dict[str, Any],
    code_words: set[str],
    where: str,
) -> ConfigLevels | None:
    """The levels of a transformers config class's config for BASE (BUILT: its ``to_dict``
    for BASE without overrides); None when it builds no ``text_config`` (not composite)."""
    text = built.get(TEXT_CONFIG)
    if not isinstance(text, dict):
        return None
    text_class = _text_config_class(config_class, text)
    given_text = base.get(TEXT_CONFIG)
    text_given = set(given_text) if isinstance(given_text, dict) else set()
    outer_stored = frozenset(key for key in built if key != TEXT_CONFIG)
    return ConfigLevels(
        where=where,
        outer_stored=outer_stored,
        outer_known=outer_stored | set(base) | _class_keys(config_class),
        text_stored=frozenset(text),
        text_known=frozenset(text) | text_given | _class_keys(text_class) | code_words,
        text_default=text,
        flat=not isinstance(given_text, dict)
        and (
            any(k in base for k in _LAYER_COUNT_KEYS)
            or _builds_text_from_top(config_class, base, text)
        ),
    )


def _builds_text_from_top(config_class: type, base: dict[str, Any], text: dict[str, Any]) -> bool:
    """Whether the class builds ``text_config`` from top-level keys when it is given none
    (dots3_note, glm5_next, qwen2_5_vl): a layer count set at the top reaches it."""
    count_key = next((k for k in _LAYER_COUNT_KEYS if isinstance(text.get(k), int)), None)
    if count_key is None:
        return False
    probe = text[count_key] + 1
    kwargs = {key: value for key, value in base.items() if key != "model_type"}
    try:
        built = config_class(**{**kwargs, count_key: probe}).to_dict().get(TEXT_CONFIG)
    except Exception:  # noqa: BLE001 - a class that refuses the probe is read as not building
        return False
    return isinstance(built, dict) and built.get(count_key) == probe


def raw_levels(raw: dict[str, Any], known: set[str], where: str) -> ConfigLevels | None:
    """The levels of a config.json read as it is (remote code, whose config class is never
    run); KNOWN: the names its code mentions. None when it has no ``text_config``."""
    text = raw.get(TEXT_CONFIG)
    if not isinstance(text, dict):
        return None
    from transformers import PretrainedConfig

    common = init_parameters(PretrainedConfig) | set(PretrainedConfig().to_dict())
    outer_stored = frozenset(key for key in raw if key != TEXT_CONFIG)
    return ConfigLevels(
        where=where,
        outer_stored=outer_stored,
        outer_known=outer_stored | common,
        text_stored=frozenset(text),
        text_known=frozenset(text) | known | common,
        text_default={},
    )


def _text_config_class(config_class: type, text: dict[str, Any]) -> type | None:
    """The class that builds the text config: its model type's, else the composite's
    declared sub-config class (transformers 5 ``sub_configs``)."""
    from transformers import CONFIG_MAPPING, PretrainedConfig

    text_type = text.get("model_type")
    if isinstance(text_type, str) and text_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[text_type]
    declared = (getattr(config_class, "sub_configs", None) or {}).get(TEXT_CONFIG)
    if isinstance(declared, type) and issubclass(declared, PretrainedConfig):
        return declared
    return None


def _class_keys(config_class: type | None) -> set[str]:
    """Keys a config class takes in ``__init__`` or maps (``attribute_map``)."""
    if config_class is None:
        return set()
    return init_parameters(config_class) | set(getattr(config_class, "attribute_map", None) or {})


def _levels_of(key: str, levels: ConfigLevels) -> tuple[str, ...]:
    """ "outer", "text" or both, for one override key."""
    if key.startswith(TEXT_PREFIX):
        inner = key.removeprefix(TEXT_PREFIX)
        if "." in inner or not inner:
            raise BadInputError(
                f"--config-overrides: '{key}' reaches below a key of text_config; give the "
                "whole value (text_config.KEY=VALUE, VALUE a JSON object for a nested key)"
            )
        if inner not in levels.text_known | READ_BY_KVSKILL:
            _refuse(key, inner, levels.text_known, f"the text config of {levels.where}")
        return ("text",)
    if "." in key:
        raise BadInputError(
            f"--config-overrides: '{key}' names a key inside a sub-config of {levels.where}; "
            "only text_config.KEY reaches into one (the language model's config)"
        )
    if key in _OUTER_ONLY:
        return ("outer",)
    if key in DTYPE_KEYS:
        return ("outer", "text")
    for outer, text in (
        (levels.outer_stored, levels.text_stored),
        (levels.outer_known, levels.text_known | READ_BY_KVSKILL),
    ):
        found = tuple(name for name, keys in (("outer", outer), ("text", text)) if key in keys)
        if found:
            return found
    _refuse(key, key, levels.outer_known | levels.text_known, f"{levels.where} or its text_config")
    raise AssertionError("unreachable")  # pragma: no cover - _refuse raises


def _refuse(given: str, key: str, known: frozenset[str], where: str) -> None:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise BadInputError(
        f"--config-overrides: '{given}' is not a key of {where}, so it would change nothing{hint}"
    )


def _without_stale_lists(default: dict[str, Any], text: dict[str, Any]) -> dict[str, Any]:
    """The class-default text config, less the per-layer values a new layer count makes
    stale: lists of one entry per layer (``layer_types``) and dicts keyed by layer index
    (``per_layer_config``).

    NOTE: these are derived by the class from its own layer count, not given by a user; kept,
    32 ``layer_types`` would contradict ``num_hidden_layers=4``. The lists of a user's own
    config.json are kept, and the config class then names a mismatch (exit 2).
    """
    count_key = next((k for k in _LAYER_COUNT_KEYS if isinstance(default.get(k), int)), None)
    if count_key is None or count_key not in text:
        return dict(default)
    old = default[count_key]
    return {
        key: value for key, value in default.items() if key in text or not _is_per_layer(value, old)
    }


def _is_per_layer(value: Any, num_layers: int) -> bool:
    if isinstance(value, list):
        return len(value) == num_layers
    if isinstance(value, dict) and value:
        return all(str(index).isdigit() and int(index) < num_layers for index in value)
    return False


#: keys whose change must re-derive ``layer_types`` in the config class
PATTERN_KEYS = frozenset(
    {"use_sliding_window", "max_window_layers", "sliding_window", "sliding_window_pattern"}
)


def merge_overrides(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """BASE with OVERRIDES set (one level of a config)."""
    merged = {**base, **overrides}
    if PATTERN_KEYS & set(overrides) and "layer_types" not in overrides:
        # NOTE: a stale layer_types would hide the new pattern; let it be re-derived.
        merged.pop("layer_types", None)
    return merged

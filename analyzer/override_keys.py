"""``--config-overrides`` keys checked against the config they override.

A config class takes unknown keyword arguments silently (they become attributes nothing
reads), so a misspelt key such as ``num_hidden_layer=4`` would leave the model as it was and
the command would still exit 0. Every key must be one the config has, one its class takes or
maps (``attribute_map``), or a name the modeling or configuration code mentions (a model may
read ``getattr(config, "head_dim", default)`` for a key its config class does not store).

``dtype`` and ``torch_dtype`` name the same setting: transformers 5 stores ``dtype`` and still
accepts ``torch_dtype``; 4.x stores ``torch_dtype``. An override under either name is moved to
the name this config stores, so it is never shadowed by the other one in config.json.
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvskill.core.errors import BadInputError

DTYPE_KEYS = ("dtype", "torch_dtype")
#: keys kvskill itself reads from a config although transformers' config classes do not store
#: them (vLLM's name for a pinned SSM-state dtype, analyzer/config.py)
READ_BY_KVSKILL = frozenset({"mamba_ssm_cache_dtype"})
_WORD = re.compile(r"[A-Za-z_]\w*")


def canonical_dtype_key(
    overrides: dict[str, Any], base: dict[str, Any], stored: Iterable[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """OVERRIDES and BASE with a dtype override under the name STORED uses (the keys the
    config keeps); BASE loses the other spelling so it cannot win over the override."""
    given = [key for key in DTYPE_KEYS if key in overrides]
    if not given:
        return overrides, base
    if len(given) > 1:
        raise BadInputError(
            "--config-overrides sets both dtype and torch_dtype; they are one setting, give one"
        )
    stored = set(stored)
    target = next((key for key in DTYPE_KEYS if key in stored), given[0])
    overrides = {(target if key == given[0] else key): v for key, v in overrides.items()}
    base = {key: v for key, v in base.items() if key not in DTYPE_KEYS}
    return overrides, base


def init_parameters(config_class: type) -> set[str]:
    """Keyword names the config class and its bases take in ``__init__``."""
    names: set[str] = set()
    for klass in inspect.getmro(config_class):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        names.update(
            p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        )
    names.discard("self")
    return names


def mentioned_in(files: Iterable[str | Path]) -> set[str]:
    """Identifiers and quoted keys in configuration or modeling files (read, never run)."""
    words: set[str] = set()
    for file in files:
        try:
            words.update(_WORD.findall(Path(file).read_text(encoding="utf-8", errors="replace")))
        except OSError:
            continue
    return words


def check_override_keys(overrides: dict[str, Any], known: set[str], where: str) -> None:
    """Refuse (exit 2) an override key that is not in KNOWN, naming the closest key."""
    for key in overrides:
        if key in known or key in READ_BY_KVSKILL:
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise BadInputError(
            f"--config-overrides: '{key}' is not a key of {where}, so it would change nothing{hint}"
        )

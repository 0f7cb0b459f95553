"""``--config-overrides KEY=VALUE,...``: the one parser every verb uses."""

from __future__ import annotations

import json
from typing import Any

from kvskill.core.errors import BadInputError


def parse_overrides(text: str | None) -> dict[str, Any]:
    """Parse ``key=value,key=value``; values are JSON when they parse, else strings.

    Commas inside brackets or braces belong to the value, so
    ``layer_types=["full_attention","sliding_attention"],sliding_window=8`` works.
    """
    if not text:
        return {}
    result: dict[str, Any] = {}
    for item in _split_top_level(text):
        if not item.strip():
            continue
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise BadInputError(
                f"--config-overrides item '{item}' is not KEY=VALUE "
                "(example: num_hidden_layers=4,sliding_window=64)"
            )
        try:
            result[key] = json.loads(raw)
        except json.JSONDecodeError:
            result[key] = raw.strip()
    return result


def _split_top_level(text: str) -> list[str]:
    items, depth, start, quote = [], 0, 0, False
    for i, ch in enumerate(text):
        if ch == '"':
            quote = not quote
        elif not quote and ch in "[{":
            depth += 1
        elif not quote and ch in "]}":
            depth -= 1
        elif not quote and ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items

"""Collects decisions' evidence, warnings and implementer blockers while rules run."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from kvskill.analyzer.inputs import ModelSource, transformers_root
from kvskill.analyzer.plan import Evidence


@dataclass(kw_only=True)
class Notebook:
    """Evidence, warnings and blockers gathered in decision order (no duplicates)."""

    source: ModelSource
    evidence: list[Evidence] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    blockers: list[str] = field(default_factory=list)

    def cite(self, decision: str, reason: str, source: str) -> None:
        self.evidence.append(Evidence(decision=decision, reason=reason, source=source))

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    def block(self, message: str) -> None:
        if message not in self.blockers:
            self.blockers.append(message)

    def cfg(self, key: str | None) -> str:
        """Where a config key's value came from, e.g. ``config.json:sliding_window``."""
        if not key:
            return "config"
        # the key's path in the config the user overrode (a language model's in text_config)
        path = f"text_config.{key}" if self.source.delegated_from else key
        given = path.split("+")[0]
        if any(given == o or given.startswith(f"{o}.") for o in self.source.overridden):
            return f"--config-overrides {path}"
        if self.source.delegated_from:
            # The language model's config is the composite's text_config.
            key = f"text_config.{key}"
            if self.source.kind == "transformers":
                return f"{self.source.delegated_from} default config:{key}"
        elif self.source.kind == "transformers":
            return f"{self.source.model_type} default config:{key}"
        return f"config.json:{key}"


@lru_cache(maxsize=1)
def hf_window_rule_source() -> str:
    """``masking_utils.py:<line>`` of the installed transformers' sliding-window predicate.

    transformers admits key ``kv_idx`` for query ``q_idx`` iff ``kv_idx > q_idx - W`` (and
    causal), i.e. W keys including the query's own position.
    """
    path = transformers_root() / "masking_utils.py"
    try:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "kv_idx > q_idx - sliding_window" in line:
                return f"masking_utils.py:{number}"
    except OSError:
        pass
    return "transformers masking_utils.py (sliding_window_overlay)"

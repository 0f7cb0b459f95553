"""What ``verify`` found: per-prompt comparisons, the chains, and the verdict.

float32 is judged exactly (tokens identical, logits within ``atol`` plus float32 ulps of the
largest reference logit); float16 / bfloat16 by the noise-floor verdict of ``verdict.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvskill.verify.verdict import LowPrecisionVerdict


class Checked(str, Enum):
    """Which weights and config verify compared the two models on."""

    #: the directory's own checkpoint, at its full config
    REAL_WEIGHTS = "real_weights"
    #: a shrunk config with random weights (the default without weights, or --shrink)
    SHRUNK_TWIN = "shrunk_twin"
    #: the full config with random weights (--no-shrink on a directory without weights)
    RANDOM_WEIGHTS = "random_weights"

    def describe(self, directory: str) -> str:
        """The report's first line."""
        if self is Checked.REAL_WEIGHTS:
            return f"checked: the real weights of {directory}"
        if self is Checked.SHRUNK_TWIN:
            return f"checked: a shrunk random-weight twin of {directory} (not its weights)"
        return f"checked: the full config of {directory} with random weights (no weights)"


@dataclass(kw_only=True)
class PromptResult:
    index: int
    prompt_len: int
    reference_tokens: list[int]
    runtime_tokens: list[int]
    #: largest |reference - runtime| over the vocabulary and every compared step
    max_logit_diff: float
    #: first step whose token differs, or None
    first_mismatch: int | None
    #: largest |reference logit| over the compared steps: the scale of the relative tolerance
    logit_scale: float = 0.0
    #: the differing step was a near tie: the reference scored both tokens within atol
    #: (low-precision rounding may flip it; greedy continuations differ from there on)
    near_tie: bool = False

    @property
    def passed_tokens(self) -> bool:
        return self.reference_tokens == self.runtime_tokens or self.near_tie


@dataclass(kw_only=True)
class VerifyReport:
    model_type: str
    directory: str
    shrunk: bool
    config_changes: dict[str, list[Any]]
    dtype: str
    atol: float
    block_size: int
    rtol: float = 0.0
    kv_layout: str = "contiguous"
    #: the converted model decoded through captured graphs (``--graph``)
    graph: bool = False
    prompts: list[PromptResult] = field(default_factory=list)
    chains: list[dict[str, Any]] = field(default_factory=list)
    #: a failure that stopped the comparison (e.g. the converted forward raised)
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    checked: Checked = Checked.SHRUNK_TWIN
    #: float16 / bfloat16: the noise-floor verdict, which replaces the exact logit check
    low_precision: LowPrecisionVerdict | None = None
    #: --tp N: the split, rank 0's communication and the KV bytes per token per rank
    tensor_parallel: dict[str, Any] | None = None
    #: what the run was checked against besides the CPU reference (``profile_report``):
    #: checked (the NPU shape limits), checked_kinds, not_checked (one line each, why)
    npu_limits: dict[str, Any] | None = None

    @property
    def max_logit_diff(self) -> float:
        return max((p.max_logit_diff for p in self.prompts), default=math.inf)

    @property
    def tokens_identical(self) -> bool:
        return bool(self.prompts) and all(p.passed_tokens for p in self.prompts)

    def logit_tolerance(self, prompt: PromptResult) -> float:
        """atol plus rtol times the prompt's largest reference logit (see LOGIT_RTOL)."""
        return self.atol + self.rtol * prompt.logit_scale

    @property
    def logits_within(self) -> bool:
        return bool(self.prompts) and all(
            p.max_logit_diff <= self.logit_tolerance(p) for p in self.prompts
        )

    @property
    def comparison_passed(self) -> bool:
        """The models agree: exactly in float32, by the noise-floor verdict otherwise."""
        if self.low_precision is not None:
            return bool(self.prompts) and self.low_precision.passed
        return self.tokens_identical and self.logits_within

    @property
    def passed(self) -> bool:
        return (
            self.error is None
            and self.comparison_passed
            and bool(self.chains)
            and all(c["passed"] for c in self.chains)
        )

    @property
    def checked_line(self) -> str:
        return self.checked.describe(self.directory)

    def failures(self) -> list[str]:
        """One line per failed check."""
        lines = [f"error: {self.error}"] if self.error else []
        if self.low_precision is not None:
            return lines + self.low_precision.failures() + self._chain_failures()
        for p in self.prompts:
            if not p.passed_tokens:
                lines.append(
                    f"prompt {p.index} (len {p.prompt_len}): tokens differ from step "
                    f"{p.first_mismatch}: reference {p.reference_tokens} vs runtime "
                    f"{p.runtime_tokens}"
                )
            elif p.max_logit_diff > self.logit_tolerance(p):
                lines.append(
                    f"prompt {p.index} (len {p.prompt_len}): logits differ by "
                    f"{p.max_logit_diff:.3g} > {self.logit_tolerance(p):.3g} (atol "
                    f"{self.atol:g} + rtol {self.rtol:.2g} x largest logit {p.logit_scale:.3g})"
                )
        return lines + self._chain_failures()

    def _chain_failures(self) -> list[str]:
        return [f"{c['name']} chain: {f}" for c in self.chains for f in c["failures"]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "checked": self.checked.value,
            "checked_line": self.checked_line,
            "model_type": self.model_type,
            "directory": self.directory,
            "shrunk": self.shrunk,
            "config_changes": self.config_changes,
            "dtype": self.dtype,
            "atol": self.atol,
            "rtol": self.rtol,
            "block_size": self.block_size,
            "kv_layout": self.kv_layout,
            #: the runtime ran exact: the fast paths (kvskill run's default) are never judged
            "runtime_exact": True,
            "graph": self.graph,
            "tokens_identical": self.tokens_identical,
            "max_logit_diff": None if math.isinf(self.max_logit_diff) else self.max_logit_diff,
            "prompts": [
                {
                    "index": p.index,
                    "prompt_len": p.prompt_len,
                    "tokens_identical": p.reference_tokens == p.runtime_tokens,
                    "first_mismatch": p.first_mismatch,
                    "near_tie": p.near_tie,
                    "max_logit_diff": p.max_logit_diff,
                    "logit_scale": p.logit_scale,
                    "logit_tolerance": self.logit_tolerance(p),
                    "reference_tokens": p.reference_tokens,
                    "runtime_tokens": p.runtime_tokens,
                }
                for p in self.prompts
            ],
            "chains": self.chains,
            "error": self.error,
            "failures": self.failures(),
            "notes": self.notes,
            "low_precision": self.low_precision.to_dict() if self.low_precision else None,
            "npu_limits": self.npu_limits,
        } | ({"tensor_parallel": self.tensor_parallel} if self.tensor_parallel else {})

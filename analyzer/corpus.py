"""Analyse every causal-LM model type of the installed transformers: a Plan or a refusal each."""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from kvskill.core.errors import KvskillError


@dataclass(frozen=True, kw_only=True)
class CorpusResult:
    """Outcome for one model type."""

    model_type: str
    #: "plan" | "refused" (exit 3) | "bad_input" (exit 2) | "crash" (a bug)
    outcome: str
    seconds: float
    kv_mode: str | None = None
    attn_types: tuple[str, ...] = ()
    attention: str | None = None
    message: str | None = None


def corpus_model_types() -> list[str]:
    from kvskill.analyzer.inputs import causal_lm_model_types

    return sorted(causal_lm_model_types())


def analyze_one(model_type: str) -> CorpusResult:
    """Analyse one model type with defaults; every failure becomes a result, never a raise."""
    from kvskill.analyzer import analyze_model

    start = time.perf_counter()
    try:
        plan = analyze_model(model_type)
    except KvskillError as exc:
        outcome = "refused" if exc.exit_code == 3 else "bad_input"
        return CorpusResult(
            model_type=model_type,
            outcome=outcome,
            seconds=time.perf_counter() - start,
            message=str(exc),
        )
    except Exception as exc:  # noqa: BLE001 - the corpus run reports bugs instead of stopping
        return CorpusResult(
            model_type=model_type,
            outcome="crash",
            seconds=time.perf_counter() - start,
            message=f"{type(exc).__name__}: {exc}",
        )
    return CorpusResult(
        model_type=model_type,
        outcome="plan",
        seconds=time.perf_counter() - start,
        kv_mode=plan.kv_mode,
        attn_types=tuple(plan.attn_types),
        attention=plan.attention,
    )


def analyze_corpus(model_types: list[str] | None = None, workers: int = 1) -> list[CorpusResult]:
    """Analyse each type (in ``workers`` processes when > 1); results in input order."""
    types = model_types if model_types is not None else corpus_model_types()
    if workers <= 1:
        return [analyze_one(t) for t in types]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(analyze_one, types, chunksize=4))

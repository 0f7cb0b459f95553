"""Every causal-LM model type of the installed transformers: a Plan or a clear refusal."""

from __future__ import annotations

import os
from collections import Counter

import pytest
from kvskill.analyzer.corpus import analyze_corpus, corpus_model_types

#: types every run analyzes, whatever the sample: the ones asserted on below
NAMED = (
    *("llama", "qwen3", "gpt_oss", "deepseek_v3", "qwen3_next", "mixtral"),
    *("bart", "bert", "whisper"),
)


def _sample(types: list[str]) -> list[str]:
    """Every type with KVSKILL_CORPUS_FULL=1; otherwise every third type (sorted, so the
    sample is the same on every run) and the named ones, which keeps CI's slow suite inside
    its time budget. `scripts/verify_corpus.py` covers every type end to end."""
    if os.environ.get("KVSKILL_CORPUS_FULL") == "1":
        return types
    ordered = sorted(types)
    return sorted(set(ordered[::3]) | (set(NAMED) & set(ordered)))


@pytest.mark.slow
def test_every_causal_lm_type_gets_a_plan_or_a_refusal():
    types = corpus_model_types()
    assert len(types) > 150  # the installed transformers maps this many types to a causal LM
    results = analyze_corpus(_sample(types), workers=min(2, os.cpu_count() or 1))
    counts = Counter(r.outcome for r in results)
    print(f"\ncorpus: {len(results)} model types, {dict(counts)}")
    crashes = [f"{r.model_type}: {r.message}" for r in results if r.outcome == "crash"]
    assert crashes == []
    assert counts["bad_input"] == 0  # defaults are never bad input
    for result in results:
        if result.outcome == "refused":
            assert result.message and "\n" not in result.message.strip()
    by_type = {r.model_type: r for r in results}
    # decoders are planned, encoders and encoder-decoders refused
    for model_type in ("llama", "qwen3", "gpt_oss", "deepseek_v3", "qwen3_next", "mixtral"):
        assert by_type[model_type].outcome == "plan"
    for model_type in ("bart", "bert", "whisper"):
        assert by_type[model_type].outcome == "refused"
    assert counts["plan"] > counts["refused"]

"""Files written by the implementer lint clean, and the lint really reads them."""

from __future__ import annotations

import pytest
from kvskill.analyzer.lint import FileContext, lint_source
from kvskill.analyzer.lint.fa import fa_calls
from kvskill.implementer.writer import ApplyOptions, convert_model

# One model per FA path the implementer emits: FullAttention v1, sliding + sinks v2, MLA.
MODELS = ["qwen3", "gpt_oss", "deepseek_v3"]


@pytest.fixture(scope="module")
def converted() -> dict[str, str]:
    return {model: convert_model(model, ApplyOptions()).converted for model in MODELS}


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_generated_modeling_file_lints_clean(converted, model):
    source = converted[model]
    # The rules must actually see the converted attention, or "clean" means nothing.
    assert fa_calls(FileContext(source)), f"no fused-attention call found in {model}"
    assert lint_source(source, f"modeling_{model}.py") == []


@pytest.mark.slow
def test_a_mistake_in_generated_code_is_found(converted):
    source = converted["gpt_oss"]
    broken = source.replace(
        "block_table=md.block_table[self.attn_type]", "block_table=md.block_table"
    )
    broken = broken.replace("softmax_scale=self.scaling", "scale=self.scaling")
    assert broken != source
    assert {f.rule for f in lint_source(broken)} == {"KV005", "KV007"}
    # Sliding layers forced onto plain causal attention.
    full_only = source.replace(
        'sparse_mode=3 if self.attn_type == "FullAttention" else 4', "sparse_mode=3"
    )
    assert full_only != source
    assert [f.rule for f in lint_source(full_only)] == ["KV002"]

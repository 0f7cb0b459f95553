"""Captured decode (``LLM(graph=True)``): one graph per bucket, replayed, token-exact.

The capture runs dynamo with ``fullgraph=True`` (so any graph break fails) on the "eager"
backend: inductor's code generation takes about 40 s on this CPU and is measured by
``benchmarks/bench_captured_decode.py`` instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from kvskill.runtime import fused_layers, prepacked_linear
from kvskill.runtime.captured_decode import BACKEND_ENV, decode_buckets

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from captured_runs import decode_eager_and_captured  # noqa: E402

TINY_LLAMA = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
}


def test_buckets_double_to_4_then_step_by_8_up_to_the_batch_limit():
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    assert decode_buckets(32) == [1, 2, 4, 8, 16, 24, 32]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from kvskill.implementer.writer import ApplyOptions, apply_model

    out = tmp_path_factory.mktemp("graph") / "llama"
    apply_model("llama", out, ApplyOptions(config_overrides=TINY_LLAMA))
    return out


def _llm(model_dir, graph: bool):
    from kvskill.runtime import LLM

    return LLM(
        model_dir,
        random_weights=True,
        seed=1,
        block_size=16,
        num_blocks=32,
        max_num_seqs=4,
        max_model_len=128,
        cpu_only_shapes=True,
        graph=graph,
    )


@pytest.mark.slow
def test_captured_decode_is_token_exact_against_eager(tiny_llama, monkeypatch):
    from kvskill.runtime import SamplingParams

    monkeypatch.setenv(BACKEND_ENV, "eager")
    # four requests (bucket 4), then three (bucket 4, one padded row), then two (bucket 2)
    prompts = [[1, 5, 9, 33, 7], [4, 4, 100, 3, 2, 8, 9, 10, 11], [17], [2, 3]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 5, 7, 7)]
    runs = decode_eager_and_captured(lambda graph: _llm(tiny_llama, graph), prompts, params)
    assert runs.graph_tokens == runs.eager_tokens
    assert len(runs.graph_logits) == len(runs.eager_logits)
    assert runs.worst_logit_diff <= 1e-5
    llm = runs.graph_llm
    # the captured steps ran the fast paths the eager run had (their kernels are graph nodes)
    fast = {p.name: p.on for p in llm.fast_paths.paths}
    if all(m.unavailable_reason() is None for m in (prepacked_linear, fused_layers)):
        assert fast["prepack_linear"] and fast["fuse_layers"]
    stats = llm.engine.captured_decode.stats
    # buckets 4 (four, then three live requests) and 2, each captured once, then replayed:
    # the live count is a traced int, so a new count does not trace the bucket again
    assert sorted(stats.compiled_buckets) == [2, 4]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert stats.num_replays >= 4
    assert stats.num_eager_decode_steps == 0


def test_an_uncapturable_step_is_refused_in_one_line_naming_the_code():
    from kvskill.runtime.captured_decode import uncapturable_reason

    def reads_a_pointer(x):
        return x + (x.data_ptr() % 2)

    compiled = torch.compile(reads_a_pointer, backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported) as caught:
        compiled(torch.ones(2))
    reason = uncapturable_reason(caught.value)
    assert "\n" not in reason
    line = reads_a_pointer.__code__.co_firstlineno + 1
    assert f"test_captured_decode.py:{line}" in reason
    assert reason.endswith("run without graph capture (--graph / graph=True)")


def test_a_branch_on_a_data_dependent_size_is_refused_naming_its_line():
    from kvskill.runtime.captured_decode import (
        is_uncapturable,
        traced_scalar_reads,
        uncapturable_reason,
    )

    def branches_on_a_mask(x):
        kept = x[x > 0]
        if kept.numel():  # how many rows the mask keeps is known only when the step runs
            return kept.sum()
        return x.sum()

    compiled = torch.compile(branches_on_a_mask, backend="eager", fullgraph=True)
    torch._dynamo.reset()
    with pytest.raises(Exception) as caught, torch.inference_mode(), traced_scalar_reads():
        compiled(torch.ones(3))
    assert is_uncapturable(caught.value)
    assert not is_uncapturable(RuntimeError("a shape mismatch in the model"))
    reason = uncapturable_reason(caught.value)
    assert "\n" not in reason and "data-dependent" in reason
    line = branches_on_a_mask.__code__.co_firstlineno + 2
    assert f"test_captured_decode.py:{line}" in reason

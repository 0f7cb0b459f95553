"""DSA (DeepSeek-V3.2's indexed sparse MLA) on the paged path: what analyze plans, what apply
writes and refuses, and - slow - that the converted model is token-exact against transformers
with prompts longer than the indexer's top-k, under preemption and prefix caching, and that a
conversion attending to every position fails verify."""

from __future__ import annotations

import dataclasses
import importlib
import shutil
import sys
from pathlib import Path

import pytest
from kvskill.analyzer import analyze_model
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.mla import MlaSpec
from kvskill.implementer.pipeline import convert_mla_source
from kvskill.implementer.writer import ApplyOptions, apply_model
from kvskill.runtime import SamplingParams
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions
from kvskill.verify.shrink_mla import INDEX_N_HEADS, INDEX_TOPK, shrink_mla

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from captured_runs import decode_eager_and_captured  # noqa: E402
from mla_models import (  # noqa: E402
    build_pair,
    load_converted,
    prompts,
    reference_greedy,
    runtime_greedy,
    tiny_config,
)

MODEL = "deepseek_v32"
#: the indexer keeps 8 positions: the 19- and 33-token prompts lose some to it
TOPK = 8


def tiny_dsa(**extra) -> dict:
    """A 2-layer DSA model in the operators' shapes: 512 latent, 128-wide indexer keys."""
    return tiny_config(
        "deepseek_v3",
        kv_lora_rank=512,
        index_n_heads=16,
        index_head_dim=128,
        index_topk=TOPK,
        **extra,
    )


def _source() -> str:
    modeling = importlib.import_module(f"transformers.models.{MODEL}.modeling_{MODEL}")
    return Path(modeling.__file__).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def plan():
    return analyze_model(MODEL)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dsa") / "out"
    apply_model(MODEL, out, ApplyOptions(deploy_mode="framework"))
    return out


def test_plan_names_the_indexer_its_cache_and_operators(plan):
    assert plan.indexer is not None
    assert (plan.indexer.n_heads, plan.indexer.head_dim, plan.indexer.topk) == (64, 128, 2048)
    assert plan.indexer.key_cache == "indexer_key_cache"
    assert plan.indexer.key_cache_bytes_per_token == 128 * 2
    assert plan.indexer.operators == ["npu_lightning_indexer", "npu_sparse_flash_attention"]
    entries = [(e.cache_name, e.dim) for e in plan.cache_entries["FullAttention"]]
    assert entries == [("nope_cache", 512), ("rope_cache", 64), ("indexer_key_cache", 128)]
    # every cache counts: (latent 512 + rope 64 + indexer keys 128) x bf16 x 61 layers
    assert plan.kv_bytes_per_token == (512 + 64 + 128) * 2 * 61
    assert plan.sparse_mode["FullAttention"].prefill == 3
    assert plan.sparse_mode["FullAttention"].decode == 3
    assert plan.implementer_blockers == []
    assert not any("not converted" in w for w in plan.warnings)


def test_dense_mla_plans_no_indexer():
    assert analyze_model("deepseek_v3").indexer is None


def test_apply_pages_the_indexer_and_attends_sparsely(converted):
    code = (converted / f"modeling_{MODEL}.py").read_text()
    assert ".update_indexer(k" not in code
    assert "index_mask" not in code and "attention_interface(" not in code
    assert code.count("torch_npu.npu_lightning_indexer(") == 1
    assert code.count("torch_npu.npu_sparse_flash_attention(") == 1
    # the latent is written as ND rows (PA_BSND reads), not NZ
    assert 'cache_mode="PA_BNSD"' in code and "PA_NZ" not in code
    assert 'layout_key="PA_BSND"' in code and 'layout_kv="PA_BSND"' in code
    assert "sparse_count=self.index_topk" in code
    # the indexer no longer receives the dense mask (causality is sparse_mode 3)
    assert "attention_mask[:, 0, :, :]" not in code
    assert "self.indexer.key_cache = tensor" in code


def test_applying_to_a_conversion_writes_it_again_unchanged(converted, tmp_path):
    # the converted attention reads its caches with the sparse fused attention: analyze
    # must still find it, and apply must see it as converted
    apply_model(str(converted), tmp_path / "again", ApplyOptions(deploy_mode="framework"))
    name = f"modeling_{MODEL}.py"
    assert (tmp_path / "again" / name).read_text() == (converted / name).read_text()


def _spec(overrides: dict | None = None) -> MlaSpec:
    return MlaSpec.from_plan(analyze_model(MODEL, config_overrides=overrides or {}))


def test_an_indexer_that_scores_otherwise_is_refused():
    source = _source()
    anchor = "        scores = F.relu(scores)\n"
    assert source.count(anchor) == 1
    with pytest.raises(UnsupportedModelError, match="DeepseekV32Indexer.forward: the scores"):
        convert_mla_source(
            source.replace(anchor, ""), _spec(), package=f"transformers.models.{MODEL}"
        )


def test_a_dense_rewrite_never_drops_the_indexer():
    spec = dataclasses.replace(_spec(), indexer=None)
    with pytest.raises(UnsupportedModelError, match="selects the attended keys"):
        convert_mla_source(_source(), spec, package=f"transformers.models.{MODEL}")


def test_shrunk_twin_keeps_the_operator_dims_and_a_small_top_k():
    config = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_topk": 2048}
    config.update(index_n_heads=64, index_head_dim=128, q_lora_rank=1536)
    new = shrink_mla(config, {"num_hidden_layers": 2})
    assert new["kv_lora_rank"] == 512
    assert "index_head_dim" not in new  # 128, the indexer's only head dim, stays
    assert (new["index_n_heads"], new["index_topk"]) == (INDEX_N_HEADS, INDEX_TOPK)


@pytest.mark.slow
def test_captured_decode_has_no_graph_break_and_decodes_the_eager_tokens(
    tmp_path, converted, monkeypatch
):
    """The indexer over its paged key cache and the sparse attention over the paged latent are
    registered operators: the decode step captures with fullgraph (a graph break would fail
    the run), on dynamo's eager backend, and replays the eager run's tokens and logits.
    Slow: tracing the model takes 7 to 16 s on the shared 2-core machine; the fast guard is
    test_graph_ops.py's compiled DSA step."""
    import torch
    from kvskill.runtime import LLM
    from kvskill.runtime.captured_decode import BACKEND_ENV
    from transformers import AutoConfig

    module = load_converted(
        (converted / f"modeling_{MODEL}.py").read_text(encoding="utf-8"), "m.py", tmp_path
    )
    # one layer whose indexer keeps 4 positions: every prompt is longer, the selection decides
    config = AutoConfig.for_model(MODEL, **{**tiny_dsa(num_hidden_layers=1), "index_topk": 4})
    torch.manual_seed(0)
    model = module.DeepseekV32ForCausalLM(config).eval()
    monkeypatch.setenv(BACKEND_ENV, "eager")
    batch = prompts(5, lengths=(6, 8, 5))
    runs = decode_eager_and_captured(
        lambda graph: LLM(
            model, exact=True, block_size=16, num_blocks=16, max_num_seqs=4, graph=graph
        ),
        batch,
        SamplingParams(max_tokens=3, ignore_eos=True),
    )
    assert runs.graph_tokens == runs.eager_tokens
    assert runs.worst_logit_diff <= 1e-5
    stats = runs.graph_llm.engine.captured_decode.stats
    # three requests decoding together: bucket 4 (one padded row), captured once, replayed
    assert stats.compiled_buckets == [4]
    assert stats.num_replays == 1 and stats.num_eager_decode_steps == 0


# -- end to end ----------------------------------------------------------------------------


@pytest.mark.slow
def test_runtime_is_token_exact_and_holds_under_preemption_and_prefix_caching(tmp_path):
    overrides = tiny_dsa()
    _, reference, model, _ = build_pair(MODEL, overrides, tmp_path)
    batch = prompts(3, lengths=(5, 19, 33))
    assert max(len(p) for p in batch) > TOPK
    expected = reference_greedy(reference, batch, 6)
    roomy, _ = runtime_greedy(model, batch, 6, enable_prefix_caching=False)
    assert roomy == expected
    # four requests that each outgrow their first 16-token block while decoding, in a pool of
    # 6 blocks: running requests are preempted and recomputed, and the rerun of the same
    # prompts hits the prefix cache (latent, rope and indexer keys together)
    growing = prompts(4, lengths=(14, 15, 13, 30))
    expected = reference_greedy(reference, growing, 6)
    tight, llm = runtime_greedy(model, growing, 6, num_blocks=6)
    assert tight == expected
    assert llm.stats.num_preemptions > 0
    again = llm.generate(growing, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) > 0


@pytest.mark.slow
def test_verify_passes_and_fails_when_every_position_is_attended(tmp_path, converted):
    report = verify_directory(converted, VerifyOptions(num_prompts=2, max_new_tokens=4))
    assert report.error is None, report.error
    assert report.passed, report.failures
    # the indexer keeps every position (sparse_count past the prompts): dense attention
    mutant = tmp_path / "all-positions"
    shutil.copytree(converted, mutant)
    path = mutant / f"modeling_{MODEL}.py"
    text = path.read_text()
    assert text.count("sparse_count=self.index_topk") == 1
    path.write_text(text.replace("sparse_count=self.index_topk", "sparse_count=2048"))
    options = VerifyOptions(num_prompts=2, max_new_tokens=4, trust_remote_code=True)
    bad = verify_directory(mutant, options)
    assert not bad.passed
    assert bad.max_logit_diff > 100 * bad.atol


@pytest.mark.slow
def test_standalone_conversion_verifies(tmp_path):
    out = tmp_path / "standalone"
    apply_model(MODEL, out, ApplyOptions(deploy_mode="standalone"))
    report = verify_directory(out, VerifyOptions(num_prompts=2, max_new_tokens=4))
    assert report.error is None, report.error
    assert report.passed, report.failures

"""GLM-5.3's k-pool DSA indexer and rope-less latent (glm5_next) on the paged path: what apply
writes and refuses, and - slow - that the converted model is token-exact against transformers
with prompts far longer than the pools the indexer keeps, shared layers included, and that a
conversion attending every pool fails verify."""

from __future__ import annotations

import shutil
from pathlib import Path

import libcst as cst
import pytest
from kvskill.implementer.mla.pooled_indexer import PooledIndexerFacts, pooled_indexer_facts
from kvskill.implementer.writer import ApplyOptions, apply_model
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions
from kvskill.verify.shrink_mla import INDEX_KPOOL, INDEX_POOLS_KEPT, shrink_mla

pytest.importorskip("transformers.models.glm5_next")
from transformers.models.glm5_next import modeling_glm5_next  # noqa: E402
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig  # noqa: E402

MODEL = "glm5_next"
SOURCE = Path(modeling_glm5_next.__file__).read_text(encoding="utf-8")


def _indexer_facts(source: str) -> PooledIndexerFacts:
    """The facts of the source's indexer class, parsed alone (a whole-file conversion takes
    seconds; the slow test below converts and verifies the file)."""
    start = source.index("class Glm5NextTextIndexer(")
    end = source.index("\ndef repeat_kv(", start)
    (cls,) = [c for c in cst.parse_module(source[start:end]).body if isinstance(c, cst.ClassDef)]
    return pooled_indexer_facts(cls)


def test_the_indexer_facts_name_what_the_rewrite_keeps():
    facts = _indexer_facts(SOURCE)
    assert facts.problems == []
    assert (facts.key, facts.gate, facts.query, facts.weights) == (
        "k",
        "gate_scores",
        "q",
        "weights",
    )
    assert (facts.scale, facts.topk_attr, facts.pool_attr) == (
        "self.softmax_scale",
        "index_topk",
        "index_kpool",
    )
    assert facts.ape_attr == "index_kpool_compress_ape"
    # the valid-token channel reads the mask, which the paged call does not pass: dropped
    kept = "".join(cst.Module(body=[s]).code for s in facts.kept)
    assert "gate_scores = F.linear(" in kept and "attention_mask.to(" not in kept


def test_an_indexer_that_pools_otherwise_is_refused():
    anchor = " + self.index_kpool_compress_ape.float()[None, None]"
    assert SOURCE.count(anchor) == 1
    (problem,) = _indexer_facts(SOURCE.replace(anchor, "")).problems
    assert problem.startswith("Glm5NextTextIndexer.get_pooled_states: the pool is not weighted")


def test_an_indexer_that_scores_otherwise_is_refused():
    anchor = "F.relu(scores * self.softmax_scale)"
    assert SOURCE.count(anchor) == 1
    (problem,) = _indexer_facts(SOURCE.replace(anchor, "scores.abs()")).problems
    assert problem.startswith("Glm5NextTextIndexer.forward: the scores are not `relu(")


def test_shrunk_twin_keeps_pools_the_indexer_drops():
    text = Glm5NextConfig().text_config.to_dict()
    new = shrink_mla(text, {"num_hidden_layers": 4})
    assert new["index_kpool"] == INDEX_KPOOL
    assert new["index_topk"] == INDEX_KPOOL * INDEX_POOLS_KEPT
    assert new["kv_lora_rank"] == text["kv_lora_rank"] and new["qk_rope_head_dim"] == 0


def _shared_model(root: Path) -> Path:
    """glm5_next with "shared" layers: each attention pair's second reuses the first's pools."""
    text = Glm5NextConfig().text_config.to_dict()
    count = text["num_hidden_layers"]
    layers = ["indexed_attention" if i % 4 in (2, 3) else "linear_attention" for i in range(count)]
    kinds = ["shared" if i % 4 == 3 else "full" for i in range(count)]
    config = Glm5NextConfig(text_config={**text, "layer_types": layers, "indexer_types": kinds})
    config.save_pretrained(root / "model")
    return root / "model"


def _mutant(converted: Path, root: Path, name: str, old: str, new: str) -> Path:
    out = root / name
    shutil.copytree(converted, out)
    path = out / f"modeling_{MODEL}.py"
    text = path.read_text()
    assert text.count(old) == 1
    path.write_text(text.replace(old, new))
    return out


@pytest.fixture(scope="module")
def shared_out(tmp_path_factory) -> Path:
    """apply's framework output for glm5_next with "shared" layers."""
    root = tmp_path_factory.mktemp("glm5_next")
    out = root / "out"
    apply_model(str(_shared_model(root)), out, ApplyOptions(deploy_mode="framework"))
    return out


@pytest.mark.slow
def test_verify_passes_with_shared_layers_and_fails_when_every_pool_is_attended(
    tmp_path, shared_out
):
    out = shared_out
    options = VerifyOptions(num_prompts=2, max_new_tokens=4, trust_remote_code=True)
    text = (out / f"modeling_{MODEL}.py").read_text()
    # the latent alone is cached; the operator's rope inputs are zeros
    assert '"rope_cache"' not in text and text.count("key_rope=self.zero_key_rope(),") == 1
    assert "sparse_block_size=self.mla_sparse_block_size," in text
    # pooled keys (one row per pool) and open-pool rows, only where a layer runs its indexer
    assert "compress_ratio=config.index_kpool," in text
    assert "sliding_window=config.index_kpool," in text
    assert "packed_states = cache.update_indexer(" not in text
    report = verify_directory(out, options)
    assert report.error is None, report.error
    assert report.passed, report.failures
    assert report.config_changes["text_config.indexer_types"][1][-2:] == ["full", "shared"]
    # the indexer keeps every pool (sparse_count past the prompts' pools): dense attention
    every = _mutant(
        out,
        tmp_path,
        "every-pool",
        "sparse_count=self.index_topk // self.index_kpool,",
        "sparse_count=2048,",
    )
    bad = verify_directory(every, options)
    assert not bad.passed and bad.max_logit_diff > 100 * bad.atol


@pytest.mark.slow
def test_runtime_under_preemption_gives_the_roomy_runs_tokens(tmp_path, shared_out):
    """The shrunk conversion served from a pool too small for its requests: they are preempted
    and recomputed (pooled keys and open-pool rows rebuilt from their tokens), and every
    token equals a roomy run's. Prefix caching stays off: the KDA layers keep recurrent
    states."""
    import json

    import torch
    from kvskill.runtime import LLM, SamplingParams
    from kvskill.verify.shrink import shrink_config

    model_dir = tmp_path / "small"
    shutil.copytree(shared_out, model_dir)
    config = shrink_config(json.loads((model_dir / "config.json").read_text())).config
    (model_dir / "config.json").write_text(json.dumps(config))
    text = config["text_config"]
    # prompts of 9 to 17 pools against the 2 pools the indexer keeps
    assert text["index_topk"] // text["index_kpool"] == INDEX_POOLS_KEPT == 2
    generator = torch.Generator().manual_seed(0)
    batch = [
        torch.randint(3, text["vocab_size"], (n,), generator=generator).tolist()
        for n in (40, 45, 38, 70)
    ]

    def run(num_blocks: int):
        llm = LLM(
            model_dir, random_weights=True, seed=3, exact=True, block_size=16,
            num_blocks=num_blocks, cpu_only_shapes=True,
        )  # fmt: skip
        outs = llm.generate(batch, SamplingParams(max_tokens=12, ignore_eos=True))
        return [o.token_ids for o in outs], llm.stats

    roomy, roomy_stats = run(64)
    tight, tight_stats = run(10)
    assert roomy_stats.num_preemptions == 0 and tight_stats.num_preemptions > 0
    assert tight == roomy
    assert not tight_stats.prefix_caching

"""GLM-5's DSA (glm_moe_dsa) on the paged path: "full" layers run the indexer and keep its keys,
"shared" layers reuse the previous full layer's top-k and keep none. What analyze plans, what
apply writes and refuses, and - slow - that the converted model is token-exact against
transformers and that a shared layer attending elsewhere fails verify."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import libcst as cst
import pytest
from kvskill.analyzer import analyze_model
from kvskill.implementer.facts import module_classes
from kvskill.implementer.mla.facts import mla_attention_facts
from kvskill.implementer.writer import ApplyOptions, apply_model
from kvskill.runtime import SamplingParams
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions
from kvskill.verify.shrink import shrink_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from mla_models import build_pair, prompts, reference_greedy, runtime_greedy, tiny_config  # noqa: E402

MODEL = "glm_moe_dsa"
#: GLM-5's 78 layers with index_topk_freq 4 and index_skip_topk_offset 3: layers 0-2 full,
#: then every fourth (6, 10, ..., 74)
PATTERN = ["full" if max(i - 2, 0) % 4 == 0 else "shared" for i in range(78)]
#: a small model: full, two shared, full again (the reused top-k changes hands)
SMALL = ["full", "shared", "shared", "full"]
TOPK = 8
#: the source line of a shared layer, and a shared layer attending to position 0 only
REUSE = "            topk_indices = prev_topk_indices\n"
ZERO = "            topk_indices = torch.zeros_like(prev_topk_indices)\n"


def _source(model_type: str = MODEL) -> str:
    """The installed transformers' modeling file of MODEL_TYPE (found, not imported)."""
    found = importlib.util.find_spec(f"transformers.models.{model_type}.modeling_{model_type}")
    assert found is not None and found.origin is not None
    return Path(found.origin).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """A checkpoint's config as GLM-5 ships it: the pattern as a frequency and an offset,
    which transformers' config class turns into ``indexer_types``."""
    model_dir = tmp_path_factory.mktemp("glm5")
    config = {"model_type": MODEL, "architectures": ["GlmMoeDsaForCausalLM"]}
    config.update(num_hidden_layers=78, index_topk_freq=4, index_skip_topk_offset=3)
    (model_dir / "config.json").write_text(json.dumps(config))
    return analyze_model(str(model_dir))


def test_plan_names_the_indexer_layers_and_counts_their_keys_only(plan):
    assert plan.indexer is not None and plan.implementer_blockers == []
    owners = [i for i, k in enumerate(PATTERN) if k == "full"]
    assert plan.indexer.layers == owners and len(owners) == 21
    assert plan.indexer.shared_layers == [i for i, k in enumerate(PATTERN) if k == "shared"]
    # latent 512 + rope 64 on all 78 layers, the 128-wide indexer keys on the 21 full ones
    assert plan.kv_bytes_per_token == (512 + 64) * 2 * 78 + 128 * 2 * 21
    assert any(e.decision == "indexer.layers" for e in plan.evidence)


def test_a_first_layer_without_an_indexer_is_refused():
    plan = analyze_model(MODEL, config_overrides={"indexer_types": ["shared"] + ["full"] * 77})
    assert plan.indexer is None
    assert any("indexer_types[0] is 'shared'" in b for b in plan.implementer_blockers)


def _problems(classes: dict, attention: str, *, shared_layers: bool) -> list[str]:
    """What the MLA facts of the ATTENTION class say against a DSA rewrite."""
    cls = classes[attention]
    return mla_attention_facts(cls, classes, True, True, shared_layers=shared_layers).problems


def _classes(source: str) -> dict:
    return module_classes(cst.parse_module(source))


def test_an_indexer_run_on_every_layer_is_refused_when_the_plan_shares():
    # deepseek_v32's attention calls its indexer unconditionally: it cannot skip a layer
    classes = _classes(_source("deepseek_v32"))
    assert _problems(classes, "DeepseekV32Attention", shared_layers=False) == []
    problems = _problems(classes, "DeepseekV32Attention", shared_layers=True)
    assert len(problems) == 1 and "runs its indexer on every layer" in problems[0]
    assert "topk_indices = self.indexer(" in problems[0]


def test_a_shared_layer_that_does_not_reuse_the_passed_selection_is_refused():
    source = _source()
    assert _problems(_classes(source), "GlmMoeDsaAttention", shared_layers=True) == []
    assert source.count(REUSE) == 1
    classes = _classes(source.replace(REUSE, ZERO))
    problems = _problems(classes, "GlmMoeDsaAttention", shared_layers=True)
    reuse = [p for p in problems if "the else of `if self.indexer is not None:`" in p]
    assert len(reuse) == 1 and "does not end with `topk_indices = <parameter>`" in reuse[0]
    assert reuse[0].startswith("GlmMoeDsaAttention.forward:")


def test_shrunk_twin_keeps_a_full_and_a_shared_layer(plan):
    shrunk = shrink_config(plan.config).config
    kinds = shrunk["indexer_types"]
    assert len(kinds) == shrunk["num_hidden_layers"]
    assert kinds[0] == "full" and "shared" in kinds
    assert "sparse" in shrunk["mlp_layer_types"]
    assert shrunk["index_topk"] < 2048


# -- end to end ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """``apply`` of glm_moe_dsa with GLM-5's pattern of indexer and shared layers."""
    out = tmp_path_factory.mktemp("glm5") / "out"
    options = ApplyOptions(deploy_mode="framework", config_overrides={"indexer_types": PATTERN})
    apply_model(MODEL, out, options)
    return out


@pytest.mark.slow
def test_runtime_is_token_exact_with_shared_layers_under_preemption_and_prefix_caching(
    tmp_path, converted
):
    overrides = tiny_config(
        MODEL,
        num_hidden_layers=len(SMALL),
        indexer_types=SMALL,
        kv_lora_rank=512,
        index_n_heads=16,
        index_head_dim=128,
        index_topk=TOPK,
        qk_nope_head_dim=16,
        v_head_dim=24,
    )
    code = (converted / f"modeling_{MODEL}.py").read_text(encoding="utf-8")
    _, reference, model, _ = build_pair(MODEL, overrides, tmp_path, converted=code)
    shared = [i for i, layer in enumerate(model.model.layers) if layer.self_attn.indexer is None]
    assert shared == [1, 2]
    names = [[c.cache_name for c in info.caches] for info in model.get_cache_info().layer_infos]
    assert ["indexer_key_cache" in n for n in names] == [True, False, False, True]
    # prompts longer than the top-k that outgrow their first block in a pool of 6: preempted
    # and recomputed, then rerun from the prefix cache (the full layers' indexer keys cached
    # with the latents)
    growing = prompts(4, lengths=(14, 15, 13, 30))
    assert min(len(p) for p in growing) > TOPK
    expected = reference_greedy(reference, growing, 5)
    tight, llm = runtime_greedy(model, growing, 5, num_blocks=6)
    assert tight == expected
    assert llm.stats.num_preemptions > 0
    again = llm.generate(growing, SamplingParams(max_tokens=5, ignore_eos=True))
    assert [o.token_ids for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) > 0


@pytest.mark.slow
def test_apply_verifies_and_fails_when_a_shared_layer_attends_elsewhere(tmp_path, converted):
    out = converted
    assert json.loads((out / "config.json").read_text())["indexer_types"] == PATTERN
    code = (out / f"modeling_{MODEL}.py").read_text()
    # the indexer keys are declared only where the layer has an indexer
    entries = code.index("        if self.indexer is not None:\n            # Only a layer")
    assert code.index('cache_name="indexer_key_cache"') > entries
    assert code.count('cache_name="indexer_key_cache"') == 1
    # the shared branch is kept as written, the indexer call paged without the dense mask
    assert code.count(REUSE) == 1
    assert "attention_mask[:, 0, :, :]" not in code and ".update_indexer(k" not in code
    assert code.count("torch_npu.npu_lightning_indexer(") == 1
    assert "return attn_output, attn_weights, topk_indices" in code
    options = VerifyOptions(num_prompts=2, max_new_tokens=3)
    report = verify_directory(out, options)
    assert report.error is None, report.error
    assert report.passed, report.failures
    # the shared layers attend to position 0 instead of the full layer's selection
    mutant = tmp_path / "zero-selection"
    shutil.copytree(out, mutant)
    path = mutant / f"modeling_{MODEL}.py"
    text = path.read_text()
    assert text.count(REUSE) == 1
    path.write_text(text.replace(REUSE, ZERO))
    bad = verify_directory(mutant, dataclasses.replace(options, trust_remote_code=True))
    assert not bad.passed
    assert bad.max_logit_diff > 100 * bad.atol

"""Mistral Large 4 (mistral_large4): DSA MLA with a per-position query rescale after the cache
write, NoPE layers and cross-layer latent reuse. What the rescale check accepts and refuses,
what analyze states, what apply refuses, and - slow - that the converted model is token-exact
against transformers on prompts longer than the top-k."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import textwrap
from pathlib import Path

import libcst as cst
import pytest
from kvskill.analyzer import analyze_model
from kvskill.analyzer.query_rescale import query_rescale, rescale_sites
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.facts import module_classes
from kvskill.implementer.mla.facts import mla_attention_facts
from kvskill.implementer.mla.spec import CacheWrite, MlaSpec
from kvskill.implementer.writer import ApplyOptions, apply_model
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions

MODEL = "mistral_large4"
ATTENTION = "MistralLarge4TextAttention"


def _source_path() -> Path:
    found = importlib.util.find_spec(f"transformers.models.{MODEL}.modeling_{MODEL}")
    assert found is not None and found.origin is not None
    return Path(found.origin)


def test_both_softmax_scalings_are_found_as_per_position_rescales():
    sites = rescale_sites(str(_source_path()))
    owners = sorted((s.owner, s.module_class) for s in sites)
    assert owners == [
        ("MistralLarge4TextAttention", "MistralLarge4TextSoftmaxScaling"),
        ("MistralLarge4TextIndexer", "MistralLarge4TextSoftmaxScaling"),
    ]
    attention = next(s for s in sites if s.owner == ATTENTION)
    assert attention.statement.startswith("query_states = self.softmax_scaling(query_states,")


#: the module class of a rescale; FORWARD_BODY is its forward's body
RESCALE = """
class Scaling(nn.Module):
    def forward(self, q, position_ids):
{body}
"""
KEPT = "        factor = self.scale[None, :, None] * (position_ids + 1).float().log()[:, None, :]\n"


@pytest.mark.parametrize(
    ("body", "refused_because"),
    [
        (KEPT + "        return q * factor.unsqueeze(-1)\n", None),
        # a factor per element of the vector: not one factor per query vector
        (KEPT + "        return q * factor\n", "does not end with"),
        # a running sum mixes positions: the packed batch would give another factor
        (
            "        factor = position_ids.cumsum(-1).float()\n"
            "        return q * factor.unsqueeze(-1)\n",
            "calls `position_ids.cumsum(...)`",
        ),
        # reads the query's values into the factor
        (
            "        factor = q.norm(dim=-1)\n        return q * factor.unsqueeze(-1)\n",
            "calls `q.norm(...)`",
        ),
        # picks one position's value
        (
            "        factor = position_ids[:, 0].float()\n        return q * factor.unsqueeze(-1)\n",
            "indexes `0`",
        ),
    ],
)
def test_only_a_per_position_factor_is_kept(body, refused_because):
    module = cst.parse_module(textwrap.dedent(RESCALE).format(body=body))
    classes = module_classes(module)
    modules = {"scaling": cst.parse_expression("Scaling()")}
    assign = cst.ensure_type(
        cst.parse_statement("query = self.scaling(query, position_ids)").body[0], cst.Assign
    )
    found = query_rescale(assign, "query", modules, classes, {"query", "position_ids"})
    if refused_because is None:
        assert not isinstance(found, str) and found is not None and found.attr == "scaling"
    else:
        assert isinstance(found, str) and refused_because in found


def test_a_rescale_reading_a_name_bound_after_the_write_is_refused():
    body = KEPT + "        return q * factor.unsqueeze(-1)\n"
    classes = module_classes(cst.parse_module(textwrap.dedent(RESCALE).format(body=body)))
    assign = cst.ensure_type(
        cst.parse_statement("query = self.scaling(query, late)").body[0], cst.Assign
    )
    found = query_rescale(
        assign, "query", {"scaling": cst.parse_expression("Scaling()")}, classes, {"query"}
    )
    assert isinstance(found, str) and "reads ['late'], bound after the cache write" in found


def _problems(*, own_latent_only: bool, source: str | None = None) -> list[str]:
    classes = module_classes(cst.parse_module(source or _source_path().read_text()))
    facts = mla_attention_facts(
        classes[ATTENTION], classes, False, True, own_latent_only=own_latent_only
    )
    return facts.problems


def test_the_latent_handoff_is_dropped_only_when_the_config_proves_no_reader():
    assert _problems(own_latent_only=True) == []
    problems = _problems(own_latent_only=False)
    assert len(problems) == 1
    assert "stores into shared_kv_states (`shared_kv_states[" in problems[0]


def test_another_rebind_of_the_query_still_refuses():
    source = _source_path().read_text()
    scaled = "query_states = self.softmax_scaling(query_states, position_ids, head_dim_first=True)"
    assert source.count(scaled) == 1
    problems = _problems(
        own_latent_only=True, source=source.replace(scaled, "query_states = query_states * 2.0")
    )
    assert len(problems) == 1 and "rebinds query_states" in problems[0]
    assert "(query_states = query_states * 2.0)" in problems[0]


def _small_config(tmp_path: Path, **text) -> Path:
    """A 4-layer Mistral Large 4 (layer 3 NoPE) as a checkpoint's config.json."""
    from transformers import MistralLarge4Config

    config = MistralLarge4Config().to_dict()
    layers = 4
    text_config = config["text_config"]
    for key in ("no_rope_layers", "indexer_types", "mlp_layer_types", "layer_types"):
        text_config[key] = text_config[key][:layers]
    text_config.update({"num_hidden_layers": layers, "kv_source_layers": list(range(layers))})
    text_config.update(text)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """The Plan of a 4-layer Mistral Large 4 whose layers each keep their own latent."""
    return analyze_model(str(_small_config(tmp_path_factory.mktemp("own"))))


def test_plan_states_nope_layers_and_rescales_and_blocks_latent_reuse(plan, tmp_path):
    assert plan.mla is not None and plan.mla.nope_layers == [3] and plan.mla.reused_latent == {}
    assert plan.implementer_blockers == []
    decisions = {e.decision for e in plan.evidence}
    assert {"mla.nope_layers", "mla.reused_latent", "query_rescale", "indexer"} <= decisions
    reused = analyze_model(str(_small_config(tmp_path / "reuse", kv_source_layers=[0, 0, 2, 3])))
    assert reused.mla is not None and reused.mla.reused_latent == {"1": 0}
    assert any(
        "layers 1<-0 attend to another layer's latent" in b for b in reused.implementer_blockers
    )


@pytest.fixture(scope="module")
def converted_out(tmp_path_factory) -> Path:
    """apply's framework output for the 4-layer model (layer 3 NoPE)."""
    root = tmp_path_factory.mktemp("converted")
    out = root / "out"
    apply_model(str(_small_config(root / "model")), out, ApplyOptions(deploy_mode="framework"))
    return out


@pytest.mark.slow
def test_converted_model_is_token_exact_on_prompts_longer_than_the_top_k(converted_out):
    out = converted_out
    converted = (out / "modeling_mistral_large4.py").read_text()
    # the rescale runs on both query parts, the NoPE layers pad their rope inputs
    assert "q_pass = self.softmax_scaling(q_pass, position_ids, head_dim_first=True)" in converted
    assert "q_rot = self.softmax_scaling(q_rot, position_ids, head_dim_first=True)" in converted
    assert "rope_key = torch.nn.functional.pad(" in converted
    report = verify_directory(out, VerifyOptions(num_prompts=2, max_new_tokens=3))
    # the shrunk twin keeps 24 of the positions: a longer prompt makes the indexer choose
    assert max(p.prompt_len for p in report.prompts) > 24
    assert report.passed, [(p.prompt_len, p.max_logit_diff) for p in report.prompts]


@pytest.mark.slow
def test_runtime_holds_under_preemption_and_prefix_caching(tmp_path, converted_out):
    """The shrunk conversion served from a pool too small for its requests (preempted and
    recomputed) gives a roomy run's tokens, and a rerun of the same prompts hits the prefix
    cache (latent, rope and indexer keys together) with the same tokens again."""
    import shutil

    import torch
    from kvskill.runtime import LLM, SamplingParams
    from kvskill.verify.shrink import shrink_config

    model_dir = tmp_path / "small"
    shutil.copytree(converted_out, model_dir)
    config = shrink_config(json.loads((model_dir / "config.json").read_text())).config
    (model_dir / "config.json").write_text(json.dumps(config))
    text = config["text_config"]
    generator = torch.Generator().manual_seed(0)
    # longer than the top-k the shrunk indexer keeps, and outgrowing their first block
    batch = [
        torch.randint(3, text["vocab_size"], (n,), generator=generator).tolist()
        for n in (30, 31, 29, 46)
    ]
    assert min(map(len, batch)) > text["index_topk"]
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    def serve(num_blocks: int):
        llm = LLM(
            model_dir, random_weights=True, seed=3, exact=True, block_size=16,
            num_blocks=num_blocks, cpu_only_shapes=True,
        )  # fmt: skip
        return llm, [o.token_ids for o in llm.generate(batch, params)]

    roomy_llm, roomy = serve(64)
    tight_llm, tight = serve(11)
    assert roomy_llm.stats.num_preemptions == 0 and tight_llm.stats.num_preemptions > 0
    assert tight == roomy
    again = tight_llm.generate(batch, params)
    assert [o.token_ids for o in again] == roomy
    assert sum(o.num_cached_tokens for o in again) > 0


def test_nope_layers_are_refused_where_their_zero_rope_inputs_are_not_emitted(plan):
    assert MlaSpec.from_plan(plan).nope_layers
    # dense MLA (no indexer): its seam has no zero rope inputs for the NoPE layers
    with pytest.raises(UnsupportedModelError, match=r"NoPE layers \[3\] \(no rope part\) on dense"):
        MlaSpec.from_plan(dataclasses.replace(plan, indexer=None))
    # the fused write rotates a 64-wide rope key, which a NoPE layer does not have
    fused = dataclasses.replace(plan, mla_cache_write=CacheWrite.FUSED)
    with pytest.raises(UnsupportedModelError, match="npu_kv_rmsnorm_rope_cache rotates"):
        MlaSpec.from_plan(fused)


def test_a_directory_holding_its_own_copy_of_the_file_finds_the_same_head(tmp_path):
    # what apply writes (the file beside config.json, no auto_map): re-applying reads it as
    # local code and must find the vision-language head again, not refuse for want of a
    # *ForCausalLM class
    model = _small_config(tmp_path / "copy")
    (model / _source_path().name).write_text(_source_path().read_text())
    plan = analyze_model(str(model))
    assert plan.architecture == "MistralLarge4ForConditionalGeneration"
    assert plan.source.kind == "remote_code"

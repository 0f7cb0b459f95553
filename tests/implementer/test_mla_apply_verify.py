"""MLA end to end: analyze -> apply -> verify for deepseek_v3 / deepseek_v2, plus mutations
that verify must catch and the latent cache's memory accounting."""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import pytest
from kvskill.analyzer import analyze_model
from kvskill.analyzer.plan import CacheEntryPlan
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.writer import ApplyOptions, apply_model
from kvskill.runtime import LLM
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from mla_models import YARN, build_pair, tiny_config  # noqa: E402

pytestmark = pytest.mark.slow

#: small verify runs: a short prompt and one that spans several 16-token blocks and
#: prefill chunks
VERIFY = VerifyOptions(num_prompts=2, max_new_tokens=4)
#: mutations only need to show a difference: one short prompt (prefill + decode)
# mutants are files kvskill did not write (nor sign): they run only when trusted
VERIFY_MUTANT = VerifyOptions(num_prompts=1, max_new_tokens=3, trust_remote_code=True)
MUTANT_LONG = dataclasses.replace(VERIFY, trust_remote_code=True)
#: transformers' default deepseek_v2 config leaves num_experts_per_tok unset (its router
#: cannot run); DeepSeek-V2 checkpoints set it
V2_MOE = {"num_experts_per_tok": 2}


def apply_to(tmp: Path, model_type: str, overrides: dict) -> Path:
    out = tmp / f"{model_type}-out"
    apply_model(model_type, out, ApplyOptions(config_overrides=overrides))
    return out


@pytest.mark.parametrize(
    ("model_type", "overrides", "cache_write"),
    [
        # q_lora_rank set, YaRN with mscale_all_dim, interleaved rope -> fused write
        ("deepseek_v3", {"rope_parameters": {"rope_theta": 10000.0, **YARN}}, "fused"),
        # no q_lora_rank, no YaRN, rotate-half rope -> scatter write
        ("deepseek_v3", {"q_lora_rank": None, "rope_interleave": False}, "scatter"),
        # q_lora_rank set, no YaRN, complex rope -> scatter write
        ("deepseek_v2", {**V2_MOE}, "scatter"),
        # no q_lora_rank, YaRN, a dense layer before the MoE layers
        (
            "deepseek_v2",
            {
                **V2_MOE,
                "q_lora_rank": None,
                "first_k_dense_replace": 1,
                "rope_parameters": {"rope_theta": 10000.0, **YARN},
            },
            "scatter",
        ),
    ],
    ids=["v3-qlora-yarn-fused", "v3-noqlora-half-scatter", "v2-qlora", "v2-noqlora-yarn"],
)
def test_apply_verify_is_token_exact(tmp_path, model_type, overrides, cache_write):
    out = apply_to(tmp_path, model_type, overrides)
    plan = (out / "kvskill_plan.json").read_text()
    assert f'"mla_cache_write": "{cache_write}"' in plan
    code = (out / f"modeling_{model_type}.py").read_text()
    fused = cache_write == "fused"
    assert ('cache_mode="PA_NZ"' in code) == fused
    assert ("self.update_latent_cache(" in code) == (not fused)
    # the fused write normalises the latent: the source's own norm of it is gone
    assert ("kv_nope = self.kv_a_layernorm(kv_nope)" in code) == (
        not fused and model_type == "deepseek_v3"
    )
    report = verify_directory(out, VERIFY)
    assert report.error is None, report.error
    assert report.passed, report.failures
    assert all(c["passed"] for c in report.chains)
    assert all(p.passed_tokens for p in report.prompts)
    # the shrunk config keeps the operator's MLA limits
    changes = report.config_changes
    assert "qk_rope_head_dim" not in changes
    assert changes["kv_lora_rank"][1] in (128, 512)
    assert (changes.get("q_lora_rank", [None, None])[1] is None) == ("q_lora_rank" in overrides)


@pytest.fixture(scope="module")
def applied_v3_yarn(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("mla")
    return apply_to(tmp, "deepseek_v3", {"rope_parameters": {"rope_theta": 10000.0, **YARN}})


def mutate(src: Path, dst: Path, old: str, new: str, count: int = 1) -> Path:
    shutil.copytree(src, dst)
    path = dst / "modeling_deepseek_v3.py"
    text = path.read_text()
    assert text.count(old) == count, f"mutation anchor {old!r} not found {count} time(s)"
    path.write_text(text.replace(old, new))
    return dst


MUTATIONS = {
    # the seed's "scale without mscale^2": YaRN models attend too flat, silently (both the
    # prefill and the decode call)
    "missing_mscale": ("scale=self.scaling,", "scale=self.qk_head_dim ** -0.5,", "logits", 2),
    # prefill without causal masking (sparse_mode 0, no mask): future tokens leak in
    "prefill_sparse_mode_0": (
        "atten_mask=md.attention_mask,\n                sparse_mode=3,",
        "atten_mask=None,\n                sparse_mode=0,",
        "logits",
        1,
    ),
    # the prefill reads every context token from the request's first block: a later chunk
    # (or any prompt longer than a block) attends to the wrong latents
    "prefill_reads_one_block": (
        "block = block_table[request, position // block_size].long()",
        "block = block_table[request, position * 0].long()",
        "logits",
        1,
    ),
    # FA told the latent has one head per query head: the cache has one head
    "wrong_num_key_value_heads": (
        "num_key_value_heads=self.num_key_value_heads_per_rank,",
        "num_key_value_heads=self.num_heads_per_rank,",
        "heads",
        1,
    ),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_verify_catches_mutation(tmp_path, applied_v3_yarn, name):
    old, new, symptom, count = MUTATIONS[name]
    out = mutate(applied_v3_yarn, tmp_path / name, old, new, count)
    # a wrong block shows only in prompts longer than one block
    options = VERIFY_MUTANT if name != "prefill_reads_one_block" else MUTANT_LONG
    report = verify_directory(out, options)
    assert not report.passed
    if symptom == "logits":
        # silent numerical bugs: the run completes, the logits give them away
        assert report.error is None
        assert report.max_logit_diff > 100 * report.atol
    else:
        assert report.error is not None and symptom in report.error


def test_decode_with_sparse_mode_3_still_verifies(tmp_path, applied_v3_yarn):
    """The causal tile in decode is allowed (only wasteful): one query sees every key."""
    out = mutate(
        applied_v3_yarn,
        tmp_path / "decode3",
        "atten_mask=None,\n                sparse_mode=0,",
        "atten_mask=md.attention_mask,\n                sparse_mode=3,",
    )
    report = verify_directory(out, dataclasses.replace(VERIFY, trust_remote_code=True))
    assert report.passed, report.failures


def test_latent_cache_memory_matches_plan(tmp_path):
    """kv_bytes_per_token = (kv_lora_rank + rope) x dtype size x layers, and the runtime
    allocates exactly that per token slot."""
    overrides = tiny_config("deepseek_v3", dtype="float32")
    plan = analyze_model("deepseek_v3", config_overrides=overrides)
    assert plan.kv_bytes_per_token == (128 + 64) * 4 * 2
    assert plan.cache_entries["FullAttention"] == [
        CacheEntryPlan(
            cache_name="nope_cache",
            dim=128,
            num_head=1,
            dtype="float32",
            sliding_window=None,
        ),
        CacheEntryPlan(
            cache_name="rope_cache",
            dim=64,
            num_head=1,
            dtype="float32",
            sliding_window=None,
        ),
    ]
    _, _, model, _ = build_pair("deepseek_v3", overrides, tmp_path)
    info = model.get_cache_info()
    assert info.is_mla_backend
    caches = [c for layer in info.layer_infos for c in layer.caches]
    assert [(c.cache_name, c.num_head) for c in caches] == [
        ("nope_cache", 1),
        ("rope_cache", 1),
    ] * 2
    LLM(model, block_size=16, num_blocks=10)
    attentions = [m for m in model.modules() if hasattr(m, "cache_entries")]
    tensors = [t for m in attentions for t in (m.nope_cache, m.rope_cache)]
    assert [tuple(t.shape) for t in tensors] == [(10, 16, 1, 128), (10, 16, 1, 64)] * 2
    allocated = sum(t.numel() * t.element_size() for t in tensors)
    assert allocated == plan.kv_bytes_per_token * 10 * 16


def test_verify_shrink_routes_to_two_experts_when_the_config_leaves_top_k_unset():
    from kvskill.verify.shrink import shrink_config
    from transformers import AutoConfig

    config = AutoConfig.for_model("deepseek_v2").to_dict()
    assert config["num_experts_per_tok"] is None  # transformers' default
    shrunk = shrink_config(config)
    assert shrunk.config["num_experts_per_tok"] == 2
    assert shrunk.changes["num_experts_per_tok"] == (None, 2)
    # A top-k the config sets is kept.
    kept = shrink_config({**config, "num_experts_per_tok": 6})
    assert kept.config["num_experts_per_tok"] == 6


def test_page_pool_verify_of_mla_is_refused_as_unsupported(applied_v3_yarn):
    # The NZ latent caches need one dense tensor; the refusal comes before any model is built.
    with pytest.raises(UnsupportedModelError, match="contiguous"):
        verify_directory(applied_v3_yarn, VerifyOptions(kv_layout="page_pool"))


def test_page_pool_run_of_mla_exits_3_before_building_the_model(applied_v3_yarn, capsys):
    from kvskill.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["run", str(applied_v3_yarn), "--random-weights", "--num-requests", "1",
              "--kv-layout", "page_pool"])  # fmt: skip
    assert exc.value.code == 3
    assert "contiguous" in capsys.readouterr().err


def test_no_latent_or_rope_row_is_read_before_it_is_written(tmp_path):
    from kvskill.runtime import SamplingParams
    from mla_models import prompts
    from unwritten_rows import clean_and_poisoned_tokens

    overrides = tiny_config("deepseek_v3", dtype="float32")  # as the test above: one conversion
    _, _, model, _ = build_pair("deepseek_v3", overrides, tmp_path)
    # NaN in every block but the null block of the latent and rope caches
    clean, poisoned = clean_and_poisoned_tokens(
        lambda: LLM(model, exact=True, block_size=16, num_blocks=16, free_block_order_seed=7),
        prompts(),
        SamplingParams(max_tokens=6, ignore_eos=True),
    )
    assert poisoned == clean

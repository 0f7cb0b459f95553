"""The MLA codemods on a latent-attention model with its own names (found by structure):
conversion runs token-exact in the runtime, is idempotent, splits kv_b_proj after loading,
and refuses what the fused MLA path cannot express."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from kvskill.analyzer import analyze_model
from kvskill.analyzer.mla_write import decide_mla_cache_write
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.mla import CacheWrite, MlaSpec
from kvskill.implementer.pipeline import convert_mla_source
from kvskill.implementer.spec import FaVersion
from kvskill.runtime import LLM, SamplingParams

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))
from mla_models import load_converted  # noqa: E402

TOY = (FIXTURES / "mla_toy_modeling.py").read_text(encoding="utf-8")


def spec(write: CacheWrite, version: FaVersion = FaVersion.V1) -> MlaSpec:
    return MlaSpec(
        fa_version=version,
        input_layout="TND_NTD",
        attn_type="FullAttention",
        sparse_mode={"prefill": 3, "decode": 0},
        cache_write=write,
        block_size=16,
    )


def toy_pair(tmp_path: Path, write: CacheWrite, version: FaVersion = FaVersion.V1):
    original = load_converted(TOY, "mla_toy_original.py", tmp_path)
    converted = load_converted(
        convert_mla_source(TOY, spec(write, version)), "mla_toy_paged.py", tmp_path
    )
    config = original.LatentToyConfig()
    torch.manual_seed(0)
    reference = original.LatentToyForCausalLM(config).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(
                torch.randn_like(p) / p.shape[-1] ** 0.5
                if p.dim() > 1
                else 1 + 0.1 * torch.randn_like(p)
            )
    model = converted.LatentToyForCausalLM(config).eval()
    model.load_state_dict(reference.state_dict())
    return reference, model


def greedy_reference(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            (logits,) = model(torch.tensor([ids]))
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize(
    ("write", "version"),
    [(CacheWrite.FUSED, FaVersion.V1), (CacheWrite.SCATTER, FaVersion.V2)],
)
def test_converted_toy_is_token_exact_in_the_runtime(tmp_path, write, version):
    reference, model = toy_pair(tmp_path, write, version)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (4, 37, 18)]
    expected = [greedy_reference(reference, p, 5) for p in prompts]
    llm = LLM(
        model, block_size=16, num_blocks=24, free_block_order_seed=5, max_num_batched_tokens=24
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    info = model.get_cache_info()
    assert info.is_mla_backend
    assert [(c.cache_name, c.dim, c.num_head) for c in info.layer_infos[0].caches] == [
        ("nope_cache", 128, 1),
        ("rope_cache", 64, 1),
    ]


def test_conversion_is_idempotent_and_keyed_on_structure():
    once = convert_mla_source(TOY, spec(CacheWrite.FUSED))
    assert convert_mla_source(once, spec(CacheWrite.FUSED)) == once
    # the toy's own names were found: up-projection, latent norm and its gain, down-projection
    assert "weight = self.wkv_b.weight" in once
    assert "self.kv_norm.gain," in once and "epsilon=self.kv_norm.eps," in once
    assert "kv.reshape(-1, 1, 1, kv.shape[-1])" in once
    # nothing outside the seam changed: the query path and the output projection stay
    assert "q_pe = rotate_pairs(q_pe, cos, sin)" in once
    assert "return self.wo(out.reshape(b, s, -1))" in once
    assert "cache.update(" not in once


def test_kv_b_proj_is_split_after_loading_not_in_init(tmp_path):
    _, model = toy_pair(tmp_path, CacheWrite.SCATTER)
    attn = model.layers[0].attn
    # __init__ ran before the weights were loaded: nothing split yet
    assert attn.mla_absorbed is None
    w_uk, w_uv = attn.absorbed_kv_b_proj()
    per_head = attn.wkv_b.weight.view(2, 8 + 12, 128)
    assert torch.equal(w_uk, per_head[:, :8]) and torch.equal(w_uv, per_head[:, 8:])
    # unchanged weights: the split is reused, not recomputed
    assert attn.absorbed_kv_b_proj()[0] is w_uk
    # weights loaded again (in place): the next forward splits the new ones
    new = {k: v + 1.0 if k.endswith("wkv_b.weight") else v for k, v in model.state_dict().items()}
    model.load_state_dict(new)
    w_uk2, _ = attn.absorbed_kv_b_proj()
    assert torch.equal(w_uk2, w_uk + 1.0)


@pytest.mark.parametrize(
    ("old", "new", "mode"),
    [
        # complex-number rope keeps pairs interleaved: scatter
        (
            "return torch.cat((even * c - odd * s, odd * c + even * s), dim=-1)",
            "return torch.view_as_real(torch.view_as_complex(x) * torch.complex(c, s)).flatten(-2)",
            "scatter",
        ),
        # rotate-half on non-interleaved channels: scatter
        (
            "even, odd = x[..., 0::2], x[..., 1::2]",
            "even, odd = x[..., :half], x[..., half:]",
            "scatter",
        ),
        # the latent is cached before its norm: the fused RMSNorm would change it
        (
            "latent = self.kv_norm(latent).view(b, 1, s, -1)",
            "latent = latent.view(b, 1, s, -1)",
            "scatter",
        ),
        # the normalised latent is scaled before caching (LongCat-style): not a plain RMSNorm
        (
            "latent = self.kv_norm(latent).view(b, 1, s, -1)",
            "latent = self.kv_norm(latent).view(b, 1, s, -1)\n        latent = latent * 2.0",
            "scatter",
        ),
        ("", "", "fused"),
    ],
    ids=["complex-rope", "rotate-half", "no-latent-norm", "scaled-latent", "interleaved"],
)
def test_cache_write_decision_follows_norm_and_rope_order(old, new, mode):
    source = TOY.replace(old, new) if old else TOY
    assert old == "" or source != TOY
    decision = decide_mla_cache_write(source, {"qk_rope_head_dim": 64}, "toy.py")
    assert decision.mode == mode, decision.reason
    assert decision.source.startswith("toy.py:")


def test_two_latent_up_projections_are_refused():
    source = TOY.replace(
        "        self.wo = nn.Linear(",
        "        self.wkv_b2 = nn.Linear(config.kv_lora_rank, 8, bias=False)\n        self.wo = nn.Linear(",
    )
    with pytest.raises(UnsupportedModelError, match="exactly one kv_b_proj"):
        convert_mla_source(source, spec(CacheWrite.SCATTER))


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"qk_rope_head_dim": 32}, "qk_rope_head_dim is 32"),
        ({"kv_lora_rank": 256}, "kv_lora_rank is 256"),
    ],
)
def test_plans_outside_the_operator_limits_are_refused(overrides, reason):
    plan = analyze_model("deepseek_v3", config_overrides=overrides)
    with pytest.raises(UnsupportedModelError, match=reason):
        MlaSpec.from_plan(plan)


def test_deepseek_plan_spec():
    plan = analyze_model("deepseek_v3")
    mla = MlaSpec.from_plan(plan, block_size=16)
    assert mla.input_layout == "TND_NTD"
    assert mla.sparse_mode == {"prefill": 3, "decode": 0}
    assert mla.cache_write is CacheWrite.FUSED
    assert plan.num_key_value_heads_per_rank == 1 and plan.is_mla_backend
    assert any(e.decision == "mla_cache_write" for e in plan.evidence)


@pytest.mark.parametrize(
    "change",
    [
        "        query = query * 2.0\n",  # the query the rewrite would build from its parts
        "        q_pe = q_pe * 2.0\n",  # one of those parts, after the cache write
    ],
)
def test_a_query_changed_after_its_concatenation_is_refused_naming_the_statement(change):
    """The rewrite builds the query from the parts concatenated after the cache write; a
    change of the query or a part there would be dropped, so it is refused, not converted."""
    concat = "        query = torch.cat((q_nope, q_pe), dim=-1)\n"
    assert TOY.count(concat) == 1
    moved = concat + change if change.lstrip().startswith("query") else change + concat
    with pytest.raises(UnsupportedModelError, match=re.escape(f"({change.strip()})")):
        convert_mla_source(TOY.replace(concat, moved), spec(CacheWrite.SCATTER))
    # the concatenation alone is the rewrite's own business
    assert "cache_entries" in convert_mla_source(TOY, spec(CacheWrite.SCATTER))

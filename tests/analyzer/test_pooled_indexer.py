"""GLM-5.3's glm5_next: a k-pool DSA indexer over a latent without rope, beside Kimi delta
attention layers. The Plan names each part with its line; apply refuses only what the
operators cannot take (tests/implementer/test_pooled_indexer_rewrite.py converts the rest)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvskill.analyzer import analyze_model
from kvskill.cli import main

pytest.importorskip("transformers.models.glm5_next")
from transformers.models.glm5_next import modeling_glm5_next  # noqa: E402
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig  # noqa: E402

SOURCE = Path(modeling_glm5_next.__file__).read_text(encoding="utf-8").splitlines()


def _line_of(text: str) -> int:
    """The 1-based line of the first source line holding TEXT."""
    return next(i for i, line in enumerate(SOURCE, 1) if text in line)


@pytest.fixture(scope="module")
def plan():
    return analyze_model("glm5_next")


def test_plan_caches_the_ropeless_latent_and_one_pooled_key_per_pool(plan):
    text = Glm5NextConfig().text_config
    indexed = [i for i, t in enumerate(text.layer_types) if t == "indexed_attention"]
    assert plan.attention.value == "mla" and plan.mla.qk_rope_head_dim == 0
    # the latent is the whole key: no rope entry, and the text attention rotates nothing
    assert plan.rope_style.value == "none"
    assert plan.softmax_scale == pytest.approx(text.qk_nope_head_dim**-0.5)
    latent, pooled = plan.cache_entries["FullAttention"]
    assert (latent.cache_name, latent.dim) == ("nope_cache", text.kv_lora_rank)
    assert (pooled.cache_name, pooled.dim) == ("indexer_pool_key_cache", text.index_head_dim)
    assert (pooled.compress_ratio, pooled.num_layers) == (text.index_kpool, len(indexed))
    # every cache per token: the latent in each attention layer, a pooled key per 16 tokens
    per_layer = text.kv_lora_rank * 2 + text.index_head_dim * 2 // text.index_kpool
    assert plan.kv_bytes_per_token == per_layer * len(indexed)
    index = plan.indexer
    assert (index.pool_size, index.select_tail) == (text.index_kpool, True)
    assert (index.n_heads, index.topk) == (text.index_n_heads, text.index_topk)
    assert index.layers == indexed
    # the linear-attention layers are Kimi delta attention, named with their operators
    assert {row["mixer"] for row in plan.state_cache["layers"]} == {"kda"}
    mixer = next(e.reason for e in plan.evidence if e.decision == "state_mixer")
    assert "chunk_kda" in mixer and "gk is 暂不支持" in mixer


def test_plan_names_each_part_with_its_line_and_blocks_none(plan):
    assert not plan.implementer_blockers
    parts = {f.name: f for f in plan.indexer.sub_features}
    write = _line_of("packed_states = cache.update_indexer(")
    assert parts["pooled indexer keys"].where == f"modeling_glm5_next.py:{write}"
    update = _line_of("k_pass, k_rot = cache.update(")
    latent = parts["latent without rope"]
    assert latent.where == f"modeling_glm5_next.py:{update}"
    assert "zeros" in latent.needs and "no rope bytes stored" in latent.needs
    assert "sparse_block_size=16" in parts["open-pool tail"].needs
    assert all(f.missing == "" for f in parts.values())


def test_a_config_that_never_attends_the_open_pool_is_refused_with_its_line(capsys, tmp_path):
    # without the tail a query before its first closed pool attends nothing; the source's
    # softmax then spreads over its whole masked row, which no sparse selection reproduces
    Glm5NextConfig(text_config={"index_kpool_always_select_tail": False}).save_pretrained(
        tmp_path / "model"
    )
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "apply",
                str(tmp_path / "model"),
                "--mode",
                "framework",
                "--out",
                str(tmp_path / "out"),
            ]
        )
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 3 and len(err.splitlines()) == 1
    tail = _line_of("topk_indices = self.append_visible_tail(")
    assert f"open pool not attended (modeling_glm5_next.py:{tail})" in err
    assert "index_kpool_always_select_tail is False" in err
    assert not (tmp_path / "out").exists()


def test_a_saved_config_with_head_dim_0_and_a_pool_of_24_is_read_and_refused(tmp_path):
    # the config ties head_dim to qk_rope_head_dim, so config.json says head_dim 0; and
    # sparse_block_size is a power of two up to 128: pools of 24 tokens are not
    Glm5NextConfig(text_config={"index_kpool": 24, "index_topk": 2040}).save_pretrained(tmp_path)
    assert '"head_dim": 0' in (tmp_path / "config.json").read_text()
    plan = analyze_model(str(tmp_path))
    assert plan.mla.qk_rope_head_dim == 0 and plan.indexer.pool_size == 24
    tail = next(f for f in plan.indexer.sub_features if f.name == "open-pool tail")
    assert "power of two in [1, 128], index_kpool is 24" in tail.missing
    assert any(
        "open-pool tail" in b and "index_kpool is 24" in b for b in plan.implementer_blockers
    )

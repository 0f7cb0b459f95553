"""GLM-5.3's glm5_next: a k-pool DSA indexer over a latent without rope, beside Kimi delta
attention layers. The Plan names each part with its line; apply refuses with the limits."""

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


def test_plan_refuses_naming_each_part_its_line_and_its_limit(plan):
    (reason,) = [b for b in plan.implementer_blockers if "k-pool DSA indexer" in b]
    call = _line_of("topk_indices = self.indexer(")
    assert f"Glm5NextTextAttention (modeling_glm5_next.py:{call})" in reason
    write = _line_of("packed_states = cache.update_indexer(")
    assert f"pooled indexer keys (modeling_glm5_next.py:{write})" in reason
    assert "cmp_ratio 4 or 128; index_kpool is 16" in reason
    update = _line_of("k_pass, k_rot = cache.update(")
    assert f"latent without rope (modeling_glm5_next.py:{update})" in reason
    assert "(不支持rope为空)" in reason
    # the tail is expressible (sparse_block_size 16): listed as a part, not as a blocker
    parts = {f.name: f for f in plan.indexer.sub_features}
    assert parts["open-pool tail"].missing == ""
    assert "sparse_block_size=16" in parts["open-pool tail"].needs
    assert not any("planned as FullAttention" in b for b in plan.implementer_blockers)


def test_apply_exits_3_with_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["apply", "glm5_next", "--mode", "framework", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 3
    assert len(err.splitlines()) == 1 and "k-pool DSA indexer" in err
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

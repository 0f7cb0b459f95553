"""MLA layers that are not alike (dots3_note): per-layer latent dims from ``per_layer_config``,
the DSA indexer on its "indexed_attention" layers only, sliding MLA layers, and the refusal that
names what stops the rewrite."""

from __future__ import annotations

import json

import pytest
from kvskill.analyzer import analyze_model
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.mla.spec import MlaSpec

#: dots3_note's default layer pattern: layers 0, 1 and every 4th from 1 run the indexer
INDEXED = [0, 1, *range(5, 46, 4)]
SLIDING = [i for i in range(46) if i not in INDEXED]
#: a sliding layer's own keys as the released config names them (per_layer_config)
SLIDING_OWN = {
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "kv_lora_rank": 1024,
    "qk_nope_head_dim": 192,
}


@pytest.fixture(scope="module")
def default_plan():
    return analyze_model("dots3_note")


def _three_kinds(tmp_path, sliding_own: dict) -> str:
    """A 4-layer dots3_note whose layers are indexed, full (no indexer), sliding, sliding."""
    text = {
        "num_hidden_layers": 4,
        "layer_types": [
            "indexed_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
        ],
        "per_layer_config": {"2": sliding_own, "3": sliding_own},
    }
    config = {"model_type": "dots3_note", "text_config": text}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_dots3_note_caches_each_layer_kind_with_its_own_latent(default_plan):
    plan = default_plan
    assert [layer.index for layer in plan.layers if layer.attn_type == "SlidingWindow"] == SLIDING
    assert {layer.sliding_window for layer in plan.layers if layer.index in SLIDING} == {512}
    assert plan.indexer is not None
    assert plan.indexer.layers == INDEXED and plan.indexer.dense_layers == SLIDING
    entries = {
        t: {e.cache_name: (e.dim, e.sliding_window) for e in group}
        for t, group in plan.cache_entries.items()
    }
    # the sliding layers' own 1024 latent, windowed, and no indexer keys; the indexed layers
    # keep the model-level 512 latent and the 128-wide indexer keys
    assert entries["SlidingWindow"] == {"nope_cache": (1024, 512), "rope_cache": (64, 512)}
    assert entries["FullAttention"] == {
        "nope_cache": (512, None),
        "rope_cache": (64, None),
        "indexer_key_cache": (128, None),
    }
    assert plan.kv_bytes_per_token == 13 * (512 + 64 + 128) * 2 + 33 * (1024 + 64) * 2
    groups = [e.reason for e in plan.evidence if e.decision == "mla.layers"]
    assert any(r.startswith("33 SlidingWindow layers 2-4, 6-8") and "64 heads" in r for r in groups)
    assert any("256^-0.5" in r for r in groups)  # the sliding layers' own softmax scale


def test_dots3_note_is_refused_naming_the_operator_limit_and_the_window(default_plan):
    with pytest.raises(UnsupportedModelError) as refused:
        MlaSpec.from_plan(default_plan)
    message = str(refused.value)
    assert "SlidingWindow layers 2-4, 6-8" in message
    assert "MLA kv_lora_rank is 1024" in message
    assert "the band case (sparse_mode 4) takes D 512 only" in message and "sparse为4时" in message
    # the construct in the file: the class that sets the window, where
    assert "Dots3NoteTextAttention sets self.sliding_window at modeling_dots3_note.py:" in message
    assert "run no DSA indexer beside the indexed layers 0-1, 5, 9" in message


def test_three_layer_kinds_are_named_and_sized(tmp_path):
    plan = analyze_model(_three_kinds(tmp_path, SLIDING_OWN))
    kinds = [(layer.index, layer.kind, layer.attn_type.value) for layer in plan.layers]
    assert kinds == [
        (0, "indexed_attention", "FullAttention"),
        (1, "mla", "FullAttention"),
        (2, "mla", "SlidingWindow"),
        (3, "mla", "SlidingWindow"),
    ]
    assert plan.indexer is not None
    assert (plan.indexer.layers, plan.indexer.dense_layers) == ([0], [1, 2, 3])
    # the indexer keys are counted on the one indexed layer only
    assert plan.kv_bytes_per_token == 2 * (512 + 64) * 2 + 128 * 2 + 2 * (1024 + 64) * 2


def test_sliding_mla_layers_inside_the_operator_limits_are_still_refused(tmp_path):
    own = {**SLIDING_OWN, "kv_lora_rank": 512, "num_attention_heads": 128}
    own["num_key_value_heads"] = 128
    plan = analyze_model(_three_kinds(tmp_path, own))
    assert not [b for b in plan.implementer_blockers if b.startswith("operator limit")]
    with pytest.raises(UnsupportedModelError, match="MLA layers 2-3 are SlidingWindow"):
        MlaSpec.from_plan(plan)


def test_a_published_flat_config_is_read_through_its_text_config(tmp_path):
    # dots3_note's checkpoints store the text keys at the top level, the sliding layers' own
    # values as swa_*; the config class turns them into text_config.per_layer_config
    config = {
        "model_type": "dots3_note",
        "num_hidden_layers": 6,
        "kv_lora_rank": 512,
        "swa_num_attention_heads": 64,
        "swa_num_key_value_heads": 64,
        "swa_kv_lora_rank": 1024,
        "swa_qk_nope_head_dim": 192,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    plan = analyze_model(str(tmp_path))
    assert plan.attention.value == "mla"
    assert plan.indexer is not None and plan.indexer.layers == [0, 1, 5]
    sliding = {e.cache_name: e.dim for e in plan.cache_entries["SlidingWindow"]}
    assert sliding == {"nope_cache": 1024, "rope_cache": 64}

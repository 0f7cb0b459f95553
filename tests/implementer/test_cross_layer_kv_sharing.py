"""Cross-layer KV sharing (Hunyuan-Large's ``use_cla``): a layer that reuses an earlier
layer's keys and values reads that layer's paged cache; the cache and its bytes count once.

The fixture ``cla_shared_kv_bhsd`` (tests/fixtures/vendor/) has 4 layers, ``cla_share_factor``
2: layers 0 and 2 project keys and values, layers 1 and 3 reuse them.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from kvskill.analyzer.analyze import analyze_model
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.convert import ApplyOptions
from kvskill.implementer.writer import apply_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from vendor_fixtures import VENDOR_ROOT, convert_and_verify  # noqa: E402

CLA = VENDOR_ROOT / "cla_shared_kv_bhsd"
#: one layer's k_cache + v_cache per token: 2 KV heads x 16 dims x 4 bytes, twice
LAYER_BYTES_PER_TOKEN = 2 * 2 * 16 * 4


def _with_config(tmp_path: Path, **changes) -> Path:
    model = tmp_path / "model"
    shutil.copytree(CLA, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))
    return model


def test_the_plan_counts_a_shared_cache_once_and_cites_the_reuse():
    plan = analyze_model(str(CLA))
    # two producing layers hold caches: half of the four layers' bytes
    assert plan.kv_bytes_per_token == 2 * LAYER_BYTES_PER_TOKEN
    assert [layer.kv_source for layer in plan.layers] == [None, 0, None, 2]
    cited = [e for e in plan.evidence if e.decision == "kv_sharing"]
    line = int(cited[0].source.rsplit(":", 1)[1])
    source = (CLA / "modeling_vendor_cla.py").read_text().splitlines()
    assert source[line - 1].strip().startswith('if self.attention_type == "cross"')
    assert plan.code["kv_sharing"]["layer_sources"] == {"1": 0, "3": 2}


def test_without_cla_every_layer_holds_and_counts_its_own_cache(tmp_path):
    plan = analyze_model(str(_with_config(tmp_path, use_cla=False)))
    assert plan.kv_bytes_per_token == 4 * LAYER_BYTES_PER_TOKEN
    assert all(layer.kv_source is None for layer in plan.layers)


def test_a_per_layer_key_norm_keeps_one_cache_per_layer_and_says_why(tmp_path):
    # each layer normalises the reused keys with its own key_layernorm: a consumer's cached
    # keys are not its producer's, so sharing one cache would attend over the wrong keys
    model = _with_config(tmp_path, use_qk_norm=True)
    plan = analyze_model(str(model))
    assert plan.kv_bytes_per_token == 4 * LAYER_BYTES_PER_TOKEN
    assert all(layer.kv_source is None for layer in plan.layers)
    cited = [e for e in plan.evidence if e.decision == "kv_sharing"]
    assert "self.key_layernorm" in cited[0].reason
    line = int(cited[0].source.rsplit(":", 1)[1])
    text = (model / "modeling_vendor_cla.py").read_text().splitlines()[line - 1]
    assert "self.key_layernorm(" in text
    report = convert_and_verify("", tmp_path / "out", "framework", "paged", model=model)
    assert report.passed


def test_the_converted_model_declares_one_cache_pair_per_producer_and_verifies(tmp_path):
    report = convert_and_verify("cla_shared_kv_bhsd", tmp_path / "out", "framework", "paged")
    assert report.passed

    from kvskill.runtime import LLM

    llm = LLM(tmp_path / "out", trust_remote_code=True, random_weights=True, num_blocks=32)
    info = llm.model.get_cache_info()
    assert info.num_layers == 2
    assert [[e.cache_name for e in i.caches] for i in info.layer_infos] == [
        ["k_cache", "v_cache"],
        ["k_cache", "v_cache"],
    ]
    attentions = [layer.self_attn for layer in llm.model.model.layers]
    # the consumers read their producer's very tensors: one allocation per producer
    assert attentions[1].kv_source is attentions[0]
    assert attentions[3].kv_source is attentions[2]
    assert attentions[0].k_cache.data_ptr() != attentions[2].k_cache.data_ptr()
    # a reference, not a submodule: the walk and the state dict see each layer once
    assert "model.layers.1.self_attn.kv_source" not in dict(llm.model.named_modules())


def test_standalone_mode_refuses_a_shared_cache_in_one_line(tmp_path):
    with pytest.raises(UnsupportedModelError, match=r"modeling_vendor_cla.py:\d+: layers reuse"):
        apply_model(str(CLA), tmp_path / "out", ApplyOptions(deploy_mode="standalone"))

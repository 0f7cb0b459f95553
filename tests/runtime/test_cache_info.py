"""Cache declarations: validation errors name the layer and the entry."""

import pytest
import torch
from kvskill.core.errors import BadInputError
from kvskill.runtime import (
    CacheEntry,
    CacheInfoError,
    KVCacheManager,
    LayerCacheInfo,
    ModelCacheInfo,
    validate_cache_info,
)
from runtime_factories import Sink, attn_layer, mamba_layer, model_info


def _entry(**overrides):
    fields = dict(
        cache_name="k_cache",
        attn_type="FullAttention",
        dim=8,
        num_head=2,
        dtype=torch.float16,
        needs_block=True,
        block_size=16,
        tensor_setter=lambda t: None,
    )
    fields.update(overrides)
    return CacheEntry(**fields)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"attn_type": "SlidingWindow"}, "layer 3 is SlidingWindow but sliding_window=None"),
        ({"tensor_setter": None}, "cache 'k_cache' in layer 3 has no tensor_setter"),
        ({"dim": 0}, "cache 'k_cache' in layer 3 has dim=0"),
        ({"num_head": 0}, "num_head=0"),
        ({"dtype": "float16"}, "dtype 'float16'"),
        ({"block_size": -1}, "block_size -1"),
        ({"block_size": None}, "block_size None; every entry that needs blocks"),
        ({"needs_block": 1}, "needs_block=1; expected a bool"),
        ({"cache_layout": "BSND"}, "cache_layout 'BSND'"),
        ({"allocator": "disk"}, "allocator 'disk'"),
        ({"compress_ratio": 0}, "compress_ratio 0"),
    ],
)
def test_bad_entry_is_reported_with_layer_and_entry(overrides, message):
    layer = LayerCacheInfo(3, [_entry(**overrides)])
    with pytest.raises(CacheInfoError, match=message) as exc:
        validate_cache_info(ModelCacheInfo(num_layers=1, layer_infos=[layer]))
    assert isinstance(exc.value, BadInputError)
    assert "\n" not in str(exc.value)


def test_unknown_attn_type_is_refused_when_the_kv_manager_is_built():
    # The declaration is well formed, so the model can build it...
    layer = LayerCacheInfo(3, [_entry(attn_type="Linear")])
    info = ModelCacheInfo(num_layers=1, layer_infos=[layer])
    validate_cache_info(info)
    # ...but no manager serves "Linear": the KV manager refuses it before building anything.
    with pytest.raises(
        CacheInfoError,
        match="cache 'k_cache' in layer 3 has unknown attn_type 'Linear'.*register_attn_type",
    ) as exc:
        KVCacheManager(info, num_blocks=4)
    assert isinstance(exc.value, BadInputError)
    assert "\n" not in str(exc.value)


def test_mismatched_windows_in_one_group_are_rejected():
    sink = Sink()
    layers = [
        attn_layer(sink, 0, "SlidingWindow", sliding_window=8),
        attn_layer(sink, 1, "SlidingWindow", sliding_window=16),
    ]
    with pytest.raises(CacheInfoError, match="layer 1 .* group 'SlidingWindow' already uses"):
        model_info(layers)


def test_separate_manager_key_allows_a_second_window():
    sink = Sink()
    second = attn_layer(sink, 1, "SlidingWindow", sliding_window=16)
    for entry in second.caches:
        entry.manager_key = "SlidingWindow16"
    info = model_info([attn_layer(sink, 0, "SlidingWindow", sliding_window=8), second])
    assert {e.group_key for _, e in info.entries()} == {"SlidingWindow", "SlidingWindow16"}


def test_structural_errors():
    sink = Sink()
    with pytest.raises(CacheInfoError, match="num_layers is 2 but 1 layer_infos"):
        validate_cache_info(ModelCacheInfo(num_layers=2, layer_infos=[attn_layer(sink, 0)]))
    with pytest.raises(CacheInfoError, match="layer_idx 0 appears twice"):
        model_info([attn_layer(sink, 0), attn_layer(sink, 0)])
    with pytest.raises(CacheInfoError, match="block_size 0"):
        model_info([attn_layer(sink, 0)], block_size=0)
    layer = LayerCacheInfo(0, [_entry(), _entry()])
    with pytest.raises(CacheInfoError, match="duplicate caches"):
        validate_cache_info(ModelCacheInfo(num_layers=1, layer_infos=[layer]))
    with pytest.raises(CacheInfoError, match="layer 0 declares no cache entry"):
        validate_cache_info(ModelCacheInfo(num_layers=1, layer_infos=[LayerCacheInfo(0, [])]))


def test_layer_bind_hook_replaces_tensor_setters():
    layer = LayerCacheInfo(0, [_entry(tensor_setter=None)])
    info = ModelCacheInfo(num_layers=1, layer_infos=[layer])
    with pytest.raises(CacheInfoError, match="no tensor_setter"):
        validate_cache_info(info)
    layer.bind_kv_cache = lambda raw: None  # kvskill's page-pool hook: an attribute, not a field
    validate_cache_info(info)
    assert info.entries()[0][1].cache_name == "k_cache"


def test_entry_shapes_and_bytes():
    entry = _entry(dim=[4, 16], num_head=1, dtype=torch.bfloat16)
    assert entry.block_shape(8) == (8, 1, 4, 16)
    assert entry.bytes_per_block(8) == 8 * 64 * 2
    sink = Sink()
    conv, ssm = mamba_layer(sink, 0, conv_shape=(6, 3), ssm_shape=(2, 4, 4)).caches
    assert conv.block_shape(1) == (6, 3) and conv.block_size == 1
    assert ssm.bytes_per_block(1) == 32 * 4
    assert conv.attn_type == "Mamba" and conv.group_key == "Mamba"

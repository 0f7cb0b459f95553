"""The cache declarations equal the Ascend framework's, field for field.

hicann/cann-recipes-infer at ``fbc225d`` (2026-08-21), ``executor/core/kv_cache/cache_info.py``
is the contract a converted file is written against. The tables below restate it (names,
order, defaults, keyword-only flags) so a drift on either side fails here; with a checkout in
``KVSKILL_CANN_RECIPES`` the last test also compares against the real classes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import pytest
import torch
from kvskill.runtime import (
    CacheAllocator,
    CacheEntry,
    CacheInfoError,
    ForwardMetaData,
    LayerCacheInfo,
    MambaCacheEntry,
    ModelCacheInfo,
    PrefillCPMetaData,
    get_forward_metadata,
    reset_forward_metadata,
    set_forward_metadata,
)

REQUIRED = object()
FACTORY = object()

#: (field, default or REQUIRED / FACTORY, keyword-only) in declaration order, as at fbc225d
CONTRACT: dict[type, list[tuple[str, object, bool]]] = {
    CacheEntry: [
        ("cache_name", REQUIRED, False),
        ("attn_type", REQUIRED, False),
        ("dim", REQUIRED, False),
        ("num_head", REQUIRED, False),
        ("dtype", REQUIRED, False),
        ("needs_block", REQUIRED, False),
        ("block_size", None, False),
        ("manager_key", None, False),
        ("tensor_setter", None, False),
        ("sliding_window", None, False),
        ("allocator", CacheAllocator.HBM, False),
        ("compress_ratio", 1, False),
        ("tensor", None, False),
        ("cache_layout", "BnBsND", False),
    ],
    MambaCacheEntry: [
        ("cache_name", REQUIRED, False),
        ("attn_type", "Mamba", True),
        ("dim", None, True),
        ("num_head", None, True),
        ("dtype", REQUIRED, False),
        ("needs_block", REQUIRED, False),
        ("block_size", 1, True),
        ("manager_key", None, False),
        ("tensor_setter", None, False),
        ("sliding_window", None, False),
        ("allocator", CacheAllocator.HBM, False),
        ("compress_ratio", 1, False),
        ("tensor", None, False),
        ("cache_layout", "BnBsND", False),
        ("shape", FACTORY, True),
        ("next_n", 0, True),
    ],
    LayerCacheInfo: [("layer_idx", REQUIRED, False), ("caches", REQUIRED, False)],
    ModelCacheInfo: [
        ("num_layers", REQUIRED, False),
        ("layer_infos", REQUIRED, False),
        ("is_mla_backend", False, False),
    ],
    # executor/utils/forward_metadata.py
    ForwardMetaData: [
        ("is_prefill", False, False),
        ("is_warm_up", False, False),
        ("attention_mask", None, False),
        ("kv_len", None, False),
        ("actual_seq_lengths_kv", None, False),
        ("actual_seq_lengths_q", None, False),
        ("actual_seq_lengths_cu_kv", None, False),
        ("actual_seq_lengths_cu_q", None, False),
        ("actual_seq_lengths_cu_list_kv", None, False),
        ("actual_seq_lengths_cu_list_q", None, False),
        ("actual_seq_lengths_list_kv", None, False),
        ("actual_seq_lengths_list_q", None, False),
        ("prompt_tokens", 0, False),
        ("block_table", None, False),
        ("slot_mapping", None, False),
        ("cp_metadata", None, False),
    ],
    PrefillCPMetaData: [
        ("enabled", False, False),
        ("cp_size", 1, False),
        ("global_padded_token_num", 0, False),
        ("local_token_num", 0, False),
        *[
            (name, None, False)
            for name in (
                "local_indices",
                "restore_indices",
                "global_valid_indices",
                "global_slot_mapping",
                "global_block_table",
                "persistent_valid_indices",
                "persistent_slot_mapping",
                "output_request_indices",
                "actual_seq_q_prev",
                "actual_seq_q_next",
                "kv_len_prev",
                "kv_len_next",
            )
        ],
        ("local_prev_token_num", 0, False),
        ("local_next_token_num", 0, False),
    ],
}

#: the framework module each class lives in
HOME = {cls: "executor/core/kv_cache/cache_info.py" for cls in CONTRACT}
HOME[ForwardMetaData] = HOME[PrefillCPMetaData] = "executor/utils/forward_metadata.py"


def _described(cls: type) -> list[tuple[str, object, bool]]:
    described = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = FACTORY
        else:
            default = REQUIRED
        described.append((f.name, default, bool(f.kw_only)))
    return described


@pytest.mark.parametrize("cls", list(CONTRACT), ids=lambda c: c.__name__)
def test_fields_defaults_and_keyword_only_flags_match_the_framework(cls):
    assert _described(cls) == CONTRACT[cls]


def test_allocators_match():
    assert {a.name: a.value for a in CacheAllocator} == {
        "HBM": "hbm",
        "SWAPPED_MEMORY": "swapped_memory",
    }
    assert issubclass(CacheAllocator, str)


def _entry(**overrides):
    fields = dict(
        cache_name="k_cache", attn_type="FullAttention", dim=64, num_head=2, dtype=torch.float16
    )
    fields.update(overrides)
    return CacheEntry(**fields)


def test_needs_block_has_no_default_and_model_info_has_no_block_size():
    with pytest.raises(TypeError, match="needs_block"):
        _entry()
    with pytest.raises(TypeError, match="block_size"):
        ModelCacheInfo(num_layers=0, layer_infos=[], block_size=128)


def test_group_key_and_storage_block_size():
    entry = _entry(needs_block=True, block_size=128)
    assert entry.group_key == "FullAttention"
    entry.manager_key = ""  # the framework tests ``is not None``: an empty key is a key
    assert entry.group_key == ""
    compressed = _entry(needs_block=True, block_size=128, compress_ratio=4)
    assert compressed.storage_block_size == 32
    assert compressed.cache_dim_numel() == 64
    with pytest.raises(ValueError, match="compress_ratio 3 does not divide"):
        _ = _entry(needs_block=True, block_size=128, compress_ratio=3).storage_block_size


def _state(**overrides):
    fields = dict(cache_name="ssm_state", dtype=torch.float32, needs_block=True, shape=[2, 4, 4])
    fields.update(overrides)
    return MambaCacheEntry(**fields)


def test_mamba_entries_follow_the_framework_rules():
    state = _state()
    assert (state.attn_type, state.block_size, state.dim, state.num_head) == (
        "Mamba",
        1,
        None,
        None,
    )
    assert state.cache_dim_numel() == 32 and state.next_n == 0
    # positional order after the keyword-only fields moved out: cache_name, dtype, needs_block
    positional = MambaCacheEntry("conv_state", torch.float32, True, shape=[3, 8])
    assert positional.dtype == torch.float32 and positional.needs_block is True
    for overrides, message in [
        ({"shape": (2, 4)}, "non-empty list"),
        ({"shape": []}, "non-empty list"),
        ({"shape": [2, 0]}, "every dim must be > 0"),
        ({"block_size": 2}, "block_size 1"),
        ({"attn_type": "GatedDelta"}, "attn_type='Mamba'"),
        ({"next_n": -1}, "next_n -1"),
    ]:
        with pytest.raises(ValueError, match=message) as exc:
            _state(**overrides)
        assert isinstance(exc.value, CacheInfoError)


def test_merge_appends_and_renumbers_the_other_model_layers():
    main = ModelCacheInfo(
        num_layers=2,
        layer_infos=[LayerCacheInfo(i, [_entry(needs_block=True)]) for i in range(2)],
        is_mla_backend=True,
    )
    mtp_layer = LayerCacheInfo(0, [_entry(needs_block=True)])
    mtp = ModelCacheInfo(num_layers=1, layer_infos=[mtp_layer], is_mla_backend=True)
    merged = main.merge(mtp)
    assert merged.num_layers == 3 and merged.is_mla_backend
    assert [layer.layer_idx for layer in merged.layer_infos] == [0, 1, 2]
    assert mtp_layer.layer_idx == 2  # renumbered in place, as the framework does
    with pytest.raises(ValueError, match="is_mla_backend differs"):
        main.merge(ModelCacheInfo(num_layers=0, layer_infos=[]))


def _framework_module(checkout: Path, relative: str):
    """One framework module loaded from its file alone: these import only torch, while their
    packages' __init__ pull in torch_npu."""
    path = checkout / relative
    spec = importlib.util.spec_from_file_location("_framework_" + path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(
    not os.environ.get("KVSKILL_CANN_RECIPES"),
    reason="set KVSKILL_CANN_RECIPES to a cann-recipes-infer checkout to compare with it",
)
def test_the_real_framework_classes_have_the_same_fields():
    checkout = Path(os.environ["KVSKILL_CANN_RECIPES"])
    modules = {home: _framework_module(checkout, home) for home in set(HOME.values())}
    for cls in CONTRACT:
        real = modules[HOME[cls]]
        theirs = _described(getattr(real, cls.__name__))
        ours = _described(cls)
        # the enum defaults are two classes of the same values
        normalise = [(name, getattr(default, "value", default), kw) for name, default, kw in theirs]
        assert [(n, getattr(d, "value", d), k) for n, d, k in ours] == normalise, cls.__name__
    real = modules["executor/core/kv_cache/cache_info.py"]
    assert {a.value for a in real.CacheAllocator} == {a.value for a in CacheAllocator}
    # the same three functions over the metadata
    forward = modules["executor/utils/forward_metadata.py"]
    for name in ("get_forward_metadata", "set_forward_metadata", "reset_forward_metadata"):
        assert callable(getattr(forward, name))


def test_forward_metadata_functions_behave_as_the_framework_s():
    reset_forward_metadata()
    assert get_forward_metadata() == ForwardMetaData()
    set_forward_metadata(is_prefill=True, prompt_tokens=7)
    md = get_forward_metadata()
    assert md.is_prefill and md.prompt_tokens == 7 and md.block_table is None
    set_forward_metadata(prompt_tokens=0)
    assert get_forward_metadata().is_prefill  # other fields kept
    reset_forward_metadata()
    assert get_forward_metadata() == ForwardMetaData()

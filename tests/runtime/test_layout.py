"""Cache layouts: dense tensors, and page-pool views that never copy and hit the right bytes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from kvskill.runtime import (
    CacheEntry,
    KVCacheManager,
    LayerCacheInfo,
    MambaCacheEntry,
    ModelCacheInfo,
    get_init_attn_mask,
    kv_lane_view,
    prepare_block_tables,
    prepare_slot_mapping,
    prepare_token_positions,
    split_page,
    strided_view,
)
from kvskill.runtime.layout import LOG_PREFIX, choose_hybrid_block_size
from kvskill.runtime.ops import torch_npu
from runtime_factories import Sink, attn_layer, mamba_layer, model_info


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _page_bytes(mgr: KVCacheManager, raw_index: int, block: int) -> torch.Tensor:
    return mgr.layout.raw_views[raw_index][block]


def test_seed_example_48_fp16_in_a_128_byte_page_has_block_stride_64():
    # One latent cache per layer: 2 tokens x 3 heads x 8 dims = 48 fp16 = 96 bytes per block.
    sink = Sink()
    entry = CacheEntry(
        "kv_cache",
        "FullAttention",
        8,
        3,
        torch.float16,
        True,
        2,
        tensor_setter=sink.setter(0, "kv"),
    )
    info = ModelCacheInfo(num_layers=1, layer_infos=[LayerCacheInfo(0, [entry])])
    mgr = KVCacheManager(info, num_blocks=5, use_hybrid_blocks=True, page_alignment_bytes=128)
    mgr.allocate_cache_tensors()
    view = sink.tensors[(0, "kv")]
    assert mgr.layout.page_size_bytes == 128
    assert view.shape == (5, 2, 3, 8)
    assert view.stride() == (64, 24, 8, 1)
    assert not view.is_contiguous()
    assert _storage_ptr(view) == _storage_ptr(mgr.layout.pool)
    # Write every logical element: the 16-element (32-byte) gap of each page stays zero.
    view.fill_(1.5)
    pool = mgr.layout.pool.view(5, 128)
    assert torch.all(pool[:, 96:] == 0)
    assert torch.all(pool[:, :96].view(torch.float16) == 1.5)
    assert mgr.usage()["memory"]["padding_fraction"] == pytest.approx(0.25)


def test_strided_view_addresses_expected_bytes():
    raw = torch.zeros(4, 128, dtype=torch.int8)
    view = strided_view(raw, torch.float16, (2, 3, 8), offset_bytes=0)
    view[2, 1, 2, 5] = 7.0
    # block 2 starts at byte 256; (token 1, head 2, dim 5) is element 8*3 + 2*8 + 5 = 45.
    flat = raw.view(-1).view(torch.float16)
    assert flat[2 * 64 + 45] == 7.0
    assert int((flat != 0).sum()) == 1
    with pytest.raises(AssertionError, match="overruns"):
        strided_view(raw, torch.float16, (2, 3, 8), offset_bytes=64)


def test_combined_kv_lanes_alias_the_separate_k_and_v_views():
    sink = Sink()
    layer = attn_layer(sink, 0, num_head=2, head_dim=4, dtype=torch.float16)
    raw = torch.zeros(6, 256, dtype=torch.int8)  # K lane 64 B + V lane 64 B, padded to 256
    views = split_page(raw, layer.caches, block_size=4)
    lanes = kv_lane_view(raw, torch.float16, block_size=4, num_head=2, head_dim=4)
    assert lanes.shape == (2, 6, 4, 2, 4)
    # Lane stride = one lane's payload (32 fp16); block stride = the page (128 fp16).
    assert lanes.stride() == (32, 128, 8, 4, 1)
    for lane, name in enumerate(["k_cache", "v_cache"]):
        assert lanes[lane].stride() == views[name].stride()
        assert lanes[lane].storage_offset() == views[name].storage_offset()
    lanes[1, 3, 0, 1, 2] = 4.0
    assert views["v_cache"][3, 0, 1, 2] == 4.0
    assert views["k_cache"].abs().sum() == 0
    assert _storage_ptr(lanes) == _storage_ptr(raw)


def _hybrid(conv_shape, ssm_shape, alignment=128):
    sink = Sink()
    layers = [attn_layer(sink, 0), mamba_layer(sink, 1, conv_shape, ssm_shape), attn_layer(sink, 2)]
    info = model_info(layers, block_size=4)
    mgr = KVCacheManager(info, num_blocks=6, use_hybrid_blocks=True, page_alignment_bytes=alignment)
    mgr.allocate_cache_tensors()
    return sink, mgr


def test_hybrid_attention_and_mamba_with_padding():
    # Attention: 4 tokens x 2 heads x 8 dims fp32 = 256 B per lane, 512 B per page.
    # Mamba: conv 6x3 (72 B) + ssm 2x4x4 (128 B) = 200 B, padded to the 512 B page.
    sink, mgr = _hybrid((6, 3), (2, 4, 4))
    layout = mgr.layout
    assert layout.mode == "hybrid" and layout.page_size_bytes == 512
    assert len(layout.raw_views) == 2  # two attention layers; the Mamba layer shares view 0
    pool_ptr = _storage_ptr(layout.pool)
    assert all(_storage_ptr(t) == pool_ptr for t in sink.tensors.values())
    k0, v0 = sink.tensors[(0, "k_cache")], sink.tensors[(0, "v_cache")]
    conv, ssm = sink.tensors[(1, "conv_state")], sink.tensors[(1, "ssm_state")]
    assert k0.stride()[0] == v0.stride()[0] == conv.stride()[0] == ssm.stride()[0] == 128
    assert (k0.storage_offset(), v0.storage_offset()) == (0, 64)
    assert (conv.storage_offset(), ssm.storage_offset()) == (0, 18)  # ssm at byte 72
    assert conv.shape == (6, 6, 3) and ssm.shape == (6, 2, 4, 4)
    assert not conv.is_contiguous()
    # Writes through the Mamba views land at their byte offsets inside page 3 of view 0.
    conv[3] = torch.arange(18, dtype=torch.float32).view(6, 3)
    ssm[3] = -1.0
    page = _page_bytes(mgr, 0, 3)
    assert torch.equal(page[:72].view(torch.float32), torch.arange(18, dtype=torch.float32))
    assert torch.all(page[72:200].view(torch.float32) == -1.0)
    assert torch.all(page[200:] == 0)  # padding untouched
    # Block 3 of attention layer 0 is the same page: the shared pool hands it to one group.
    assert torch.all(k0[3].flatten()[:18] == torch.arange(18, dtype=torch.float32))
    assert torch.all(_page_bytes(mgr, 0, 2) == 0) and torch.all(_page_bytes(mgr, 1, 3) == 0)
    # Attention pages are full; a Mamba block uses 200 B of page b in view 0 and none of view 1.
    assert layout.padding_by_group["FullAttention"] == 0.0
    assert layout.padding_by_group["Mamba"] == pytest.approx(1 - 200 / 1024)
    assert mgr.usage()["memory"]["padding_fraction"] == pytest.approx(1 - 200 / 1024)


def test_hybrid_without_padding_fills_every_page():
    # Mamba: conv 8x4 (128 B) + ssm 3x4x8 (384 B) = 512 B: exactly one attention page.
    sink, mgr = _hybrid((8, 4), (3, 4, 8))
    assert mgr.layout.page_size_bytes == 512
    # No page padding: only the second raw view, which no Mamba layer uses, is unused.
    assert mgr.layout.padding_by_group == {"FullAttention": 0.0, "Mamba": 0.5}
    conv, ssm = sink.tensors[(1, "conv_state")], sink.tensors[(1, "ssm_state")]
    conv.fill_(2.0)
    ssm.fill_(3.0)
    pages = mgr.layout.raw_views[0].view(torch.float32)  # [6, 128]
    assert torch.all(pages[:, :32] == 2.0) and torch.all(pages[:, 32:] == 3.0)


def test_pure_gqa_non_contiguous_view():
    # 2 tokens x 1 head x 12 dims fp16 = 48 B per lane, 96 B payload in a 128 B page.
    sink = Sink()
    info = model_info([attn_layer(sink, 0, num_head=1, head_dim=12, dtype=torch.float16)], 2)
    mgr = KVCacheManager(info, num_blocks=4, use_hybrid_blocks=True)
    mgr.allocate_cache_tensors()
    k, v = sink.tensors[(0, "k_cache")], sink.tensors[(0, "v_cache")]
    assert mgr.layout.mode == "gqa"
    assert k.stride() == v.stride() == (64, 12, 12, 1)
    assert (k.storage_offset(), v.storage_offset()) == (0, 24)
    assert not k.is_contiguous() and not v.is_contiguous()
    # The operators see [num_blocks, block_size, H*D] through a view (no copy).
    assert k.view(4, 2, -1).data_ptr() == k.data_ptr()
    # The same logical ids address the same pages as the flat slot formula.
    v.view(4, 2, -1)[3, 1] = 9.0
    assert torch.all(mgr.layout.raw_views[0][3][48 + 24 : 48 + 48].view(torch.float16) == 9.0)


def test_layer_bind_override_receives_the_raw_page_view():
    received = {}

    def bind(raw):
        received["raw"] = raw
        received.update(split_page(raw, layer.caches, block_size=1))

    sink = Sink()
    layer = mamba_layer(sink, 0)
    for entry in layer.caches:
        entry.tensor_setter = None
    layer.bind_kv_cache = bind
    mgr = KVCacheManager(model_info([layer]), num_blocks=3, use_hybrid_blocks=True)
    mgr.allocate_cache_tensors()
    assert received["raw"].dtype == torch.int8 and received["raw"].shape == (3, 256)
    assert received["ssm_state"].shape == (3, 2, 4, 4)
    assert layer.caches[1].tensor.data_ptr() == received["ssm_state"].data_ptr()
    assert sink.tensors == {}


def test_contiguous_path_allocates_one_dense_tensor_per_entry():
    sink = Sink()
    info = model_info([attn_layer(sink, 0), mamba_layer(sink, 1)], block_size=4)
    mgr = KVCacheManager(info, num_blocks=5)
    mgr.allocate_cache_tensors()
    assert sink.tensors[(0, "k_cache")].shape == (5, 4, 2, 8)
    assert sink.tensors[(1, "conv_state")].shape == (5, 6, 3)
    assert sink.tensors[(1, "ssm_state")].shape == (5, 2, 4, 4)
    assert all(t.is_contiguous() for t in sink.tensors.values())
    ptrs = {_storage_ptr(t) for t in sink.tensors.values()}
    assert len(ptrs) == 4
    assert mgr.layout.padding_fraction == 0.0


def test_hybrid_block_budget_counts_pages_of_every_raw_view():
    sink = Sink()
    info = model_info([attn_layer(sink, 0), mamba_layer(sink, 1), attn_layer(sink, 2)], 4)
    mgr = KVCacheManager(info, memory_budget_bytes=512 * 2 * 10 + 100, use_hybrid_blocks=True)
    assert mgr.num_blocks == {"FullAttention": 10, "Mamba": 10}
    mgr.allocate_cache_tensors()
    assert mgr.layout.total_bytes <= 512 * 2 * 10 + 100


def test_choose_hybrid_block_size():
    assert choose_hybrid_block_size(512, 20480, 16) == 48
    assert choose_hybrid_block_size(512, 100, 16) == 16


@pytest.mark.parametrize(("hybrid_layers", "mode"), [(True, "hybrid"), (False, "gqa")])
def test_layout_log_lines(caplog, hybrid_layers, mode):
    sink = Sink()
    layers = [attn_layer(sink, 0, dtype=torch.float16)]
    if hybrid_layers:
        layers.append(mamba_layer(sink, 1))
    mgr = KVCacheManager(model_info(layers, 4), num_blocks=3, use_hybrid_blocks=True)
    with caplog.at_level(logging.INFO, logger="kvskill.runtime.layout"):
        mgr.allocate_cache_tensors(log_layout=True)
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(line.startswith(LOG_PREFIX) for line in lines)
    k_line = next(line for line in lines if "cache=k_cache" in line)
    assert f"mode={mode}" in k_line
    for field in ("shape=(3, 4, 2, 8)", "stride=(", "storage_offset=0", "contiguous="):
        assert field in k_line
    assert "padding_fraction=" in lines[-1]
    if hybrid_layers:
        ssm_line = next(line for line in lines if "cache=ssm_state" in line)
        assert "page_size_bytes=256" in ssm_line and "contiguous=False" in ssm_line
        assert "page_size_bytes" not in k_line


@pytest.mark.parametrize("use_hybrid_blocks", [True, False])
def test_layout_logs_are_off_by_default(monkeypatch, caplog, use_hybrid_blocks):
    # The runtime reads no environment: the CLI's KVSKILL_LOG_LAYOUT default does not reach it.
    monkeypatch.setenv("KVSKILL_LOG_LAYOUT", "1")
    sink = Sink()
    mgr = KVCacheManager(
        model_info([attn_layer(sink, 0)]), num_blocks=3, use_hybrid_blocks=use_hybrid_blocks
    )
    with caplog.at_level(logging.DEBUG, logger="kvskill.runtime.layout"):
        mgr.allocate_cache_tensors()
    assert not [r for r in caplog.records if LOG_PREFIX in r.getMessage()]
    # The same build with the parameter on logs one line per contiguous tensor (or view).
    with caplog.at_level(logging.DEBUG, logger="kvskill.runtime.layout"):
        mgr.allocate_cache_tensors(log_layout=True)
    lines = [r.getMessage() for r in caplog.records if LOG_PREFIX in r.getMessage()]
    mode = "gqa" if use_hybrid_blocks else "contiguous"
    assert [line.split()[1] for line in lines[:2]] == [f"mode={mode}"] * 2
    assert any("cache=k_cache" in line for line in lines)
    assert any("cache=v_cache" in line for line in lines)


def _write_and_attend(use_hybrid_blocks: bool):
    """Two requests through manager -> tables -> cache write -> paged fused attention."""
    sink = Sink()
    info = model_info([attn_layer(sink, 0, num_head=2, head_dim=8)], block_size=4)
    mgr = KVCacheManager(
        info,
        num_blocks=9,
        use_hybrid_blocks=use_hybrid_blocks,
        free_block_order_seed=3,
        page_alignment_bytes=640,  # 512 B of K+V per block, padded to 640 B pages
    )
    mgr.allocate_cache_tensors()
    lens = [7, 5]
    for i, n in enumerate(lens):
        assert mgr.allocate_slots(f"r{i}", n) is not None
    table = prepare_block_tables([mgr.get_block_ids(f"r{i}")["FullAttention"] for i in range(2)])
    req, pos = prepare_token_positions(torch.zeros(2, dtype=torch.int64), torch.tensor(lens))
    slots = prepare_slot_mapping(table, req, pos, 4)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 2, 8, generator=gen) for _ in range(3))
    k_cache, v_cache = sink.tensors[(0, "k_cache")], sink.tensors[(0, "v_cache")]
    # Address (block, offset) so the write works on strided page views as well as dense ones.
    index = torch.stack([slots // 4, slots % 4], dim=-1)  # [T, 2]
    torch_npu.npu_scatter_nd_update_(k_cache, index, k)
    torch_npu.npu_scatter_nd_update_(v_cache, index, v)
    assert torch.equal(k_cache[slots // 4, slots % 4], k)
    assert torch.equal(v_cache[slots // 4, slots % 4], v)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q,
        k_cache.view(9, 4, -1),
        v_cache.view(9, 4, -1),
        num_heads=2,
        num_key_value_heads=2,
        input_layout="TND",
        scale=8**-0.5,
        atten_mask=get_mask(),
        sparse_mode=3,
        block_table=table,
        block_size=4,
        actual_seq_lengths=[7, 12],
        actual_seq_lengths_kv=lens,
    )
    return mgr, out


def get_mask():
    return get_init_attn_mask(2048)


def test_page_pool_views_serve_the_paged_operators_like_dense_tensors():
    dense_mgr, dense_out = _write_and_attend(use_hybrid_blocks=False)
    pool_mgr, pool_out = _write_and_attend(use_hybrid_blocks=True)
    assert pool_mgr.layout.page_size_bytes == 640
    assert dense_out.shape == (12, 2, 8) and dense_out.abs().sum() > 0
    assert torch.allclose(pool_out, dense_out, atol=1e-6)
    # The flat slot view used on dense caches cannot be formed over padded pages: view()
    # refuses rather than silently copying.
    k_pool = pool_mgr.cache_info.layer_infos[0].caches[0].tensor
    with pytest.raises(RuntimeError):
        k_pool.view(-1, 2, 8)
    assert dense_mgr.cache_info.layer_infos[0].caches[0].tensor.view(-1, 2, 8).shape == (36, 2, 8)


def test_layout_switch_prints_to_stderr_without_logging_setup():
    here = os.path.dirname(__file__)
    script = (
        f"import sys; sys.path.insert(0, {here!r})\n"
        "from runtime_factories import Sink, attn_layer, model_info\n"
        "from kvskill.runtime import KVCacheManager\n"
        "mgr = KVCacheManager(model_info([attn_layer(Sink(), 0)]), num_blocks=3,\n"
        "                     use_hybrid_blocks=True)\n"
        "mgr.allocate_cache_tensors(log_layout=sys.argv[1] == 'on')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, "on"], env=os.environ, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    assert any(line.startswith(f"{LOG_PREFIX} mode=gqa") for line in lines)
    quiet = subprocess.run(
        [sys.executable, "-c", script, "off"],
        env={**os.environ, "KVSKILL_LOG_LAYOUT": "1"},  # ignored below the CLI
        capture_output=True,
        text=True,
    )
    assert quiet.returncode == 0, quiet.stderr
    assert LOG_PREFIX not in quiet.stderr


def test_mixed_dtype_states_are_aligned_and_do_not_overlap():
    # conv: 5x3 bf16 = 30 B; ssm must start on a 4-byte boundary: byte 32, not 30.
    sink = Sink()
    conv, ssm = (
        MambaCacheEntry(
            cache_name=name,
            shape=shape,
            dtype=dtype,
            needs_block=True,
            tensor_setter=sink.setter(0, name.split("_")[0]),
        )
        for name, shape, dtype in (
            ("conv_state", [5, 3], torch.bfloat16),
            ("ssm_state", [2, 4], torch.float32),
        )
    )
    info = ModelCacheInfo(num_layers=1, layer_infos=[LayerCacheInfo(0, [conv, ssm])])
    mgr = KVCacheManager(info, num_blocks=4, use_hybrid_blocks=True, page_alignment_bytes=64)
    mgr.allocate_cache_tensors()
    conv_view, ssm_view = sink.tensors[(0, "conv")], sink.tensors[(0, "ssm")]
    assert mgr.layout.page_size_bytes == 64
    assert conv_view.stride()[0] == 32 and ssm_view.stride()[0] == 16
    assert ssm_view.storage_offset() == 8  # 32 bytes in fp32 elements
    conv_view.fill_(1.0)
    ssm_view.fill_(2.0)
    page = mgr.layout.raw_views[0][2]
    assert torch.all(page[:30].view(torch.bfloat16) == 1.0)
    assert torch.all(page[30:32] == 0)  # alignment gap untouched
    assert torch.all(page[32:64].view(torch.float32) == 2.0)

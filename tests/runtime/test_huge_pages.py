"""KV cache pools are zeroed buffers whose whole 2 MiB pages are advised onto huge pages."""

import sys

import pytest
import torch
from kvskill.runtime import KVCacheManager, huge_pages
from runtime_factories import Sink, attn_layer, model_info


def _thp_setting() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_zeros_is_torch_zeros_whatever_the_size(dtype):
    for shape in [(3, 5), (9, 16, 1024 * 8)]:  # below and above the advised size
        t = huge_pages.zeros(shape, dtype=dtype, device="cpu")
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.storage_offset() == 0
        assert not t.any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_only_whole_huge_pages_inside_the_buffer_are_advised(monkeypatch):
    calls = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda a, n, f: calls.append((a, n)) or 0)
    small = torch.empty(huge_pages.HUGE_PAGE_BYTES // 2, dtype=torch.int8)
    assert huge_pages.advise(small) is False and calls == []
    big = torch.empty(5 * huge_pages.HUGE_PAGE_BYTES, dtype=torch.int8)
    assert huge_pages.advise(big) is True
    ((start, length),) = calls
    assert start % huge_pages.HUGE_PAGE_BYTES == 0 and length % huge_pages.HUGE_PAGE_BYTES == 0
    assert big.data_ptr() <= start and start + length <= big.data_ptr() + big.numel()
    assert length >= 4 * huge_pages.HUGE_PAGE_BYTES


@pytest.mark.skipif(_thp_setting() in (None, "never"), reason="no transparent huge pages here")
def test_the_kernel_takes_the_advice():
    t = torch.empty(8 * huge_pages.HUGE_PAGE_BYTES, dtype=torch.int8)
    assert huge_pages.advise(t) is True


@pytest.mark.parametrize("use_hybrid_blocks", [False, True])
def test_cache_pools_are_allocated_through_it(monkeypatch, use_hybrid_blocks):
    seen = []
    real = huge_pages.zeros

    def spy(shape, *, dtype, device):
        t = real(shape, dtype=dtype, device=device)
        seen.append(t.data_ptr())
        return t

    monkeypatch.setattr(huge_pages, "zeros", spy)
    sink = Sink()
    info = model_info([attn_layer(sink, 0), attn_layer(sink, 1)], block_size=4)
    mgr = KVCacheManager(info, num_blocks=5, use_hybrid_blocks=use_hybrid_blocks)
    mgr.allocate_cache_tensors()
    caches = list(sink.tensors.values())
    assert len(caches) == 4
    # every cache is (a view of) a buffer that came from huge_pages.zeros
    assert {t.untyped_storage().data_ptr() for t in caches} <= set(seen)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_large_pool_costs_only_the_pages_written():
    import gc

    # a 256 MiB pool: zero to read, yet no page of it is resident before it is written
    before = _resident_bytes()
    pool = huge_pages.zeros((256, 1 << 20), dtype=torch.int8, device="cpu")
    assert _resident_bytes() - before < 16 << 20
    assert not pool[::64].any()
    # writing one block faults in that block's pages only
    block = pool[7:8].view(torch.float32)
    block.fill_(1.5)
    assert _resident_bytes() - before < 32 << 20
    # a view keeps the mapping alive after the pool itself is gone
    del pool
    gc.collect()
    assert float(block.sum()) == 1.5 * block.numel()

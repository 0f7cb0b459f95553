"""Zero-filled CPU buffers advised onto transparent huge pages: the KV cache pools.

Zero-filled without a zeroing pass: a large CPU buffer is a fresh anonymous memory mapping,
whose pages the kernel hands out zeroed when they are first touched. A pool therefore costs
time and resident memory only for the pages a run writes: ``torch.zeros`` of the 2.35 GiB
pool a 4-layer Jamba got for 262,144-token requests took 8.0 s (5.5 s of it system time,
faulting in and clearing every page) before the first token; the mapping takes microseconds.
The zeros matter in one place: the null block (block 0 of every pool). A sliding-window
request's table keeps the blocks that left its window pointing at it, and attention reads
those positions and masks them afterwards, so a NaN there would reach the output (0 x NaN).
Every other row is written before it is read (``tests/runtime/test_unwritten_pool_rows.py``
and the state-model tests fill them with NaN and get the same tokens).

Why: decode attention walks every request's blocks, scattered over a pool of tens to
hundreds of MB, one head's rows at a time; with 4 KiB pages nearly every row is another page
and another TLB miss. Backed by 2 MiB pages, the compiled decode kernel on 16 requests of 160
cached tokens (16 heads over 8 kv heads of 128, fp32, 2 threads, caches not in any CPU cache)
took 0.96 ms instead of 1.11 ms (median of 300 interleaved calls each).

Only these long-lived buffers: torch's own switch (``THP_MEM_ALLOC_ENABLE``) advises every
allocation of 2 MiB or more, and with it a serving run of the 0.6B benchmark model was slower
(8.0-9.1 s against 7.3-8.0 s for W2, six runs each) - likely each step's large activations
faulting in and zeroing fresh huge pages (not confirmed by a profile).

The advice is given before the first write, so the pages are faulted in huge where the kernel
allows it. It is only advice: on a kernel with transparent huge pages off, outside Linux, or
where memory comes back from the allocator already touched, the buffer is ordinary memory
with the same contents.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import sys

import torch
from torch import Tensor

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


@functools.cache
def _madvise():
    """libc's madvise, or None where it cannot be had."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise(t: Tensor) -> bool:
    """Advise the whole huge pages inside ``t``'s memory; True when the advice was taken."""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu":
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first:
        return False
    return madvise(first, last - first, _MADV_HUGEPAGE) == 0


def zeros(shape: tuple[int, ...], *, dtype: torch.dtype, device) -> Tensor:
    """``torch.zeros(shape)``; on the CPU, from fresh zero pages (no zeroing pass) with its
    huge pages advised before the first write, once it spans two huge pages."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < 2 * HUGE_PAGE_BYTES:
        # a device memset runs at the device's bandwidth; a small host buffer is cheap to clear
        return torch.zeros(shape, dtype=dtype, device=device)
    t = _fresh_zero_pages(nbytes, dtype)
    if t is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    t = t.view(shape)
    advise(t)
    return t


def _fresh_zero_pages(nbytes: int, dtype: torch.dtype) -> Tensor | None:
    """NBYTES of a new private anonymous mapping as a flat DTYPE tensor, or None where the
    platform has no such mapping. The tensor's storage keeps the mapping alive."""
    private = getattr(mmap, "MAP_PRIVATE", None)
    anonymous = getattr(mmap, "MAP_ANONYMOUS", None)
    if private is None or anonymous is None:
        return None
    # NOTE: private, not mmap's default shared mapping: shared anonymous memory lives in
    # shmem, which transparent huge pages and fork's copy-on-write treat differently
    pages = mmap.mmap(-1, nbytes, flags=private | anonymous)
    return torch.frombuffer(pages, dtype=dtype)

"""Zero-filled CPU buffers advised onto transparent huge pages: the KV cache pools.

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
    """``torch.zeros(shape)``; on the CPU, its huge pages advised before it is zeroed."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.device.type == "cpu" and t.numel() * t.element_size() >= 2 * HUGE_PAGE_BYTES:
        advise(t)
    return t.zero_()

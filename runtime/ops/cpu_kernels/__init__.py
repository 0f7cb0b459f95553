"""Compiled CPU kernels for the reference operators' hot cases.

The reference operators are plain PyTorch, and one case dominates a served model's time on
CPU: decode attention over a paged KV cache with requests of different lengths. PyTorch has no
operator that reads paged KV in place, so the reference gathers every request's blocks into a
padded copy first. ``paged_decode`` computes the same function in a small C kernel that walks
the block table instead.

The kernel is compiled on first use with the machine's C compiler (``cc``, or ``$CC``) into a
per-user cache and loaded with ``ctypes``: no build step at install time and no new package.
Without a compiler, or with ``KVSKILL_CPU_KERNELS=0``, everything runs on the PyTorch reference;
``status()`` says which and why.
"""

from __future__ import annotations

from .build import KernelStatus, disabled, status
from .paged_decode import paged_decode

__all__ = ["KernelStatus", "disabled", "paged_decode", "status"]

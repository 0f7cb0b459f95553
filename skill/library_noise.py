"""Library log lines that tell a kvskill user nothing, kept off the terminal.

transformers 5 routes some mixers' convolutions through hub kernels and, on a machine
without the kernel package, logs once per function that it "is falling back to its reference
PyTorch implementation". On the CPU this is always so, the reference path is what verify
compares, and a Jamba verify printed four such lines. They come back with ``-v``.
"""

from __future__ import annotations

import logging

#: the logger transformers' hub-kernel wrapper writes through (its module name)
HUB_KERNELS_LOGGER = "transformers.integrations.hub_kernels"
KERNEL_FALLBACK = "is falling back to its reference PyTorch implementation"


class _DropKernelFallback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return KERNEL_FALLBACK not in record.getMessage()


def quiet_kernel_fallbacks() -> None:
    """Drop the hub-kernel fallback lines (idempotent; needs no transformers import: the
    logger is the one transformers will fetch by the same name)."""
    logger = logging.getLogger(HUB_KERNELS_LOGGER)
    if not any(isinstance(f, _DropKernelFallback) for f in logger.filters):
        logger.addFilter(_DropKernelFallback())

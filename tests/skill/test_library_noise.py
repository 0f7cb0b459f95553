"""transformers' hub-kernel fallback lines stay off a kvskill user's terminal, other warnings
of the same logger do not, and the wording matched is the installed transformers' own."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
from kvskill.library_noise import HUB_KERNELS_LOGGER, KERNEL_FALLBACK, quiet_kernel_fallbacks


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_fallback_line_is_dropped_and_other_warnings_pass():
    logger = logging.getLogger(HUB_KERNELS_LOGGER)
    collect = _Collect()
    logger.addHandler(collect)
    try:
        quiet_kernel_fallbacks()
        quiet_kernel_fallbacks()  # twice: still one filter
        logger.warning("`causal_conv1d_fn` %s because `causal-conv1d` is missing", KERNEL_FALLBACK)
        logger.warning("a kernel failed to load")
    finally:
        logger.removeHandler(collect)
    assert collect.messages == ["a kernel failed to load"]
    assert sum(type(f).__name__ == "_DropKernelFallback" for f in logger.filters) == 1


def test_the_matched_wording_and_logger_are_the_installed_transformers():
    spec = importlib.util.find_spec("transformers.integrations.hub_kernels")
    if spec is None or spec.origin is None:
        pytest.skip("this transformers has no hub-kernel wrapper")
    source = Path(spec.origin).read_text(encoding="utf-8")
    if "is falling back" not in source:
        pytest.skip("this transformers' hub-kernel wrapper logs no fallback line")
    assert KERNEL_FALLBACK in source
    assert spec.name == HUB_KERNELS_LOGGER  # transformers names its loggers by module

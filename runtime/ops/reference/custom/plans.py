"""The ``[1024]`` int32 tiling plans the framework's metadata operators return.

On the device an AICPU operator splits one call into per-core tasks and the attention or
indexer reads that plan (its ``metadata`` argument). The split is hardware scheduling the
reference does not model: a reference plan records the arguments it was made for in its first
words, and the consuming operator refuses a plan made for another call (other heads, dims,
ratio, top-k, ...), the mistake a converted model makes when it shares one plan between layer
kinds. NOTE: whether the device detects such a mismatch or computes garbage is unconfirmed;
the reference refuses.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .limits import METADATA_WORDS, fail


def write_plan(fields: tuple[str, ...], values: dict[str, int], device: torch.device) -> Tensor:
    plan = torch.zeros(METADATA_WORDS, dtype=torch.int32, device=device)
    plan[: len(fields)] = torch.tensor([int(values[f]) for f in fields], dtype=torch.int32)
    return plan


def check_plan(
    op: str, producer: str, metadata: Tensor | None, fields: tuple[str, ...], **call: int
) -> None:
    """Refuse a plan made for another call; CALL names a subset of FIELDS."""
    if metadata is None:
        fail(op, f"`metadata` is required (from {producer})")
    if (
        not isinstance(metadata, Tensor)
        or metadata.dtype != torch.int32
        or tuple(metadata.shape) != (METADATA_WORDS,)
    ):
        fail(op, f"`metadata` must be an int32 tensor of shape [{METADATA_WORDS}]")
    recorded = dict(zip(fields, metadata[: len(fields)].tolist(), strict=True))
    for name, value in call.items():
        if recorded[name] != value:
            fail(
                op,
                f"`metadata` was made for {name}={recorded[name]} but this call has {value}; "
                f"call {producer} with this layer's arguments",
            )

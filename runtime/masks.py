"""The fixed compressed attention mask tile the fused attention expects for sparse modes 2-4."""

from __future__ import annotations

import torch
from torch import Tensor

MASK_KINDS = ("causal", "band")


def get_init_attn_mask(
    size: int = 2048, device: str | torch.device | None = None, kind: str = "causal"
) -> Tensor:
    """Bool ``[size, size]`` mask, True = masked: ones strictly above the diagonal.

    Sparse modes 3 (causal) and 4 (band) both take this same compressed tile; in band mode
    the window comes from ``pre_tokens``/``next_tokens``, not from the mask contents
    (see the ops reference, masking rules). ``kind`` documents intent at the call site and
    rejects typos. The operators require ``size == 2048`` for modes 2-4; other sizes are
    for tests.
    """
    if kind not in MASK_KINDS:
        raise ValueError(f"mask kind must be one of {MASK_KINDS}, got {kind!r}")
    ones = torch.ones(size, size, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1)

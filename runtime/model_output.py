"""Reading a model's forward output, whatever form its class returns."""

from __future__ import annotations

from torch import Tensor


def logits_of(out) -> Tensor:
    """The logits of a model output (a ModelOutput, a tuple, or the tensor itself)."""
    return out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out

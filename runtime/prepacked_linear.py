"""Opt-in: run a model's fp32 ``nn.Linear`` layers through oneDNN with weights prepacked once.

Why: on CPU, PyTorch's fp32 ``linear`` calls MKL's sgemm. On the AMD EPYC the benchmarks ran
on, oneDNN with the weight reordered ahead of time ran the Qwen3-0.6B shapes 2.2-3.4x faster
at decode and prefill batches (``benchmarks/bench_linear.py``), and a profiled step of that
model was 80 % linear layers (benchmarks/README.md, "Where the time goes"). vLLM's CPU
build uses oneDNN for its linear layers.

Not exact: oneDNN sums in another order than MKL, so logits differ from the default path in
the last bits (about 1e-6 relative) and a greedy token can in principle flip where two logits
tie that closely. The default stays MKL (token-exact against transformers); this is an
explicit choice (``LLM(..., prepack_linear=True)``, ``prepack_linears(model)``).

The original ``weight`` parameter stays (state dicts, tied embeddings, the output head's
checks read it); the packed copy is an extra buffer of the same size, so a model's linear
weights take twice the memory.
"""

from __future__ import annotations

import types

import torch
from torch import nn

#: Batch-size hint for the weight reorder: oneDNN picks the packed layout for this many rows.
_ROWS_HINT = 16


def unavailable_reason() -> str | None:
    """Why prepacking cannot run in this torch, or None when it can."""
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN (mkldnn) backend"
    ops = torch.ops.mkldnn
    for name in ("_reorder_linear_weight", "_linear_pointwise"):
        if not hasattr(ops, name):
            return f"this torch has no torch.ops.mkldnn.{name}"
    return None


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return nn.functional.linear(x, self.weight, self.bias)
    return torch.ops.mkldnn._linear_pointwise(x, self._kvskill_packed, self.bias, "none", [], "")


def prepack_linears(model: nn.Module) -> int:
    """Prepack every fp32 CPU ``nn.Linear`` of ``model``; returns how many were packed.

    Raises:
        RuntimeError: when this torch cannot (``unavailable_reason``).
    """
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"cannot prepack linear layers: {reason}")
    count = 0
    with torch.no_grad():
        for module in model.modules():
            if type(module) is not nn.Linear:
                continue
            w = module.weight
            if w.dtype != torch.float32 or w.device.type != "cpu":
                continue
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _ROWS_HINT)
            # Not a registered buffer: it must not show up in state dicts or be moved by .to().
            module._kvskill_packed = packed
            module.forward = types.MethodType(_packed_forward, module)
            count += 1
    return count

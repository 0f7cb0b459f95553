"""Opt-in: a fp32 model's RMSNorm and gated-MLP modules run through one-pass CPU kernels.

Why: with the linear layers prepacked (``prepacked_linear``), what was left of a prefill step
besides its matrix products was mostly elementwise passes of the model's own PyTorch code: an
RMSNorm is six passes over its input, a gated MLP's ``act(gate) * up`` two more (plus a copy
of each half when gate and up are one packed weight). ``runtime/ops/cpu_kernels/
fused_elementwise.c`` does each in one pass; ``benchmarks/README.md`` has what it saved.

Which modules: no class names are trusted. A module is a candidate by its shape (an RMSNorm:
a lone 1-D ``weight`` and an ``eps`` or ``variance_epsilon``; a gated MLP: ``gate_proj``,
``up_proj``, ``down_proj`` and ``act_fn``), and is switched over only when its own forward and
the fused one agree on a probe input (to fp32 rounding). Variants that compute something else
(Gemma's ``1 + weight``, a GELU MLP, an offset, a cast to another dtype) fail the probe and
keep their code. A switched module still runs its own forward for inputs the kernels do not
cover (another dtype or device).

Not exact: the kernels sum mean(x^2) in another order and their exp differs in the last bits,
so results differ from the default path by about 1e-7 relative and a greedy token can in
principle flip where two logits tie that closely; the default path stays token-exact against
transformers.
"""

from __future__ import annotations

import types

import torch
from kvskill.runtime.ops.cpu_kernels import fused_elementwise
from torch import Tensor, nn

#: how closely a module's own forward and the fused one must agree on the probe input
_PROBE_RTOL, _PROBE_ATOL = 1e-5, 1e-6
#: rows of the probe input
_PROBE_ROWS = 3
_EPS_NAMES = ("variance_epsilon", "eps")


def unavailable_reason() -> str | None:
    """Why the fused kernels cannot run here (no compiler, kernels off), or None."""
    probe = torch.ones(1, 16)
    if fused_elementwise.rms_norm(probe, torch.ones(16), 1e-6) is None:
        from kvskill.runtime.ops.cpu_kernels.build import status

        return status("fused_elementwise").reason
    return None


def fuse_layers(model: nn.Module) -> int:
    """Switch every RMSNorm and gated MLP of ``model`` that passes its probe; returns how many.

    Raises:
        RuntimeError: when the kernels cannot run here (``unavailable_reason``).
    """
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"cannot fuse layers: {reason}")
    count = 0
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if _rms_norm_shaped(module):
                fused, width = _fused_rms_norm_forward, module.weight.size(0)
            elif _gated_mlp_shaped(module):
                fused, width = _fused_mlp_forward, module.gate_proj.in_features
            else:
                continue
            fused = types.MethodType(fused, module)
            if _agrees(module, fused, width, generator):
                module._kvskill_own_forward = module.forward
                module.forward = fused
                count += 1
    return count


def _rms_norm_shaped(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and getattr(module, "bias", None) is None
        and not any(True for _ in module.children())
        and isinstance(_eps(module), float)
    )


def _gated_mlp_shaped(module: nn.Module) -> bool:
    parts = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return (
        all(isinstance(p, nn.Linear) for p in parts)
        and parts[0].weight.dtype == torch.float32
        and callable(getattr(module, "act_fn", None))
    )


def _eps(module: nn.Module) -> float | None:
    for name in _EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _agrees(module: nn.Module, fused, width: int, generator: torch.Generator) -> bool:
    """Whether the module's forward and ``fused`` give the same output on a probe input of
    ``width`` features."""
    x = torch.randn(_PROBE_ROWS, width, generator=generator)
    try:
        own = module.forward(x)
        mine = fused(x)
    except Exception:  # noqa: BLE001 - any failure means: keep the module's own code
        return False
    return (
        isinstance(own, Tensor)
        and own.shape == mine.shape
        and own.dtype == mine.dtype
        and torch.allclose(own, mine, rtol=_PROBE_RTOL, atol=_PROBE_ATOL)
    )


def _fused_rms_norm_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
    out = fused_elementwise.rms_norm(hidden_states, self.weight, _eps(self))
    return self._kvskill_own_forward(hidden_states) if out is None else out


def _fused_mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    gate, up = _gate_and_up(self, x)
    hidden = fused_elementwise.silu_mul(gate, up)
    if hidden is None:
        hidden = self.act_fn(gate) * up
    return self.down_proj(hidden)


def _gate_and_up(mlp: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """gate_proj(x) and up_proj(x); the two column ranges of one GEMM, read in place, when the
    two are packed as one weight (``prepacked_linear``)."""
    group = getattr(mlp.gate_proj, "_kvskill_fused", None)
    if (
        group is not None
        and group is getattr(mlp.up_proj, "_kvskill_fused", None)
        and len(group.columns) == 2
        and x.dtype == torch.float32
        and x.device.type == "cpu"
    ):
        both = group.compute(x)
        gate_cols = group.columns[mlp.gate_proj._kvskill_fused_index]
        up_cols = group.columns[mlp.up_proj._kvskill_fused_index]
        return both[..., gate_cols], both[..., up_cols]
    return mlp.gate_proj(x), mlp.up_proj(x)

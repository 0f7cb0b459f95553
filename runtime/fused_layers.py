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

Rotary embedding is no module: models call a function of their modeling file,
``apply_rotary_pos_emb(q, k, cos, sin)``, on the per-head query and key. That function is
switched in the modeling file's namespace (so for every model of that file in the process)
when its result and the kernel's are equal bit for bit on a probe input; calls the kernel
does not cover (other dtypes, layouts or arguments) run the file's own function.

Not exact: the kernels sum mean(x^2) in another order and their exp differs in the last bits,
so results differ from the default path by about 1e-7 relative and a greedy token can in
principle flip where two logits tie that closely; the default path stays token-exact against
transformers.
"""

from __future__ import annotations

import sys
import types

import torch
from kvskill.runtime.exact_steps import in_exact_steps
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
        count += _fuse_rope(model, generator)
    return count


def _fuse_rope(model: nn.Module, generator: torch.Generator) -> int:
    """Switch the rotary embedding function of the modeling file(s) of ``model``'s attention
    modules (those with an int ``head_dim``); returns how many attention modules use it."""
    count = 0
    verdicts: dict[str, bool] = {}
    for module in model.modules():
        head_dim = getattr(module, "head_dim", None)
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            continue
        name = type(module).__module__
        if name not in verdicts:
            verdicts[name] = _switch_rope(sys.modules.get(name), head_dim, generator)
        count += verdicts[name]
    return count


def _switch_rope(namespace, head_dim: int, generator: torch.Generator) -> bool:
    """Whether ``namespace.apply_rotary_pos_emb`` is (now) the fused one."""
    own = getattr(namespace, "apply_rotary_pos_emb", None)
    if not callable(own):
        return False
    if getattr(own, "_kvskill_own_rope", None) is not None:
        return True  # switched for an earlier model of this file
    fused = _fused_rope(own)
    # the model's layout: q_proj(x).view(1, T, H, D).transpose(1, 2); one angle per token
    q = torch.randn(1, _PROBE_ROWS, 2, head_dim, generator=generator).transpose(1, 2)
    k = torch.randn(1, _PROBE_ROWS, 1, head_dim, generator=generator).transpose(1, 2)
    cos, sin = (torch.randn(1, _PROBE_ROWS, head_dim, generator=generator) for _ in range(2))
    try:
        with torch.no_grad():
            expected, got = own(q, k, cos, sin), fused(q, k, cos, sin)
        same = all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    except Exception:  # noqa: BLE001 - any failure means: keep the file's own function
        return False
    if same:
        namespace.apply_rotary_pos_emb = fused
    return same


def _fused_rope(own):
    """``own`` (a modeling file's apply_rotary_pos_emb) with the kernel for the calls it covers:
    fp32 [1, H, T, D] query and key with [1, T, D] angles and no other arguments."""

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if not args and (not kwargs or kwargs == {"unsqueeze_dim": 1}) and not in_exact_steps():
            q_out = fused_elementwise.rope(q, cos, sin)
            k_out = fused_elementwise.rope(k, cos, sin) if q_out is not None else None
            if k_out is not None:
                return q_out, k_out
        return own(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._kvskill_own_rope = own
    apply_rotary_pos_emb.__doc__ = own.__doc__
    return apply_rotary_pos_emb


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
    if in_exact_steps():
        return self._kvskill_own_forward(hidden_states)
    out = fused_elementwise.rms_norm(hidden_states, self.weight, _eps(self))
    return self._kvskill_own_forward(hidden_states) if out is None else out


def _fused_mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    if in_exact_steps():
        return self._kvskill_own_forward(x)
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

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

Sibling projections of one input (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``)
are packed as one weight: the first of them called on an input runs one GEMM for all, the
others return their columns of it. At decode batches a GEMM is bound by reading its weight
and by per-call overhead, so one wide call costs less than two or three narrow ones. No model
code changes: a member called on another input (or on the same tensor changed in place, where
torch tracks it) runs the fused GEMM again, so results do not depend on call order, only the
saving does.

In a captured decode step each packed GEMM is one registered operator,
``torch.ops.kvskill.packed_linear`` (inductor lowers oneDNN's own linear only for weights it
froze itself, which these are not).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable

import torch
from kvskill.runtime.exact_steps import in_exact_steps
from kvskill.runtime.forward_context import live_rows_of
from kvskill.runtime.ops.reference.graph_ops import compiling, register
from torch import Tensor, nn

#: Batch-size hint for the weight reorder: oneDNN picks the packed layout for this many rows.
_ROWS_HINT = 16

#: Names of sibling ``nn.Linear`` modules that read the same input in the model families the
#: runtime serves (attention's q/k/v, gated MLPs' gate/up); fused when at least two are present.
FUSABLE_SIBLINGS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("w1", "w3"),
)


def unavailable_reason() -> str | None:
    """Why prepacking cannot run in this torch, or None when it can."""
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN (mkldnn) backend"
    ops = torch.ops.mkldnn
    for name in ("_reorder_linear_weight", "_linear_pointwise"):
        if not hasattr(ops, name):
            return f"this torch has no torch.ops.mkldnn.{name}"
    return None


def packed_weight(weight: Tensor) -> Tensor:
    """``weight`` ([out, in], fp32 or bf16) reordered once into oneDNN's layout for
    ``torch.ops.mkldnn._linear_pointwise``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight.T + bias`` for ``packed`` = ``packed_weight(weight)``.

    In a captured decode step padded to its bucket, only the live rows are computed and the
    padded rows are zeros (``forward_context.live_rows_of``)."""
    if compiling():
        return _PACKED_LINEAR(x, packed, bias, live_rows_of(math.prod(x.shape[:-1])))
    return _packed_linear(x, packed, bias)


def _packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None, live_rows: int = -1) -> Tensor:
    def linear(rows: Tensor, out: Tensor | None) -> Tensor:
        result = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
        # oneDNN's linear takes no output tensor: the live rows are copied into the step's
        return result if out is None else out.copy_(result)

    return on_live_rows(linear, x, live_rows, packed.shape[0])


def on_live_rows(
    fn: Callable[[Tensor, Tensor | None], Tensor],
    x: Tensor,
    live_rows: int,
    width: int,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """``fn`` (rows of ``x`` in, ``width`` columns out, row by row) over the first LIVE_ROWS
    rows of ``x`` (all of them when negative or not fewer), zeros for the others.

    ``fn(rows, out)`` returns its result, written into OUT (``[rows, width]``, a view of the
    result this returns, of ``dtype`` or ``x``'s) unless OUT is None (every row live).

    Why: a captured decode step pads its batch to a static bucket, and on the CPU a padded
    row costs a row of every GEMM (the step is GEMM-bound at decode batches); zeros give the
    rows nobody reads defined values. CPU only: torchair's NPU graphs do not run these
    kernels (a padded row there costs what the framework's padding costs)."""
    rows = math.prod(x.shape[:-1])
    if live_rows < 0 or live_rows >= rows:
        return fn(x, None)
    out = x.new_empty(rows, width, dtype=dtype or x.dtype)
    out[live_rows:].zero_()
    if live_rows:
        fn(x.reshape(rows, x.shape[-1])[:live_rows], out[:live_rows])
    return out.view(*x.shape[:-1], width)


# oneDNN's linear as one opaque node of a captured graph; the packed weight keeps its
# [out, in] shape (as torch's own meta function for the oneDNN op reads it). LIVE_ROWS is an
# int traced from a tensor in a captured decode step, so its changes never recompile.
_PACKED_LINEAR = register(
    "packed_linear",
    _packed_linear,
    lambda x, packed, bias, live_rows=-1: x.new_empty(*x.shape[:-1], packed.shape[0]),
)


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.device.type != "cpu" or in_exact_steps():
        return nn.functional.linear(x, self.weight, self.bias)
    return packed_linear(x, self._kvskill_packed, self.bias)


class _FusedSiblings:
    """One packed weight for sibling projections; remembers the last input and its output."""

    def __init__(self, members: list[nn.Linear]) -> None:
        weights = [m.weight.detach() for m in members]
        self.packed = packed_weight(torch.cat(weights))
        if any(m.bias is not None for m in members):
            self.bias = torch.cat(
                [
                    m.bias.detach() if m.bias is not None else w.new_zeros(w.shape[0])
                    for m, w in zip(members, weights, strict=True)
                ]
            )
        else:
            self.bias = None
        bounds = [0]
        for w in weights:
            bounds.append(bounds[-1] + w.shape[0])
        self.columns = [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]
        self._input: Tensor | None = None
        self._input_version = -1
        self._output: Tensor | None = None
        #: members that have taken their columns of the current output
        self._served: set[int] = set()

    def compute(self, x: Tensor) -> Tensor:
        """Every member's output of ``x`` side by side (``columns`` index it), uncached."""
        return packed_linear(x, self.packed, self.bias)

    def output_of(self, index: int, x: Tensor) -> Tensor:
        # NOTE: a different tensor object (or a member asking twice) always recomputes, and
        # so does an input changed in place between the siblings' calls, except under
        # inference mode, whose tensors keep no version counter: there the same object is
        # taken as the same values (model code does not modify a projection's input in
        # place between its q/k/v or gate/up calls). A captured step is traced under inference
        # mode, where dynamo cannot ask; its trace keeps the same memo, so the graph holds one
        # GEMM per group too.
        version = -1 if compiling() or x.is_inference() else x._version
        if x is not self._input or version != self._input_version or index in self._served:
            self._output = self.compute(x)
            self._input, self._input_version = x, version
            self._served = set()
        # Contiguous like nn.Linear's output: model code may view it in any shape.
        out = self._output[..., self.columns[index]].contiguous()
        self._served.add(index)
        if len(self._served) == len(self.columns):
            # Every sibling has its columns: hold no activation between forwards.
            self._input = self._output = None
        return out


def _fused_forward(self: nn.Linear, x: Tensor) -> Tensor:
    if x.dtype != torch.float32 or x.device.type != "cpu" or in_exact_steps():
        return nn.functional.linear(x, self.weight, self.bias)
    return self._kvskill_fused.output_of(self._kvskill_fused_index, x)


def _packable(module: nn.Module) -> bool:
    return (
        type(module) is nn.Linear
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
    )


def _fuse_siblings(model: nn.Module) -> set[int]:
    """Fuse every group of FUSABLE_SIBLINGS found; returns the ids of the modules fused."""
    fused: set[int] = set()
    for parent in model.modules():
        for names in FUSABLE_SIBLINGS:
            members = [getattr(parent, n, None) for n in names]
            members = [m for m in members if m is not None and _packable(m)]
            if len(members) < 2 or len({m.in_features for m in members}) != 1:
                continue
            if len({id(m.weight) for m in members}) != len(members):
                continue  # a weight shared between siblings: packing each alone is simpler
            group = _FusedSiblings(members)
            for index, member in enumerate(members):
                member._kvskill_fused = group
                member._kvskill_fused_index = index
                member.forward = types.MethodType(_fused_forward, member)
                fused.add(id(member))
    return fused


def prepack_linears(model: nn.Module, *, fuse_siblings: bool = True) -> int:
    """Prepack every fp32 CPU ``nn.Linear`` of ``model``; returns how many were packed.

    ``fuse_siblings``: pack FUSABLE_SIBLINGS groups as one weight (one GEMM per group).

    Raises:
        RuntimeError: when this torch cannot (``unavailable_reason``).
    """
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"cannot prepack linear layers: {reason}")
    with torch.no_grad():
        fused = _fuse_siblings(model) if fuse_siblings else set()
        count = len(fused)
        for module in model.modules():
            if id(module) in fused or not _packable(module):
                continue
            packed = packed_weight(module.weight.detach())
            # Not a registered buffer: it must not show up in state dicts or be moved by .to().
            module._kvskill_packed = packed
            module.forward = types.MethodType(_packed_forward, module)
            count += 1
    return count

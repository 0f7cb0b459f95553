"""The decode step as one captured graph per batch bucket (``LLM(..., graph=True)``).

A decode step feeds one token per request. Its inputs are padded to the next bucket size (1,
2, 4, then multiples of 8 up to ``max_num_seqs``), as the Ascend framework pads its decode
batch, and its block tables to the width ``max_model_len`` needs, so every step of a bucket has the same
shapes and one compiled graph serves them all: ``torch.compile(fullgraph=True, dynamic=False)``
with inductor on the CPU, torchair's backend where torch_npu is present (import-guarded; not
exercised on this machine).

Padded rows feed token 0 at position 0 of one key, write it to slot 0 (the null block, which
no request reads: every table pads with it and no length reaches into it) and their logits
are dropped. The number of live rows enters the graph as a tensor read into a traced int, so
the CPU fast paths' operators (the packed linear and the screened head) compute the live rows
only and give the padded rows zeros: on the CPU a padded row would cost a row of every GEMM. The sequence-length list twins the framework fills for its captured decode
(``actual_seq_lengths_list_kv``, ``_cu_list_q``, ``_cu_list_kv``) are read from the length
tensors at the top of the graph (``tolist`` traced into unbacked ints), so the converted layers
pass them as the operators' ``SymInt[]`` lengths and changing lengths never recompile.
Prefill steps, and decode batches larger than the largest bucket, run eagerly.

The fast paths (``runtime/fast_paths.py``) stay on: oneDNN's packed linear, the fused RMSNorm,
SiLU x up and rope kernels and the screened output head are registered operators too, so the
graph holds each as one node (the screen decides its candidates when the graph replays).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from kvskill.core.errors import UnsupportedModelError
from kvskill.runtime.forward_context import ForwardMetaData, captured_forward_context
from kvskill.runtime.kv_cache_manager import KVCacheManager
from kvskill.runtime.model_output import logits_of
from kvskill.runtime.step_inputs import StepInputs
from torch import Tensor, nn
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

#: the null block's first slot: where padded rows write (never read by a real request)
NULL_SLOT = 0


#: bucket spacing above 4 (vLLM's capture sizes are 1, 2, 4 and the multiples of 8): a padded
#: row cost a row of every GEMM; with doubling buckets (a batch of 17 run as 32) the captured
#: decode lost 8% of eager's tokens/s on the peer benchmark's shrinking-batch workload (W1)
#: and nothing on its fixed-batch one (W2), measured 2026-12-07 (benchmarks/README.md). The
#: CPU fast paths now skip the padded rows' GEMM arithmetic; the rest of the step does not.
BUCKET_STEP = 8


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of BUCKET_STEP below ``max_num_seqs``, and
    ``max_num_seqs`` itself: a batch pads by fewer than BUCKET_STEP rows."""
    sizes = [size for size in (1, 2, 4) if size < max_num_seqs]
    sizes += range(BUCKET_STEP, max_num_seqs, BUCKET_STEP)
    return [*sizes, max_num_seqs]


#: names a torch.compile backend for the capture instead of the default (e.g. "aot_eager" or
#: "eager": dynamo's capture without inductor's code generation, which takes tens of seconds)
BACKEND_ENV = "KVSKILL_GRAPH_BACKEND"


def _backend() -> Any:
    """KVSKILL_GRAPH_BACKEND when set; else torchair's NPU graph backend where torch_npu
    imports, else inductor."""
    chosen = os.environ.get(BACKEND_ENV, "").strip()
    if chosen:
        return chosen
    try:
        import torch_npu  # noqa: F401
        import torchair
    except ImportError:
        return "inductor"
    return torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())


#: Inductor's C++ kernels split a loop over the OpenMP threads once each thread gets 512
#: elements; a decode step's elementwise work (a residual add of batch x hidden) is a few
#: thousand elements, where opening a parallel region costs more than the loop, and on a
#: loaded machine a region waits milliseconds for its second thread (measured: a 4,096-element
#: add took 3.3 ms per call). ATen runs such loops on one thread below its grain size of
#: 32,768 elements (at::internal::GRAIN_SIZE); the captured step uses the same threshold.
INDUCTOR_OPTIONS = {"cpp.min_chunk_size": 32768}


def traced_scalar_reads():
    """Trace ``tolist()`` / ``item()`` into the graph as unbacked ints instead of breaking it:
    the converted attention reads the step's lengths as ints (the operators take
    ``SymInt[]``), and the values change every step, so they must not become constants."""
    return torch._dynamo.config.patch(capture_scalar_outputs=True)


def is_uncapturable(exc: BaseException | None) -> bool:
    """Whether EXC (or what caused it) is dynamo refusing the step rather than the model failing:
    an unsupported construct, or a branch or size that depends on a tensor's values (e.g.
    ``if mask.sum():``, or an operator's ``int`` argument read from a tensor)."""
    refusals = (
        torch._dynamo.exc.Unsupported,
        torch._dynamo.exc.UserError,
        GuardOnDataDependentSymNode,
    )
    while exc is not None:
        if isinstance(exc, refusals):
            return True
        exc = exc.__cause__
    return False


def uncapturable_reason(exc: Exception) -> str:
    """One line: what dynamo could not capture, and the model code it was reading."""
    text = str(exc)
    what = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    where = re.findall(r'File "([^"]+)", line (\d+)', text)
    at = f" at {where[-1][0]}:{where[-1][1]}" if where else ""
    return (
        f"the decode step cannot be captured as one graph ({what}){at}; "
        "run without graph capture (--graph / graph=True)"
    )


@dataclass(slots=True)
class CaptureStats:
    """How the captured decode ran: buckets compiled, compile time, replays, eager fallbacks."""

    compiled_buckets: list[int] = field(default_factory=list)
    compile_s: float = 0.0
    num_replays: int = 0
    num_eager_decode_steps: int = 0
    #: why decode steps ran eagerly (None: none did, or only batches above the largest bucket)
    eager_reason: str | None = None

    def to_dict(self) -> dict:
        return {
            "compiled_buckets": list(self.compiled_buckets),
            "compile_s": self.compile_s,
            "num_replays": self.num_replays,
            "num_eager_decode_steps": self.num_eager_decode_steps,
            "eager_reason": self.eager_reason,
        }


class CapturedDecode:
    """Runs decode steps through a graph compiled once per bucket, then replayed."""

    def __init__(
        self,
        model: nn.Module,
        kv_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_model_len: int,
        backend: Any = None,
    ) -> None:
        self.model = model
        self.buckets = decode_buckets(max_num_seqs)
        self.table_widths = {
            key: -(-max_model_len // kv_manager.block_size_of(key)) for key in kv_manager.group_keys
        }
        self.stats = CaptureStats()
        backend = backend if backend is not None else _backend()
        self._compiled: Callable = torch.compile(
            self._forward,
            fullgraph=True,
            dynamic=False,
            backend=backend,
            options=INDUCTOR_OPTIONS if backend == "inductor" else None,
        )

    def bucket_for(self, batch: int) -> int | None:
        """The smallest bucket that holds BATCH requests, None when none does."""
        return next((b for b in self.buckets if b >= batch), None)

    def run_eagerly(self, reason: str) -> None:
        """Count a decode step the engine runs eagerly, and why."""
        self.stats.num_eager_decode_steps += 1
        self.stats.eager_reason = reason

    def __call__(self, inputs: StepInputs) -> Tensor | None:
        """Logits [B, vocab] (fp32) of a decode step, or None when it must run eagerly."""
        batch = inputs.input_ids.size(1)
        bucket = self.bucket_for(batch)
        padded = None if bucket is None else self._pad(inputs, bucket)
        if padded is None:
            self.run_eagerly(
                f"a batch of {batch} is above the largest bucket ({self.buckets[-1]})"
                if bucket is None
                else "a block table is wider than max_model_len needs"
            )
            return None
        first = bucket not in self.stats.compiled_buckets
        started = time.perf_counter()
        try:
            with torch.inference_mode(), traced_scalar_reads():
                logits = self._compiled(*padded)
        except Exception as exc:
            if not is_uncapturable(exc):
                raise
            raise UnsupportedModelError(uncapturable_reason(exc)) from None
        if first:
            self.stats.compiled_buckets.append(bucket)
            self.stats.compile_s += time.perf_counter() - started
        else:
            self.stats.num_replays += 1
        return logits[:batch].float()

    def _forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        logits_indices: Tensor,
        md: ForwardMetaData,
        num_live: Tensor,
    ) -> Tensor:
        # The list twins the framework fills for its captured decode, read once per step
        # here (traced ints) rather than once per layer from the tensors.
        md = replace(
            md,
            actual_seq_lengths_list_kv=md.actual_seq_lengths_kv.tolist(),
            actual_seq_lengths_cu_list_q=md.actual_seq_lengths_cu_q.tolist(),
            actual_seq_lengths_cu_list_kv=md.actual_seq_lengths_cu_kv.tolist(),
        )
        # the traced step: the layers read md through the slot dynamo can follow; the
        # live count (a traced int, like the lengths) lets the CPU fast paths skip the
        # padded rows' arithmetic
        live_rows = num_live.item()
        with captured_forward_context(md, live_rows=live_rows, padded_rows=input_ids.size(1)):
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=logits_indices,
            )
        return logits_of(out)[0]

    def _pad(self, inputs: StepInputs, bucket: int) -> tuple | None:
        """The step's inputs padded to BUCKET rows and the static table widths; None when a
        table is wider than its static width (a group this capture does not size)."""
        md = inputs.metadata
        batch = inputs.input_ids.size(1)
        extra = bucket - batch
        tables = {}
        for key, table in md.block_table.items():
            width = self.table_widths.get(key, table.size(1))
            if table.size(1) > width:
                return None
            tables[key] = torch.nn.functional.pad(table, (0, width - table.size(1), 0, extra))
        slots = {
            key: torch.nn.functional.pad(s, (0, extra), value=NULL_SLOT)
            for key, s in md.slot_mapping.items()
        }
        ones = md.actual_seq_lengths_q.new_ones(extra)
        kv = torch.cat((md.actual_seq_lengths_kv, ones))
        q = torch.cat((md.actual_seq_lengths_q, ones))
        padded_md = replace(
            md,
            kv_len=torch.cat((md.kv_len, ones - 1)),
            actual_seq_lengths_q=q,
            actual_seq_lengths_kv=kv,
            actual_seq_lengths_cu_q=torch.cumsum(q, 0),
            actual_seq_lengths_cu_kv=torch.cumsum(kv, 0),
            actual_seq_lengths_list_q=None,
            actual_seq_lengths_list_kv=None,
            actual_seq_lengths_cu_list_q=None,
            actual_seq_lengths_cu_list_kv=None,
            block_table=tables,
            slot_mapping=slots,
        )
        pad_tokens = (0, extra)
        return (
            torch.nn.functional.pad(inputs.input_ids, pad_tokens),
            torch.nn.functional.pad(inputs.position_ids, pad_tokens),
            torch.arange(bucket, device=inputs.input_ids.device),
            padded_md,
            torch.tensor(batch),
        )

"""The NPU profile: which hardware-only operator limits the reference enforces.

Some documented limits of the torch_npu operators hold only on hardware: the CPU reference
computes any shape and dtype. They fall in three kinds, switched separately:

* ``shapes``: what the runtime and the converted code choose: paged block sizes (prompts: a
  multiple of 128 in [128, 512]), ``block_table`` int32, 1..16 query tokens per request for
  absorbed MLA, T limits of packed queries. A correct conversion run with NPU-valid settings
  meets them at any model size, so ``kvskill verify`` and ``kvskill run`` (and ``LLM``) enforce
  them by default.
* ``dims``: head counts and head dims the device takes (16-aligned prompt head dims, MLA's
  32/64/128 query heads, the TND case's 192/128 dims, the chunk gated-delta kernel's 128).
  Enforced when the model runs at its real size; verify's shrunk twin shrinks heads and dims
  on purpose, so there the real config's dims are the analyzer's job (Plan warnings).
* ``dtypes``: fp16/bf16 only (fp32 is a CPU-only convenience), bf16 sinks, fp32 gate ``g``.
  Enforced when the run computes in fp16/bf16; an fp32 run is reported as not checked.

Every other documented constraint is always checked. Off is the default for direct operator
calls (CPU tests with tiny shapes); ``KVSKILL_NPU_LIMITS=1`` in the environment,
``set_npu_limits(True)`` or ``with npu_limits():`` turn every kind on, and an explicit strict
profile also wins over a run's opt-out (``--cpu-only-shapes``), which can only narrow what
the caller's context checks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from kvskill.core.errors import BadInputError
from kvskill.core.npu_limits import MAX_PAGED_BLOCK, PREFILL_BLOCK_MULTIPLE

_TRUE = ("1", "true", "yes", "on", "strict")
#: the one switch that turns the default NPU profile of verify / run / LLM off (tests use it)
CPU_ONLY_SHAPES_ENV = "KVSKILL_CPU_ONLY_SHAPES"
NPU_LIMITS_ENV = "KVSKILL_NPU_LIMITS"
#: where each limit is listed with its doc section
DOC = "references/npu_ops.md §9"


@dataclass(frozen=True, slots=True)
class NpuProfile:
    """Which kinds of hardware-only limits are enforced (see the module docstring)."""

    shapes: bool = False
    dims: bool = False
    dtypes: bool = False

    @property
    def any(self) -> bool:
        return self.shapes or self.dims or self.dtypes

    def union(self, other: NpuProfile) -> NpuProfile:
        return NpuProfile(
            shapes=self.shapes or other.shapes,
            dims=self.dims or other.dims,
            dtypes=self.dtypes or other.dtypes,
        )


OFF = NpuProfile()
STRICT = NpuProfile(shapes=True, dims=True, dtypes=True)
#: compute dtypes the NPU's attention takes (names as in ``--dtype``)
NPU_DTYPE_NAMES = ("float16", "bfloat16")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


_PROFILE: ContextVar[NpuProfile] = ContextVar(
    "kvskill_npu_profile", default=STRICT if _env_true(NPU_LIMITS_ENV) else OFF
)


def current_profile() -> NpuProfile:
    """The profile the reference operators check against right now."""
    return _PROFILE.get()


def npu_limits_enabled() -> bool:
    """True while some hardware-only operator limit is enforced."""
    return _PROFILE.get().any


def set_npu_limits(enabled: bool) -> None:
    """Turn every hardware-only limit on (or off) for the current context."""
    _PROFILE.set(STRICT if enabled else OFF)


@contextmanager
def use_npu_profile(profile: NpuProfile) -> Iterator[None]:
    """Check against PROFILE inside the block."""
    token = _PROFILE.set(profile)
    try:
        yield
    finally:
        _PROFILE.reset(token)


@contextmanager
def npu_limits(enabled: bool = True) -> Iterator[None]:
    """Enforce every (or, with ``enabled=False``, no) hardware-only limit inside the block."""
    with use_npu_profile(STRICT if enabled else OFF):
        yield


def cpu_only_shapes_from_env() -> bool:
    """The default of ``--cpu-only-shapes`` / ``cpu_only_shapes=None``: KVSKILL_CPU_ONLY_SHAPES."""
    return _env_true(CPU_ONLY_SHAPES_ENV)


def run_profile(*, cpu_only_shapes: bool | None, dtype: str, real_dims: bool) -> NpuProfile:
    """The profile of a run (verify, ``kvskill run``, ``LLM``): shapes always, head dims when
    the model runs at its real size, dtypes when it computes in fp16/bf16; nothing with the
    opt-out. The caller's context (``KVSKILL_NPU_LIMITS=1``, ``npu_limits()``) is kept on top.

    Args:
        cpu_only_shapes: the opt-out; None reads KVSKILL_CPU_ONLY_SHAPES.
        dtype: the compute dtype's name ("float32", "float16", "bfloat16").
        real_dims: the model has its real head counts and dims (not a shrunk twin).
    """
    if cpu_only_shapes is None:
        cpu_only_shapes = cpu_only_shapes_from_env()
    own = (
        OFF
        if cpu_only_shapes
        else NpuProfile(shapes=True, dims=real_dims, dtypes=dtype in NPU_DTYPE_NAMES)
    )
    return own.union(current_profile())


#: what each kind covers, for reports
KIND_TEXT = {
    "shapes": "block sizes, block tables and per-request query lengths",
    "dims": "head counts and head dims",
    "dtypes": "dtypes (float16/bfloat16 only)",
}


def profile_report(profile: NpuProfile, *, dtype: str, twin: bool) -> dict:
    """What a run was checked against: ``checked`` (the NPU shape limits were enforced), the
    kinds enforced, and one line per kind that was not, saying why.

    Args:
        dtype: the run's compute dtype name.
        twin: the model is verify's shrunk twin (its head counts and dims are not the model's).
    """
    if not profile.any:
        return {
            "checked": False,
            "profile": "cpu-only-shapes",
            "checked_kinds": [],
            "not_checked": [
                "the conversion was NOT checked against the NPU operators' limits "
                "(--cpu-only-shapes): block sizes, head dims and dtypes the device refuses run "
                f"on the CPU reference ({DOC})"
            ],
            "doc": DOC,
        }
    reasons = {
        "shapes": "block sizes and block tables (KVSKILL_NPU_LIMITS / npu_limits() narrowed)",
        "dims": (
            "head counts and head dims on the operator calls: the shrunk twin's are not the "
            "model's (the model's own config was checked by kvskill analyze: its Plan's "
            "'operator limit' warnings, listed as model_limits)"
            if twin
            else "head counts and head dims"
        ),
        "dtypes": (
            f"dtypes: {dtype} is a CPU-only convenience; the NPU operators take float16/"
            "bfloat16 (--dtype bfloat16 checks them)"
        ),
    }
    kinds = [k for k in KIND_TEXT if getattr(profile, k)]
    return {
        "checked": profile.shapes,
        "profile": "strict" if profile == STRICT else "npu",
        "checked_kinds": kinds,
        "not_checked": [reasons[k] for k in KIND_TEXT if k not in kinds],
        "doc": DOC,
    }


def profile_line(report: dict) -> str:
    """One line of a text report for ``profile_report``'s dict."""
    if not report["checked_kinds"]:
        return f"NPU limits: {report['not_checked'][0]}"
    checked = ", ".join(KIND_TEXT[k] for k in report["checked_kinds"])
    line = f"NPU limits: checked ({checked}; {report['doc']})"
    if report["not_checked"]:
        line += "; NOT checked: " + "; ".join(report["not_checked"])
    return line


#: the block size verify and run use under the NPU profile: the one size every paged case
#: takes (prompts: multiples of 128 up to 512; absorbed MLA's NZ cache: exactly 128)
NPU_BLOCK_SIZE = PREFILL_BLOCK_MULTIPLE


def npu_block_size_error(block_size: int) -> str | None:
    """Why the NPU refuses paged attention with BLOCK_SIZE tokens per block, or None."""
    step = PREFILL_BLOCK_MULTIPLE
    if block_size % step == 0 and step <= block_size <= MAX_PAGED_BLOCK:
        return None
    return (
        f"block size {block_size} is not an NPU block size: paged attention over a prompt takes "
        f"a multiple of {step} in [{step}, {MAX_PAGED_BLOCK}] (torch_npu 2.13.0 FA docs, "
        f"约束说明 › 当Q_S大于1时 › page attention场景; {DOC}); use --block-size {step}, or "
        "--cpu-only-shapes (LLM(cpu_only_shapes=True)) for CPU-only shapes, which leaves the "
        "conversion unchecked against the NPU limits"
    )


def check_run_block_size(block_size: int) -> None:
    """BadInputError (exit 2) when the NPU profile is on and BLOCK_SIZE is not an NPU size."""
    error = npu_block_size_error(block_size)
    if error is not None:
        raise BadInputError(error)

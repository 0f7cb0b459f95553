"""torch_npu operators the reference refuses by name instead of emulating.

Three groups, each with one reason:

- quantized (int8 / fp8 / hifloat8 / mx): their numerics depend on device rounding and scale
  formats the reference does not model, and emulating them silently would make a CPU run look
  like proof of a quantized model. Run an unquantized (bf16/fp32) config instead.
- collective: they communicate over HCCL between NPUs; a CPU run uses tensor/expert parallel
  size 1, where the framework takes the single-rank path. (The expert-parallel dispatch /
  combine pair is modelled at one rank, ``moe_distribute.py``, and refuses any other size.)
- unmodelled: real unquantized operators the framework's DSA models (glm_5_2) call, not written
  yet (the indexer and the sparse attention themselves are modelled: lightning_indexer.py,
  sparse_flash_attention.py).

``refusing_operator(name)`` gives a callable that raises ``RefusedOperatorError`` with a
one-line message, so ``torch_npu.npu_quant_matmul`` resolves (and ``hasattr`` is true, as on
the device) but any call says why it cannot run here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from ._checks import ReferenceUnsupportedError

QUANTIZED = "quantized operator (int8/fp8/hifloat8/mx); the CPU reference refuses quantized " \
    "paths instead of emulating them; run an unquantized bf16/fp32 config"  # fmt: skip
COLLECTIVE = "collective operator (HCCL between NPUs); run with tensor and expert parallel size 1"
UNMODELLED = "not modelled by the CPU reference yet"

#: operator name -> reason
REFUSED_OPERATORS: dict[str, str] = {
    **dict.fromkeys(
        (
            "npu_quant_matmul",
            "npu_dynamic_quant",
            "npu_dynamic_mx_quant",
            "npu_dynamic_block_quant",
            "npu_quantize",
            "npu_dtype_cast",
            "npu_trans_quant_param",
            "npu_convert_weight_to_int4pack",
            "npu_weight_quant_batchmatmul",
            "npu_swiglu_mx_quant",
            "npu_swiglu_clip_quant",
            "npu_dequant_swiglu_quant",
            "npu_dequant_swiglu_clamp_quant",
            "npu_rms_norm_dynamic_mx_quant",
            "npu_add_rms_norm_dynamic_mx_quant",
            "npu_add_rms_norm_quant",
            "npu_quant_lightning_indexer",
            "npu_kv_quant_sparse_flash_attention",
        ),
        QUANTIZED,
    ),
    **dict.fromkeys(
        ("npu_mm_all_reduce_base",),
        COLLECTIVE,
    ),
    **dict.fromkeys(
        (
            "npu_mla_prolog_v3",
            "npu_gather_selection_kv_cache",
            "npu_moe_gating_top_k",
            "npu_fusion_attention",
            "empty_with_swapped_memory",
        ),
        UNMODELLED,
    ),
}

#: torch_npu dtype attributes with no torch equivalent (torch's own float8/float4 dtypes are
#: returned for the names torch shares, so dtype comparisons in unquantized code still work)
REFUSED_DTYPES: dict[str, str] = {"hifloat8": QUANTIZED}


class RefusedOperatorError(ReferenceUnsupportedError):
    """A torch_npu operator or dtype the reference refuses by name (see the module docstring)."""


def refuse(name: str, reason: str) -> NoReturn:
    raise RefusedOperatorError(f"torch_npu.{name}: {reason}")


def refusing_operator(name: str) -> Callable[..., Any] | None:
    """A callable that refuses ``name``, or None when ``name`` is not refused."""
    reason = REFUSED_OPERATORS.get(name)
    if reason is None:
        return None

    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        refuse(name, reason)

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"Refused on the CPU reference: {reason}."
    return refused

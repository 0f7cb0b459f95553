"""Framework-mode Legacy output: ``cache_unit`` caches in static rows, the model's own math.

Seed 003 keeps Legacy for models the fused operator cannot serve (logit soft-capping, chunked
attention): each attention declares its caches under attn_type "Legacy", the runtime gives
every request one static row of ``max_model_len`` positions per cache (``[rows,
max_model_len, num_head, dim]``), and the layer writes this step's keys and values at
``row * max_model_len + position`` (the positions ``scatter_update_`` at ``kv_len`` would
address) and then calls the source's own attention function over its rows, with a mask built
from the step's lengths, the layer's window and its chunk (``runtime/legacy_attention.py``).

Only the seam changes: the cache update becomes the write and the read of the rows, the
source's kernel call stays as written (so soft-capping, scaling and dropout stay the
model's), and its output is packed back to the step's tokens.
"""

from __future__ import annotations

from pathlib import Path

from kvskill.analyzer import Plan
from kvskill.analyzer.plan import KvMode
from kvskill.implementer.convert import ApplyOptions, Conversion, read_source, source_package
from kvskill.implementer.legacy_codemods import legacy_spec
from kvskill.implementer.pipeline import convert
from kvskill.implementer.registry import ConversionPath


def convert_framework_legacy(plan: Plan, options: ApplyOptions) -> Conversion:
    """Convert a Legacy Plan's modeling file (``--kv-mode legacy``, or auto on a Legacy Plan).

    Raises:
        UnsupportedModelError: the model needs something the Legacy rewrite does not write.
    """
    assert options.kv_mode == "legacy" or plan.kv_mode is KvMode.LEGACY
    spec = legacy_spec(plan, options.block_size)
    modeling_file = Path(plan.source.modeling_file)
    original = read_source(modeling_file)
    converted = convert(
        original,
        spec,
        ConversionPath.LEGACY,
        package=source_package(plan),
        filename=modeling_file.name,
    )
    return Conversion(plan=plan, original=original, converted=converted)


__all__ = ["convert_framework_legacy"]

"""Why a file that writes cache rows with ``scatter_update_`` is refused when its attention is
none of the Legacy shapes the tool converts.

The framework's Legacy models write their caches with ``torch_npu.scatter_update_`` into rows
allocated ahead of time. Three of their shapes convert (``analyzer/gather.py``): GQA attention
over the executor's ``cache_unit`` rows, GQA attention over rows the model's own ``init_cache``
allocates, and its MLA form (latent and rope rows one method writes and reads with one fused
attention). Others exist at the pinned framework commit: ``models/glm_5_2`` writes MLA latent
caches (``npu_mla_prolog_v3`` and ``scatter_update_``) and attends with
``npu_sparse_flash_attention`` over the top-k of an indexer that keeps a cache of its own. Such
a file has no attention class of a shape the tool reads, and saying only that would be false:
the refusal names the class, its row writes and the operators that make it another kind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.scan import ModuleFacts
from kvskill.core.inputs import read_source

_TORCH_NPU_CALL = m.Call(func=m.Attribute(value=m.Name("torch_npu")))
#: operators that make the attention sparse: a top-k selection with its own indexer cache
_SPARSE_OPS = ("npu_sparse_flash_attention", "npu_lightning_indexer", "npu_nsa_")
#: operators that build or write MLA latent caches
_MLA_OPS = ("npu_mla_prolog", "npu_kv_rmsnorm_rope_cache")


def _torch_npu_ops(cls: cst.ClassDef) -> list[str]:
    """The ``torch_npu.<op>`` names CLS calls, in first-call order."""
    found: dict[str, None] = {}
    for node in m.findall(cls, _TORCH_NPU_CALL):
        func = cst.ensure_type(cst.ensure_type(node, cst.Call).func, cst.Attribute)
        found.setdefault(func.attr.value, None)
    return list(found)


def _kinds(ops: list[str], config: dict[str, Any]) -> list[str]:
    """What makes the attention another kind than the converted Legacy GQA, as phrases."""
    kinds = []
    mla = [op for op in ops if op.startswith(_MLA_OPS)]
    if mla or config.get("kv_lora_rank"):
        via = f" ({', '.join(mla)})" if mla else ""
        kinds.append(f"MLA latent caches{via}")
    sparse = [op for op in ops if op.startswith(_SPARSE_OPS)]
    if sparse:
        kinds.append(
            f"sparse attention over an indexer's top-k ({', '.join(sparse)}; the indexer "
            "keeps a cache of its own)"
        )
    quant = [op for op in ops if "quant" in op]
    if quant:
        kinds.append(f"quantized paths ({', '.join(quant)})")
    return kinds


def legacy_rows_reason(facts: ModuleFacts, config: dict[str, Any]) -> str | None:
    """The one-line refusal for a file whose class writes cache rows with ``scatter_update_``
    but is not a converted Legacy shape, else None."""
    writers = [
        cls
        for cls in facts.classes.values()
        if any(call.callee == "scatter_update_" for call in cls.calls)
    ]
    if not writers:
        return None
    writer = writers[0]
    lines = [call.line for call in writer.calls if call.callee == "scatter_update_"]
    tree = cst.parse_module(read_source(Path(facts.path)))
    node = next(
        (c for c in tree.body if isinstance(c, cst.ClassDef) and c.name.value == writer.name),
        None,
    )
    kinds = _kinds(_torch_npu_ops(node) if node is not None else [], config)
    what = "; ".join(kinds) if kinds else "no fused-attention call beside its row writes"
    return (
        f"{facts.file_name}: cannot convert: {writer.name} (line {writer.line}) writes cache "
        f"rows with torch_npu.scatter_update_ (line{'s' if len(lines) > 1 else ''} "
        f"{', '.join(map(str, lines))}) but is not a Legacy shape the tool converts: {what}; "
        "the framework's Legacy GQA attention (cache_unit rows, or init_cache rows read by "
        "npu_fused_infer_attention_score) converts, and so does standalone Legacy MLA whose "
        "latent and rope rows one method writes with scatter_update_ and reads with one "
        "npu_fused_infer_attention_score; MLA written by npu_mla_prolog_v3 and sparse "
        "attention do not yet"
    )


__all__ = ["legacy_rows_reason"]

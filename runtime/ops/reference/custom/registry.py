"""``torch.ops.custom.<name>``: the framework's custom operators on the reference math.

cann-recipes-infer's DeepSeek-V4 calls these through the dispatcher (``torch.ops.custom.X``,
registered on the device by its ``custom_ops`` extension, ``ops_def_registration.cpp``). The
stand-in (``npu_standin``) registers the reference implementations under the same namespace
with the extension's schema strings (recorded in ``tests/fixtures/custom_schemas.json``), so
argument names, order, defaults and the in-place ``Tensor(a!)`` of each call bind as on the
device, and a fake implementation per operator gives output shapes for graph capture without
running the math. A ``torch.library`` definition lasts for the process: the first stand-in
registers them and later ones reuse them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .compressor import compressor, compressor_fake
from .qli_metadata import npu_quant_lightning_indexer_metadata
from .quant_lightning_indexer import npu_quant_lightning_indexer
from .sas_metadata import npu_sparse_attn_sharedkv_metadata
from .sparse_attn_sharedkv import npu_sparse_attn_sharedkv

NAMESPACE = "custom"

#: name -> the schema as the extension defines it
SCHEMAS: dict[str, str] = {
    "npu_sparse_attn_sharedkv": (
        "npu_sparse_attn_sharedkv(Tensor q, *, Tensor? ori_kv=None, Tensor? cmp_kv=None, "
        "Tensor? ori_sparse_indices=None, Tensor? cmp_sparse_indices=None, "
        "Tensor? ori_block_table=None, Tensor? cmp_block_table=None, Tensor? cu_seqlens_q=None, "
        "Tensor? cu_seqlens_ori_kv=None, Tensor? cu_seqlens_cmp_kv=None, Tensor? seqused_q=None, "
        "Tensor? seqused_kv=None, Tensor? sinks=None, Tensor? metadata=None, "
        "float softmax_scale=0, int cmp_ratio=0, int ori_mask_mode=4, int cmp_mask_mode=3, "
        "int ori_win_left=127, int ori_win_right=0, str layout_q='BSND', str layout_kv='PA_ND', "
        "bool return_softmax_lse=False) -> (Tensor, Tensor)"
    ),
    "npu_sparse_attn_sharedkv_metadata": (
        "npu_sparse_attn_sharedkv_metadata(int num_heads_q, int num_heads_kv, int head_dim, *, "
        "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, "
        "Tensor? cu_seqlens_cmp_kv=None, Tensor? seqused_q=None, Tensor? seqused_kv=None, "
        "int batch_size=0, int max_seqlen_q=0, int max_seqlen_kv=0, int ori_topk=0, "
        "int cmp_topk=0, int cmp_ratio=-1, int ori_mask_mode=4, int cmp_mask_mode=3, "
        "int ori_win_left=127, int ori_win_right=0, str layout_q='BSND', str layout_kv='PA_ND', "
        "bool has_ori_kv=True, bool has_cmp_kv=True, str device='npu:0') -> Tensor"
    ),
    "compressor": (
        "compressor(Tensor x, Tensor wkv, Tensor wgate, Tensor(a!) state_cache, Tensor ape, "
        "Tensor norm_weight, Tensor rope_sin, Tensor rope_cos, int rope_head_dim, int cmp_ratio, "
        "*, Tensor? state_block_table=None, Tensor? cu_seqlens=None, Tensor? seqused=None, "
        "Tensor? start_pos=None, int coff=1, float norm_eps=1e-6, int rotary_mode=1, "
        "int cache_mode=1) -> Tensor"
    ),
    "npu_quant_lightning_indexer": (
        "npu_quant_lightning_indexer(Tensor query, Tensor key, Tensor weights, "
        "Tensor query_dequant_scale, Tensor key_dequant_scale, int query_quant_mode, "
        "int key_quant_mode, *, Tensor? actual_seq_lengths_query=None, "
        "Tensor? actual_seq_lengths_key=None, Tensor? block_table=None, Tensor? metadata=None, "
        "str layout_query='BSND', str layout_key='PA_BSND', int sparse_count=2048, "
        "int sparse_mode=3, int pre_tokens=9223372036854775807, "
        "int next_tokens=9223372036854775807, int cmp_ratio=1, bool return_value=False, "
        "int? query_dtype=None, int? key_dtype=None) -> (Tensor, Tensor)"
    ),
    "npu_quant_lightning_indexer_metadata": (
        "npu_quant_lightning_indexer_metadata(int num_heads_q, int num_heads_k, int head_dim, "
        "int query_quant_mode, int key_quant_mode, *, Tensor? actual_seq_lengths_query=None, "
        "Tensor? actual_seq_lengths_key=None, int batch_size=0, int max_seqlen_q=0, "
        "int max_seqlen_k=0, str layout_query='BSND', str layout_key='BSND', "
        "int sparse_count=2048, int sparse_mode=3, int pre_tokens=9223372036854775807, "
        "int next_tokens=9223372036854775807, int cmp_ratio=1, str device='npu:0') -> Tensor"
    ),
}


def _sas_fake(q: torch.Tensor, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty((0,), dtype=torch.float32)


def _metadata_fake(*_: Any, **kw: Any) -> torch.Tensor:
    given = [kw.get(name) for name in ("cu_seqlens_q", "seqused_kv", "actual_seq_lengths_key",
                                       "actual_seq_lengths_query")]  # fmt: skip
    device = next((t.device for t in given if t is not None), None)
    return torch.empty(1024, dtype=torch.int32, device=device)


def _indexer_fake(query: torch.Tensor, *_: Any, sparse_count: int = 2048, **__: Any):
    shape = (*query.shape[:-2], 1, sparse_count)
    return query.new_empty(shape, dtype=torch.int32), query.new_empty((0,), dtype=torch.float32)


OPERATORS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "npu_sparse_attn_sharedkv": (npu_sparse_attn_sharedkv, _sas_fake),
    "npu_sparse_attn_sharedkv_metadata": (npu_sparse_attn_sharedkv_metadata, _metadata_fake),
    "compressor": (compressor, compressor_fake),
    "npu_quant_lightning_indexer": (npu_quant_lightning_indexer, _indexer_fake),
    "npu_quant_lightning_indexer_metadata": (npu_quant_lightning_indexer_metadata, _metadata_fake),
}

_library: list[torch.library.Library] = []


def register_custom_operators() -> None:
    """Define ``torch.ops.custom.<name>`` for every operator above (once per process)."""
    if _library:
        return
    if hasattr(torch.ops, NAMESPACE) and any(
        hasattr(getattr(torch.ops, NAMESPACE), name) for name in OPERATORS
    ):
        raise RuntimeError(
            "torch.ops.custom already defines the framework's operators (its custom_ops "
            "extension is loaded); the stand-in must not shadow them"
        )
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    for name, (impl, fake) in OPERATORS.items():
        lib.define(SCHEMAS[name])
        lib.impl(name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
    _library.append(lib)

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
}


def _sas_fake(q: torch.Tensor, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty((0,), dtype=torch.float32)


def _metadata_fake(num_heads_q: int, num_heads_kv: int, head_dim: int, **kw: Any) -> torch.Tensor:
    where = kw.get("cu_seqlens_q")
    where = where if where is not None else kw.get("seqused_kv")
    device = where.device if where is not None else None
    return torch.empty(1024, dtype=torch.int32, device=device)


OPERATORS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "npu_sparse_attn_sharedkv": (npu_sparse_attn_sharedkv, _sas_fake),
    "npu_sparse_attn_sharedkv_metadata": (npu_sparse_attn_sharedkv_metadata, _metadata_fake),
    "compressor": (compressor, compressor_fake),
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

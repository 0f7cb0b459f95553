"""The framework's own custom operators that DeepSeek-V4 runs on (``torch.ops.custom``).

cann-recipes-infer ``fbc225d`` ships them in ``ops/ascendc`` (docs in ``ops/ascendc/docs``,
schemas in ``torch_ops_extension/custom_ops/csrc/ops_def_registration.cpp``); none is in the
torch_npu 2.13.0 wheel. What an unquantized (fp32 / bf16) paged conversion of transformers'
DeepSeek-V4 needs, and what is quantization-only:

Needed, with reference implementations here:

* ``npu_sparse_attn_sharedkv`` (custom-npu_sparse_attn_sharedkv.md:22, scenarios :84): one
  softmax over the sliding window of the paged ``win_kv`` cache and the paged compressed cache,
  K = V, sinks; every layer kind (sliding, CSA ratio 4 with top-k indices, HCA ratio 128).
* ``npu_sparse_attn_sharedkv_metadata`` (custom-npu_sparse_attn_sharedkv_metadata.md:337): the
  per-core plan the attention requires (custom-npu_sparse_attn_sharedkv.md:55).
* ``compressor`` (custom-npu_compressor.md:48, cases :141-144): pools every ``cmp_ratio``
  tokens into one entry (softmax-gated, position bias ``ape``, RMSNorm, RoPE on the trailing
  ``rope_head_dim``), overlapping windows for CSA (``coff`` 2), keeping the unfinished window in
  a paged fp32 state cache; both the attention's (D 512) and the CSA indexer's (D 128) keys.

Needed but quantization-only in this checkout (no reference here):

* ``npu_quant_lightning_indexer`` (custom-npu_quant_lightning_indexer.md:22) and its
  ``_metadata`` (custom-npu_quant_lightning_indexer_metadata.md:20): the only indexer with
  ``cmp_ratio`` (:66), but its query and key are int8 with fp16 dequant scales (:30-38); the
  framework quantizes the indexer's query (``modules/indexer.py:203``) and its compressed keys
  (``modules/compressor.py:246``). transformers' indexer scores in fp32 without quantization,
  so an unquantized conversion has no device operator for CSA's top-k: the wheel's
  ``npu_lightning_indexer`` (reference in ``../lightning_indexer.py``) takes no ``cmp_ratio``.

Quantization-only, not needed:

* ``kv_compress_epilog`` (custom-npu_kv_compress_epilog.md:11-16, float8 cache, Ascend 950) and
  ``indexer_compress_epilog`` (custom-npu_indexer_compress_epilog.md:75, float8 / int8 cache):
  quantize-and-scatter of the compressed rows; unquantized, the framework writes them with
  ``scatter_nd_update_asc`` (``modules/compressor.py:251, :270``), the wheel's
  ``npu_scatter_nd_update_``. Likewise ``quant_compressor`` and
  ``npu_kv_quant_sparse_attn_sharedkv`` (``modeling_deepseek.py:822``).

``register_custom_operators()`` (``registry.py``) puts the references under
``torch.ops.custom``; ``npu_standin`` calls it.
"""

from __future__ import annotations

from .compressor import compressor
from .registry import SCHEMAS, register_custom_operators
from .sas_metadata import npu_sparse_attn_sharedkv_metadata
from .sparse_attn_sharedkv import npu_sparse_attn_sharedkv

__all__ = [
    "SCHEMAS",
    "compressor",
    "npu_sparse_attn_sharedkv",
    "npu_sparse_attn_sharedkv_metadata",
    "register_custom_operators",
]

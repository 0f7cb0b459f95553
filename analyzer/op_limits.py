"""The fused attention's documented limits that this model's shapes hit, before anything is written.

Two kinds (the facts live in ``core/npu_limits.py``, which the reference operators enforce too):

* **blockers**: limits the CPU reference refuses as well, so ``verify`` and ``run`` would fail
  on the converted code; ``apply`` refuses instead (exit 3, the limit named).
* **warnings**: limits only the device (the NPU profile of run and verify) refuses, such as head counts
  and head dims the shrunk verify model steps around, block sizes and dtypes. The conversion is
  written, and the user learns before deploying what the NPU will refuse.

Each message names the doc section of torch_npu 2.13.0's ``_op_plugin_docs.py`` it comes from
(references/npu_ops.md §9).
"""

from __future__ import annotations

from dataclasses import replace

from kvskill.analyzer.config import ModelSpec
from kvskill.analyzer.evidence import Notebook
from kvskill.analyzer.indexer import reads_sparsely
from kvskill.analyzer.layer_mla import MlaGroup
from kvskill.core import npu_limits as lim

_DOC = "torch_npu 2.13.0 FA docs, 约束说明"
_ON_NPU = (
    "the NPU refuses this call (the CPU reference runs it with --cpu-only-shapes; kvskill run "
    "checks it by default)"
)


def add_operator_limits(
    *,
    spec: ModelSpec,
    book: Notebook,
    attention: str,
    fa_version: str,
    has_sinks: bool,
    kv_heads_per_rank: int,
    attn_tp_size: int,
    block_size: int,
    keeps_absorbed_prefill: bool = False,
    mla_groups: list[MlaGroup] | None = None,
) -> None:
    """Blockers and warnings for every operator limit the model's shapes hit.

    KEEPS_ABSORBED_PREFILL: the conversion keeps the model's own absorbed MLA call for prefill
    (the framework's standalone Legacy MLA, ND block caches): no un-absorbed prefill and no
    NZ cache, so their limits do not apply. MLA_GROUPS: MLA layers that differ in dims, heads
    or indexer use (``analyzer.layer_mla``); each group is checked with its own values and its
    messages name its layers.
    """
    if attention == "mla" and mla_groups and len(mla_groups) > 1:
        for group in mla_groups:
            _mla_group(
                spec, group, _LayerBook(book, group.label), fa_version, attn_tp_size, block_size
            )
        return
    heads = max(spec.num_heads // attn_tp_size, 1)
    if heads > lim.MAX_HEADS:
        _block(book, f"{heads} query heads per rank exceed {lim.MAX_HEADS} (› N轴小于等于256)")
    if attention == "mla" and reads_sparsely(spec):
        _dsa(spec, book, heads, block_size)
        return
    if attention == "mla":
        _mla(spec, book, fa_version, heads, block_size, keeps_absorbed_prefill)
        return
    if max(spec.head_dim, spec.v_head_dim) > lim.MAX_HEAD_DIM:
        _block(
            book,
            f"head dim {max(spec.head_dim, spec.v_head_dim)} exceeds {lim.MAX_HEAD_DIM} "
            "(› 支持D轴小于等于512)",
        )
    hidden = kv_heads_per_rank * max(spec.head_dim, spec.v_head_dim)
    if hidden > lim.MAX_HIDDEN:
        # the converted code passes the paged cache as (blocknum, blocksize, KV_N * D)
        _block(
            book,
            f"the paged cache (blocknum, blocksize, H) has H = KV_N * D = {hidden} > "
            f"{lim.MAX_HIDDEN} (› page attention场景: KV_N*D超过65535时...会被拦截报错)",
        )
    if has_sinks and spec.v_head_dim not in lim.SINK_VALUE_DIMS:
        _block(
            book,
            f"learnable sinks need a value head dim in {lim.SINK_VALUE_DIMS}, got "
            f"{spec.v_head_dim} (v2 › learnable_sink的参数约束: 仅支持value的d小于等于128; the "
            "reference keeps 64 or 128)",
        )
    if spec.head_dim % lim.PROMPT_HEAD_DIM_MULTIPLE:
        _warn(
            book,
            f"head dim {spec.head_dim} is not a multiple of {lim.PROMPT_HEAD_DIM_MULTIPLE}: "
            f"{_ON_NPU} for every prompt (› 当Q_S大于1时: D轴需16对齐)",
        )
    _paged_block_size(book, block_size)


class _LayerBook:
    """The notebook, with each operator-limit message naming the layers it concerns."""

    def __init__(self, book: Notebook, label: str) -> None:
        self._book = book
        self._label = label

    def _named(self, text: str) -> str:
        return text.replace("operator limit: ", f"operator limit: {self._label}: ", 1)

    def warn(self, text: str) -> None:
        self._book.warn(self._named(text))

    def block(self, text: str) -> None:
        self._book.block(self._named(text))


def _mla_group(
    spec: ModelSpec,
    group: MlaGroup,
    book: _LayerBook,
    fa_version: str,
    attn_tp_size: int,
    block_size: int,
) -> None:
    """One group's limits: the DSA pair for indexed layers, the MLA attention otherwise, and
    for sliding layers the absorbed band case too."""
    own = replace(spec, mla=dict(group.dims), num_heads=group.num_heads)
    heads = max(group.num_heads // attn_tp_size, 1)
    if heads > lim.MAX_HEADS:
        _block(book, f"{heads} query heads per rank exceed {lim.MAX_HEADS} (› N轴小于等于256)")
    if group.indexed:
        _dsa(own, book, heads, block_size)
        return
    _mla(own, book, fa_version, heads, block_size, keeps_absorbed_prefill=False)
    if group.sliding_window is not None:
        _mla_band(own, book, heads)


def _mla_band(spec: ModelSpec, book: Notebook | _LayerBook, heads: int) -> None:
    """A window on the absorbed latent: v1 › query_rope和key_rope参数约束 › sparse为4时 takes
    query N 128, D 512 (key N 1, D 512), BSND only, an ND cache (no NZ), block_size 64/128."""
    rank = int((spec.mla or {}).get("kv_lora_rank") or 0)
    if rank != lim.MLA_LATENT_DIM:
        _block(
            book,
            f"a sliding window on the absorbed {rank}-wide latent: the band case (sparse_mode 4) "
            f"takes D {lim.MLA_LATENT_DIM} only (v1 › query_rope和key_rope参数约束 › sparse为4时)",
        )
    if heads != lim.MLA_BAND_HEADS:
        _warn(
            book,
            f"a sliding window on the absorbed latent with {heads} query heads per rank: "
            f"{_ON_NPU}; the band case (sparse_mode 4) takes N {lim.MLA_BAND_HEADS}, BSND, an "
            "ND cache (v1 › query_rope和key_rope参数约束 › sparse为4时)",
        )


def _dsa(spec: ModelSpec, book: Notebook | _LayerBook, heads: int, block_size: int) -> None:
    """The DSA pair's limits (kernel docs, 约束说明, Atlas A2/A3): the sparse attention over the
    absorbed 512 latent, the indexer over its 128-wide keys."""
    mla = spec.mla or {}
    indexer = spec.indexer or {}
    rope = int(mla.get("qk_rope_head_dim") or 0)
    rank = int(mla.get("kv_lora_rank") or 0)
    # a rope-less latent (rope 0) takes zero query_rope / key_rope of the operator's width
    # (zeros add nothing to q.k), as the NoPE layers of a roped model are converted
    if rope not in (0, lim.MLA_ROPE_DIM) or rank != lim.SFA_LATENT_DIM:
        _block(
            book,
            f"DSA latent {rank} with rope {rope}: npu_sparse_flash_attention takes the "
            f"{lim.SFA_LATENT_DIM} latent with rope {lim.MLA_ROPE_DIM} only (› Q_D和key、value的"
            "KV_D值相等为512, Dr值相等为64)",
        )
    if heads not in lim.SFA_QUERY_HEADS:
        _warn(
            book,
            f"DSA attention with {heads} query heads per rank: {_ON_NPU}; "
            f"npu_sparse_flash_attention takes {lim.SFA_QUERY_HEADS} (› Q_N支持1/2/4/8/16/32/64/128)",
        )
    index_heads, index_dim = int(indexer.get("n_heads") or 0), int(indexer.get("head_dim") or 0)
    if index_dim != lim.INDEXER_HEAD_DIM or index_heads > lim.INDEXER_MAX_QUERY_HEADS:
        _block(
            book,
            f"DSA indexer with {index_heads} heads of {index_dim}: npu_lightning_indexer takes "
            f"head dim {lim.INDEXER_HEAD_DIM} and at most {lim.INDEXER_MAX_QUERY_HEADS} query "
            "heads (› headdim支持128, query Q_N支持小于等于64)",
        )
    if block_size % lim.SPARSE_BLOCK_MULTIPLE or block_size > lim.SPARSE_MAX_BLOCK_SIZE:
        _warn(
            book,
            f"block_size {block_size}: {_ON_NPU}; the DSA operators page in multiples of "
            f"{lim.SPARSE_BLOCK_MULTIPLE} up to {lim.SPARSE_MAX_BLOCK_SIZE} (› block_size取值为16的"
            "倍数，最大支持1024)",
        )
    pool = int(indexer.get("kpool") or 1)
    rows = block_size // pool
    if pool > 1 and (block_size % pool or rows % lim.SPARSE_BLOCK_MULTIPLE):
        # the pooled keys are a compressed entry: a block of block_size tokens holds one row
        # per pool, and the indexer pages those rows
        fit = next(b for b in range(128, 8193, 128) if (b // pool) % lim.SPARSE_BLOCK_MULTIPLE == 0)
        _warn(
            book,
            f"block_size {block_size} with pools of {pool}: the pooled keys' cache holds "
            f"{block_size / pool:g} rows per block; {_ON_NPU}; npu_lightning_indexer pages them "
            f"in multiples of {lim.SPARSE_BLOCK_MULTIPLE} (› block_size取值为16的倍数): run with "
            f"--block-size {fit} (a multiple of {fit})",
        )


def _mla(
    spec: ModelSpec,
    book: Notebook | _LayerBook,
    fa_version: str,
    heads: int,
    block_size: int,
    keeps_absorbed_prefill: bool,
) -> None:
    mla = spec.mla or {}
    rope = int(mla.get("qk_rope_head_dim") or 0)
    rank = int(mla.get("kv_lora_rank") or 0)
    nope = int(mla.get("qk_nope_head_dim") or 0)
    value = int(mla.get("v_head_dim") or spec.v_head_dim or 0)
    if rope != lim.MLA_ROPE_DIM:
        _block(
            book,
            f"MLA rope head dim is {rope}; the fused operator's rope split requires "
            f"{lim.MLA_ROPE_DIM} (› query_rope和key_rope参数约束: D为64)",
        )
    if rank not in lim.MLA_LATENT_DIMS:
        _block(
            book,
            f"MLA kv_lora_rank is {rank}; the absorbed query head dim must be one of "
            f"{lim.MLA_LATENT_DIMS} (v2 › 当query的d等于512时 / 当query的d等于128时)",
        )
    v2 = fa_version == "v2"
    if rank == lim.MLA_LATENT_DIM:
        allowed = lim.MLA_V2_HEADS if v2 else lim.MLA_V1_HEADS
        if heads not in allowed:
            _warn(
                book,
                f"MLA decode (absorbed, 512-wide latent) with {heads} query heads per rank: "
                f"{_ON_NPU}; it takes {allowed} (› 当query的d等于512时 / query_rope和key_rope参数"
                "约束: N为32、64、128)",
            )
    if keeps_absorbed_prefill:
        return
    # the un-absorbed prefill: TND without page attention on Q_D = K_D = nope + rope, V_D = v
    q_d = nope + rope
    dims = lim.TND_V2_DIMS if v2 else lim.TND_V1_DIMS
    if value not in dims.get(q_d, ()):
        allowed = "; ".join(f"Q_D = K_D = {q} with V_D in {v}" for q, v in dims.items())
        _warn(
            book,
            f"MLA prefill (un-absorbed, TND) has Q_D = K_D = {nope} + {rope} = {q_d}, V_D = "
            f"{value}: {_ON_NPU}; it takes {allowed} (› TND场景下query、key、value输入的综合限制)",
        )
    if not v2 and heads not in lim.TND_V1_HEADS:
        _warn(
            book,
            f"MLA prefill (un-absorbed, TND) with {heads} query heads per rank: {_ON_NPU}; v1 "
            f"takes {lim.TND_V1_HEADS} (› TND场景下...的综合限制: N等于8/16/32/64/128)",
        )
    if block_size not in lim.MLA_NZ_BLOCK_SIZES:
        _warn(
            book,
            f"block_size {block_size}: {_ON_NPU}; the NZ latent cache takes block_size "
            f"{lim.MLA_NZ_BLOCK_SIZES[0]} (› 当query的d等于512时: 数据格式为NZ时block_size不支持配置16)",
        )


def _paged_block_size(book: Notebook, block_size: int) -> None:
    step = lim.PREFILL_BLOCK_MULTIPLE
    if block_size % step or not step <= block_size <= lim.MAX_PAGED_BLOCK:
        _warn(
            book,
            f"block_size {block_size}: {_ON_NPU} for prompts; page attention takes a multiple "
            f"of {step} in [{step}, {lim.MAX_PAGED_BLOCK}] when Q_S > 1 (› 当Q_S大于1时 › page "
            "attention场景)",
        )


def _block(book: Notebook | _LayerBook, message: str) -> None:
    text = f"operator limit: {message} [{_DOC}]"
    book.warn(text)
    book.block(text)


def _warn(book: Notebook | _LayerBook, message: str) -> None:
    book.warn(f"operator limit: {message} [{_DOC}]")

"""GLM-5.3's k-pool DSA indexer (``glm5_next``): what the Plan says of it, and what it refuses.

How transformers 5.24.0 builds it (``models/glm5_next/modeling_glm5_next.py``):

- The indexer (``Glm5NextTextIndexer``, :772-1061) keeps per token a 128-wide key
  ``k_norm(wk(x))``, a 128-wide gate score ``x @ index_kpool_compress_gate^T`` and a valid flag
  (``cache.update_indexer``, :857). ``get_pooled_states`` (:936) cuts the context into pools of
  ``index_kpool`` tokens from the first real token and pools each complete one into one key,
  ``sum softmax(gate + index_kpool_compress_ape) * key`` over its tokens. A query scores the
  pools it sees whole, ``sum_h w_h * relu(q_h . pool_key) * head_dim**-0.5 * n_heads**-0.5``,
  keeps ``index_topk // index_kpool`` of them and expands them into their tokens;
  ``append_visible_tail`` (:1011) adds the tokens of its open pool (at most ``index_kpool - 1``).
  "shared" layers (``indexer_types``) reuse the previous full layer's selection.
- The attention it feeds (``Glm5NextTextAttention``, :1101) is MLA without rope
  (``qk_rope_head_dim`` 0): the cache keeps the normalised ``kv_lora_rank`` latent only.
- Worked example, ``index_kpool`` 4, query at position 9 (10 tokens visible): pools 0 (0-3) and
  1 (4-7) are whole and scored, the open pool holds 8-9. With ``index_topk`` 4 one pool is kept,
  say pool 1, and the attention reads 4, 5, 6, 7, 8, 9.

How the conversion expresses it (the operators of the torch_npu 2.13.0 wheel; KVR030 for the
indexer, the DSA seam of KVR004 / KVR005 for the attention):

- pooled keys in a paged cache of their own, one row per closed pool (``compress_ratio`` =
  ``index_kpool``), written in plain torch when a pool closes from its tokens' raw keys and
  gate scores, which wait across steps in per-request rows (a window of one pool); no wheel
  operator pools keys (the framework's ``torch.ops.custom.compressor`` is its own build and
  takes ratios 4 and 128 only);
- ``npu_lightning_indexer`` scores them, one batch row per query token with key length
  ``(p + 1) // index_kpool`` (the pools it sees whole), ``sparse_count`` ``index_topk //
  index_kpool``, the two scales folded into its weights;
- ``npu_sparse_flash_attention`` with ``sparse_block_size`` ``index_kpool`` over the kept pools
  and the open pool ``p // index_kpool`` (its later tokens cut by ``sparse_mode`` 3), reading
  the absorbed latent; its ``query_rope`` / ``key_rope`` of D 64 are zeros (a zero query part
  and a stride-0 zero view over the latent's blocks: no rope bytes are stored).

Refused, each with its line and limit: a pool size the sparse attention cannot take as
``sparse_block_size`` (a power of two up to 128), and ``index_kpool_always_select_tail``
False (a query with no closed pool then attends nothing, and the source's softmax spreads over
its whole masked row).

NOTE: the scores are sums of relu terms and can tie at 0; ``torch.topk`` orders ties its own
way, the operator lower position first, so a selection may differ from the source's where
scores tie even when the design above is followed (verify's twin keeps 16 indexer heads).
"""

from __future__ import annotations

from pathlib import Path

from kvskill.analyzer.compressed_features import (
    SourceReader,
    features_text,
)
from kvskill.analyzer.config import ModelSpec
from kvskill.analyzer.evidence import Notebook
from kvskill.analyzer.indexer import (
    LIGHTNING_INDEXER,
    SPARSE_ATTENTION,
    indexer_layers,
    layer_spans,
)
from kvskill.analyzer.plan import CacheEntryPlan, CompressedSubFeature, IndexerPlan
from kvskill.core import npu_limits as lim
from kvskill.core.cache_bytes import dtype_bytes

#: the closed pools' keys, one row per ``index_kpool`` tokens
POOL_KEY_CACHE = "indexer_pool_key_cache"
#: the open pool's raw keys and gate scores, per request (they wait until the pool closes)
POOL_STATE = "indexer_pool_state"
#: the layer kind of an attention layer with an indexer (analyzer/config.py)
INDEXED = "indexed_attention"
#: the framework's compressor takes these ratios only (custom-npu_compressor.md:141)
COMPRESSOR_RATIOS = (4, 128)
#: kernel doc, A2/A3: "sparse_block_size支持[1,128]，且要求是2的幂次方"
MAX_SPARSE_BLOCK = 128


def pool_size(spec: ModelSpec) -> int:
    """Tokens per scored indexer key (1: the DSA indexer scores every token)."""
    return int((spec.indexer or {}).get("kpool") or 1)


def is_pooled(spec: ModelSpec) -> bool:
    """A DSA indexer that scores pooled keys (GLM-5.3's ``index_kpool`` > 1) on some layer (a
    config whose layers are all linear attention builds no indexer)."""
    return spec.indexer is not None and pool_size(spec) > 1 and INDEXED in spec.layer_kinds


def attention_layers(spec: ModelSpec) -> tuple[list[int], list[int]]:
    """(layers running their own indexer, layers reusing a selection) among the attention
    layers: ``indexer_types`` names every layer, the linear-attention ones too."""
    layers = indexer_layers(spec)
    attending = {i for i, kind in enumerate(spec.layer_kinds) if kind == INDEXED}
    return (
        [i for i in layers.owners if i in attending],
        [i for i in layers.shared if i in attending],
    )


def pooled_cache_entries(
    spec: ModelSpec, entries: dict[str, list[CacheEntryPlan]], attn_type: str
) -> dict[str, list[CacheEntryPlan]]:
    """ENTRIES with the pooled keys added to ATTN_TYPE's (the latent's); only the layers
    that run their own indexer keep them, "shared" layers the latent alone.

    NOTE: the open pool's [key | gate] rows (POOL_STATE) are per request, at most
    ``index_kpool`` rows a layer, not per token: ``pool_state_bytes`` gives them.
    """
    assert spec.indexer is not None
    owners, _ = attention_layers(spec)
    pooled = CacheEntryPlan(
        cache_name=POOL_KEY_CACHE,
        dim=int(spec.indexer["head_dim"]),
        num_head=1,
        dtype=spec.dtype,
        compress_ratio=pool_size(spec),
        num_layers=len(owners),
    )
    return {**entries, attn_type: [*entries.get(attn_type, []), pooled]}


def pool_state_bytes(spec: ModelSpec) -> int:
    """Bytes of one request's open-pool rows in one indexer layer: ``index_kpool - 1`` tokens
    of [key | gate score]."""
    assert spec.indexer is not None
    return (pool_size(spec) - 1) * 2 * int(spec.indexer["head_dim"]) * dtype_bytes(spec.dtype, 2)


def pooled_features(
    source: str, file_name: str, spec: ModelSpec
) -> tuple[str, str, list[CompressedSubFeature]]:
    """The attention class, where it calls its indexer, and each part of the pooled indexer
    found in SOURCE with what it needs and the limit that stops it ("" when none)."""
    assert spec.indexer is not None
    reader = SourceReader(source)
    pool, topk = pool_size(spec), int(spec.indexer["topk"])
    mla = spec.mla or {}
    rank, rope = int(mla.get("kv_lora_rank") or 0), int(mla.get("qk_rope_head_dim") or 0)

    def where(line: int) -> str:
        return f"{file_name}:{line}"

    indexers = reader.defining("get_pooled_states")
    attention = [n for n in reader.holders("indexer") if n not in indexers]
    call = reader.first("indexer", attention, "forward")
    attention_name = call.owner if call else (attention[0] if attention else "the attention")
    found: list[CompressedSubFeature] = []
    write = reader.first("update_indexer", indexers, "forward")
    if write is not None:
        found.append(
            CompressedSubFeature(
                name="pooled indexer keys",
                construct=f"{write.owner}: {write.construct} + get_pooled_states",
                where=where(write.line),
                needs=(
                    f"{POOL_KEY_CACHE} (one {spec.indexer['head_dim']}-wide row per closed pool "
                    f"of {pool}, written when it closes as sum softmax(gate + ape) * key) and "
                    f"{POOL_STATE} (the open pool's [key | gate] rows); {LIGHTNING_INDEXER} over "
                    f"the pooled keys, one batch row per query token with key length "
                    f"(p + 1) // {pool}, sparse_count {topk // pool}, head_dim^-0.5 * "
                    "n_heads^-0.5 in its weights"
                ),
            )
        )
    paged = reader.first("pooled_selection", indexers, "forward")
    if write is None and paged is not None:
        # a converted file (applying again rewrites nothing)
        found.append(
            CompressedSubFeature(
                name="pooled indexer keys, already paged",
                construct=f"{paged.owner}: {paged.construct}",
                where=where(paged.line),
                needs=f"{POOL_KEY_CACHE} and {POOL_STATE}, as written",
            )
        )
    tail = reader.first("append_visible_tail", indexers, "forward")
    bad_block = pool > MAX_SPARSE_BLOCK or pool & (pool - 1)
    block_limit = (
        f"sparse_block_size must be a power of two in [1, {MAX_SPARSE_BLOCK}], "
        f"index_kpool is {pool}"
        if bad_block
        else ""
    )
    if tail is not None and spec.indexer.get("select_tail"):
        found.append(
            CompressedSubFeature(
                name="open-pool tail",
                construct=f"{tail.owner}: {tail.construct}",
                where=where(tail.line),
                needs=(
                    f"{SPARSE_ATTENTION}(sparse_block_size={pool}) over the kept pools and the "
                    f"open pool p // {pool} when (p + 1) % {pool} != 0, its later tokens cut by "
                    f"sparse_mode 3 (the paged block_size a multiple of {pool})"
                ),
                missing=block_limit,
            )
        )
    elif tail is not None:
        # the source then attends the kept pools only: a query before its first closed pool
        # has every key masked, and its softmax spreads over the whole masked row (future
        # tokens too), which no sparse selection reproduces
        found.append(
            CompressedSubFeature(
                name="open pool not attended",
                construct=f"{tail.owner}: if self.index_kpool_always_select_tail: ...",
                where=where(tail.line),
                needs=f"{SPARSE_ATTENTION}(sparse_block_size={pool}) over the kept pools only",
                missing=(
                    "index_kpool_always_select_tail is False: a query with no closed pool "
                    "attends no key, and the source's softmax then spreads over its whole "
                    "masked row (future tokens too); the sparse attention returns zeros there"
                ),
            )
        )
    update = reader.first("update", attention, "forward", lambda r: r == "cache")
    if update is not None:
        found.append(
            CompressedSubFeature(
                name="latent" + (" without rope" if rope == 0 else ""),
                construct=f"{update.owner}: {update.construct}",
                where=where(update.line),
                needs=(
                    f"nope_cache (the {rank} latent, one head) written with "
                    f"npu_scatter_nd_update_; {SPARSE_ATTENTION} on the absorbed query with "
                    f"query_rope / key_rope of D {lim.MLA_ROPE_DIM}"
                    + (
                        " (zeros: a zero query part and a stride-0 zero view over the latent's "
                        "blocks, no rope bytes stored)"
                        if rope == 0
                        else ""
                    )
                ),
                missing=(
                    f"{SPARSE_ATTENTION} requires query_rope and key_rope of D "
                    f"{lim.MLA_ROPE_DIM}, the latent's rope part is {rope} wide"
                    if rope not in (0, lim.MLA_ROPE_DIM)
                    else ""
                ),
            )
        )
    shared = reader.first_name("prev_topk_indices", attention, "forward")
    _, sharing = attention_layers(spec)
    if shared is not None and sharing:
        found.append(
            CompressedSubFeature(
                name="shared top-k",
                construct=f"{shared.owner}: {shared.construct}",
                where=where(shared.line),
                needs=(
                    f"layers {layer_spans(sharing)} read the previous full layer's selection "
                    "(pools and tail); no indexer cache of their own"
                ),
            )
        )
    where_call = where(call.line) if call else file_name
    return attention_name, where_call, found


def decide_pooled_indexer(
    spec: ModelSpec, modeling_file: str | None, book: Notebook
) -> IndexerPlan | None:
    """The Plan's record of a pooled indexer, cited, with the one-line refusal it causes;
    None for a model without one."""
    if not is_pooled(spec):
        return None
    assert spec.indexer is not None
    heads, dim, topk = spec.indexer["n_heads"], spec.indexer["head_dim"], spec.indexer["topk"]
    pool, tail = pool_size(spec), bool(spec.indexer.get("select_tail"))
    owners, sharing = attention_layers(spec)
    file_name = Path(modeling_file).name if modeling_file else "the modeling file"
    text = Path(modeling_file).read_text(encoding="utf-8") if modeling_file else ""
    attention, where, features = pooled_features(text, file_name, spec)
    tail_text = f" and the query's open pool (up to {pool - 1} tokens)" if tail else ""
    book.cite(
        "indexer",
        f"k-pool DSA indexer: {heads} query heads score one {dim}-wide key per pool of {pool} "
        f"tokens (a softmax-gated sum of the pool's keys); {topk // pool} pools "
        f"({topk} tokens) per query are kept{tail_text}",
        book.cfg(spec.sources.get("index_kpool") or spec.sources.get("indexer")),
    )
    book.cite(
        "indexer.layers",
        f"{len(owners)} attention layers run the indexer and keep {POOL_KEY_CACHE} (one row "
        f"per {pool} tokens) and {POOL_STATE} ({pool_state_bytes(spec)} bytes per request: the "
        f"open pool's [key | gate] rows) ({layer_spans(owners)})"
        + (
            f"; {len(sharing)} 'shared' layers ({layer_spans(sharing)}) reuse the previous indexer "
            "layer's selection"
            if sharing
            else ""
        ),
        book.cfg(spec.sources.get("indexer_types")),
    )
    book.cite("indexer.parts", features_text(features), file_name)
    missing = [f"{f.name} ({f.where}): {f.missing}" for f in features if f.missing]
    if not features:
        missing = [
            f"no pooled-indexer construct (update_indexer, get_pooled_states) in {file_name}"
        ]
    if missing:
        reason = (
            f"{attention} ({where}) attends what a k-pool DSA indexer selects (one gated key per "
            f"{pool} tokens, top {topk // pool} pools{' + the open pool' if tail else ''}): "
            f"{'; '.join(missing)}"
        )
        book.warn(reason)
        book.block(reason)
    key_bytes = -(-dim * dtype_bytes(spec.dtype, 2) // pool)
    return IndexerPlan(
        n_heads=heads,
        head_dim=dim,
        topk=topk,
        key_cache=POOL_KEY_CACHE,
        key_cache_bytes_per_token=key_bytes,
        operators=[LIGHTNING_INDEXER, SPARSE_ATTENTION],
        layers=owners,
        shared_layers=sharing,
        pool_size=pool,
        select_tail=tail,
        sub_features=features,
    )


__all__ = [
    "POOL_KEY_CACHE",
    "POOL_STATE",
    "decide_pooled_indexer",
    "is_pooled",
    "attention_layers",
    "pool_size",
    "pool_state_bytes",
    "pooled_cache_entries",
    "pooled_features",
]

"""The DSA indexer of indexed sparse attention (DeepSeek-V3.2): what the Plan says of it.

Each indexed layer scores every context position with a small multi-head query against a key
cache of its own (one head of ``index_head_dim``), keeps the ``index_topk`` best, and the MLA
attention reads only those. On the paged path the indexer's keys are a third cache entry of
the layer, paged beside the latent and the rope key (same blocks, same block table, so prefix
caching and preemption keep the three together), ``npu_lightning_indexer`` selects over it and
``npu_sparse_flash_attention`` attends over the selection (absorbed, in prefill and decode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvskill.analyzer.config import ModelSpec
from kvskill.analyzer.evidence import Notebook
from kvskill.analyzer.plan import IndexerPlan

#: the cache entry of the indexer's keys
INDEXER_KEY_CACHE = "indexer_key_cache"
LIGHTNING_INDEXER = "npu_lightning_indexer"
SPARSE_ATTENTION = "npu_sparse_flash_attention"


#: GLM-5's ``indexer_types`` values: the layer runs its indexer, or reuses the previous top-k
FULL, SHARED = "full", "shared"


@dataclass(frozen=True)
class IndexerLayers:
    """Which layers run their own indexer (and keep its keys) and which reuse a top-k."""

    owners: list[int]
    #: layers that take the previous owning layer's top-k and keep no indexer keys
    shared: list[int]
    #: why the pattern cannot be planned, or None
    problem: str | None = None
    #: layers that run no indexer and attend densely, full or sliding (dots3_note's
    #: "full_attention" and "sliding_attention" beside its "indexed_attention" layers)
    dense: list[int] = field(default_factory=list)


def indexer_layers(spec: ModelSpec) -> IndexerLayers:
    """The owning and sharing layers of SPEC's indexer (every layer owns one without a list).

    GLM-5's ``indexer_types`` (one entry per layer, "full" or "shared"): a shared layer has no
    indexer module, hence no weights and no key cache, and attends to the positions the
    nearest earlier full layer selected for the same tokens. dots3_note's ``layer_types``:
    its "indexed_attention" layers run the indexer, the others none (they attend densely).
    """
    assert spec.indexer is not None
    kinds = spec.indexer.get("indexer_types")
    indexed = spec.indexer.get("indexed_layers")
    if kinds is None and indexed is not None:
        return IndexerLayers(
            owners=list(indexed),
            shared=[],
            dense=[i for i in range(spec.num_layers) if i not in set(indexed)],
        )
    if kinds is None:
        return IndexerLayers(owners=list(range(spec.num_layers)), shared=[])
    kinds = list(kinds[: spec.num_layers])
    where = spec.sources.get("indexer_types", "indexer_types")
    unknown = sorted({k for k in kinds if k not in (FULL, SHARED)})
    problem = None
    if unknown:
        problem = f"{where} holds {unknown}; only '{FULL}' and '{SHARED}' are known"
    elif len(kinds) < spec.num_layers:
        problem = f"{where} names {len(kinds)} of {spec.num_layers} layers"
    elif kinds and kinds[0] == SHARED:
        problem = f"{where}[0] is '{SHARED}': no earlier layer selects a top-k to reuse"
    return IndexerLayers(
        owners=[i for i, k in enumerate(kinds) if k == FULL],
        shared=[i for i, k in enumerate(kinds) if k == SHARED],
        problem=problem,
    )


def plannable_indexer(spec: ModelSpec) -> bool:
    """An indexer the paged path converts: an MLA model whose layers each run their own, or
    reuse the top-k of an earlier layer that does (GLM-5's "shared" layers). A k-pool
    indexer (GLM-5.3) scores pooled keys: analyzer/pooled_indexer.py plans and refuses it."""
    return (
        spec.indexer is not None
        and spec.mla is not None
        and int(spec.indexer.get("kpool") or 1) == 1
        and not indexer_layers(spec).problem
    )


def reads_sparsely(spec: ModelSpec) -> bool:
    """The MLA attention reads what a DSA indexer selects: a plannable per-token indexer or a
    k-pool one (whose design is the same operator pair, analyzer/pooled_indexer.py)."""
    pooled = spec.indexer is not None and int(spec.indexer.get("kpool") or 1) > 1
    return plannable_indexer(spec) or (pooled and spec.mla is not None)


def decide_indexer(spec: ModelSpec, book: Notebook) -> IndexerPlan | None:
    """The Plan's indexer record, cited; None when the model has none the path converts."""
    if not plannable_indexer(spec):
        return None
    assert spec.indexer is not None
    heads, dim, topk = spec.indexer["n_heads"], spec.indexer["head_dim"], spec.indexer["topk"]
    key_bytes = dim * spec.dtype_bytes
    layers = indexer_layers(spec)
    book.cite(
        "indexer",
        f"DSA indexer: {heads} query heads over one {dim}-wide key head per token, keeping the "
        f"top {topk} positions per query; its keys are the layer's cache entry "
        f"{INDEXER_KEY_CACHE} ({key_bytes} bytes per token per layer), paged with the latent",
        book.cfg(spec.sources.get("indexer")),
    )
    if layers.dense:
        book.cite(
            "indexer.layers",
            f"{len(layers.owners)} layers run the indexer and keep {INDEXER_KEY_CACHE} "
            f"({layer_spans(layers.owners)}); {len(layers.dense)} layers ({layer_spans(layers.dense)}) "
            "run none: they attend densely (full or sliding) and keep no indexer keys",
            book.cfg(spec.sources.get("indexed_layers")),
        )
    if layers.shared:
        book.cite(
            "indexer.layers",
            f"{len(layers.owners)} layers run the indexer and keep {INDEXER_KEY_CACHE} "
            f"({layer_spans(layers.owners)}); {len(layers.shared)} 'shared' layers "
            f"({layer_spans(layers.shared)}) reuse the previous indexer layer's top-k and keep no "
            "indexer keys",
            book.cfg(spec.sources.get("indexer_types")),
        )
    book.cite(
        "indexer.operators",
        f"{LIGHTNING_INDEXER} (PA_BSND keys, sparse_count={topk}, sparse_mode 3) picks the "
        f"positions; {SPARSE_ATTENTION} (absorbed latent query, PA_BSND latent and rope caches, "
        "sparse_mode 3) attends over them in prefill and decode",
        "rule: DSA on the paged path",
    )
    return IndexerPlan(
        n_heads=heads,
        head_dim=dim,
        topk=topk,
        key_cache=INDEXER_KEY_CACHE,
        key_cache_bytes_per_token=key_bytes,
        operators=[LIGHTNING_INDEXER, SPARSE_ATTENTION],
        layers=layers.owners,
        shared_layers=layers.shared,
        dense_layers=layers.dense,
    )


def layer_spans(indices: list[int]) -> str:
    """Layer indices as ranges: [0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)

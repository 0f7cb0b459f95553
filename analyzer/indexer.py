"""The DSA indexer of indexed sparse attention (DeepSeek-V3.2): what the Plan says of it.

Each indexed layer scores every context position with a small multi-head query against a key
cache of its own (one head of ``index_head_dim``), keeps the ``index_topk`` best, and the MLA
attention reads only those. On the paged path the indexer's keys are a third cache entry of
the layer, paged beside the latent and the rope key (same blocks, same block table, so prefix
caching and preemption keep the three together), ``npu_lightning_indexer`` selects over it and
``npu_sparse_flash_attention`` attends over the selection (absorbed, in prefill and decode).
"""

from __future__ import annotations

from kvskill.analyzer.config import ModelSpec
from kvskill.analyzer.evidence import Notebook
from kvskill.analyzer.plan import IndexerPlan

#: the cache entry of the indexer's keys
INDEXER_KEY_CACHE = "indexer_key_cache"
LIGHTNING_INDEXER = "npu_lightning_indexer"
SPARSE_ATTENTION = "npu_sparse_flash_attention"


def plannable_indexer(spec: ModelSpec) -> bool:
    """An indexer the paged path converts: every layer runs its own.

    GLM-5's ``indexer_types`` "shared" layers reuse the previous layer's top-k and keep no
    indexer keys of their own; that hand-over between layers is not converted.
    """
    return spec.indexer is not None and spec.mla is not None and not spec.indexer["shared_layers"]


def decide_indexer(spec: ModelSpec, book: Notebook) -> IndexerPlan | None:
    """The Plan's indexer record, cited; None when the model has none the path converts."""
    if not plannable_indexer(spec):
        return None
    assert spec.indexer is not None
    heads, dim, topk = spec.indexer["n_heads"], spec.indexer["head_dim"], spec.indexer["topk"]
    key_bytes = dim * spec.dtype_bytes
    book.cite(
        "indexer",
        f"DSA indexer: {heads} query heads over one {dim}-wide key head per token, keeping the "
        f"top {topk} positions per query; its keys are the layer's cache entry "
        f"{INDEXER_KEY_CACHE} ({key_bytes} bytes per token per layer), paged with the latent",
        book.cfg(spec.sources.get("indexer")),
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
    )

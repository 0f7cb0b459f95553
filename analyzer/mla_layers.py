"""Per-layer MLA facts beyond the latent dims: NoPE layers, latent reuse, query rescales.

Mistral Large 4 mixes three things into its MLA layers that the Plan states:

* NoPE layers (``no_rope_layers`` 0): the layer's query and latent key have no rope part
  (width 0). The fused attention's rope inputs are 64 wide (npu_ops §1.8), so those layers
  pass zeros there: zero rows add nothing to ``q . k``, and their rope_cache rows hold zeros.
* cross-layer latent reuse (``kv_source_layers``): a layer that attends to an earlier layer's
  latent instead of its own. The paged MLA seam reads only the layer's own caches, so a
  config with such layers is a blocker, named with its pairs.
* a per-position rescale of the query after the cache write (``analyzer.query_rescale``),
  which the converted seam applies too.
"""

from __future__ import annotations

from kvskill.analyzer.config import ModelSpec
from kvskill.analyzer.evidence import Notebook
from kvskill.analyzer.indexer import layer_spans
from kvskill.analyzer.query_rescale import rescale_sites


def cite_mla_layers(spec: ModelSpec, modeling_file: str | None, book: Notebook) -> None:
    """Cite SPEC's NoPE layers, latent reuse and query rescales; block on latent reuse."""
    if spec.mla is None:
        return
    nope = spec.mla.get("nope_layers")
    if nope:
        book.cite(
            "mla.nope_layers",
            f"{len(nope)} NoPE layers ({layer_spans(nope)}) have no rope part in their query or "
            "latent key; the fused attention's rope inputs are 64 wide, so these layers pass "
            "zeros as their rope query and write zero rope keys (they add nothing to q . k)",
            book.cfg(spec.sources.get("mla.nope_layers")),
        )
    reused = spec.mla.get("reused_latent")
    if reused:
        pairs = ", ".join(f"{c}<-{p}" for c, p in reused.items())
        book.cite(
            "mla.reused_latent",
            f"layers {pairs} (consumer<-source) attend to another layer's latent",
            book.cfg(spec.sources.get("mla.reused_latent")),
        )
        book.block(
            f"layers {pairs} attend to another layer's latent KV (kv_source_layers); the paged "
            "MLA seam reads only each layer's own nope_cache / rope_cache, so a shared latent "
            "cache is not converted"
        )
    elif reused is not None:
        book.cite(
            "mla.reused_latent",
            "every layer attends to its own latent (no cross-layer KV sharing)",
            book.cfg(spec.sources.get("mla.reused_latent")),
        )
    for site in rescale_sites(modeling_file) if modeling_file else []:
        book.cite(
            "query_rescale",
            f"{site.owner}.forward rescales a query per position (`{site.statement}`): "
            f"{site.module_class} multiplies each query vector by one factor computed "
            "elementwise from its position and per-head parameters; the converted forward "
            "applies it as written",
            f"{modeling_file.rsplit('/', 1)[-1]}:{site.line}",
        )

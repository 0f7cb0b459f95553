"""Compressed attention (DeepSeek-V4): what the Plan says of it, and when apply refuses it.

Every layer attends a sliding window of its own keys (one head, K = V) with learnable sinks.
A compressed layer also folds every ``compress_ratio`` tokens into one entry and attends those
in the same softmax: CSA (ratio 4) through a top-k indexer over compressed keys of its own,
HCA (ratio 128) over all of them. On the framework's paged path (cann-recipes-infer
``fbc225d``, ``models/deepseek_v4/models/modeling_deepseek.py:878-1010``) each layer declares
``win_kv`` (SlidingWindow, ``manager_key`` "win_kv"), and CSA / HCA layers add compressed
FullAttention entries grouped under ``c4a_cmp_kv`` / ``c128a_cmp_kv`` (``sfa_cmp_kv``, CSA's
``li_cmp_kv``), plus float32 compressor states bounded per request.

The config names the kinds per layer: ``layer_types`` with ``compress_rates`` {type: ratio}
(transformers 5, ``configuration_deepseek_v4.py``) or the checkpoint's ``compress_ratios``
list (0 = sliding only), which that configuration folds into the same.
"""

from __future__ import annotations

from typing import Any

from kvskill.analyzer.compressed_features import features_text
from kvskill.analyzer.config import ModelSpec, text_config
from kvskill.analyzer.evidence import Notebook
from kvskill.analyzer.plan import CacheEntryPlan, CompressedAttentionPlan, CompressedLayerKind
from kvskill.core.attn_types import AttnType
from kvskill.core.cache_bytes import entry_bytes, token_bytes

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
#: the checkpoint's per-layer ratios -> transformers' layer types (``compress_ratios``)
_RATIO_TO_TYPE = {0: SLIDING, 1: SLIDING, 4: CSA, 128: HCA}
_SHORT = {SLIDING: "sliding", CSA: "CSA", HCA: "HCA"}

#: torch_npu 2.13.0 (``npu_native_functions_by_codegen.yaml``) against what the framework calls
WHEEL_HAS = {
    "npu_scatter_nd_update_": True,
    "npu_sparse_flash_attention": True,  # yaml:978, one paged cache; sinks on Ascend 950 only
    "npu_lightning_indexer": True,  # yaml:489, no cmp_ratio
    "npu_quant_lightning_indexer": True,  # yaml:91, no cmp_ratio
    # yaml:943 (paged: the overload npu_nsa_compress_infer.cache, yaml:947): learned block
    # weights, not V4's softmax-gated, overlapping pooling
    "npu_nsa_compress": True,
    # absent from the yaml and the docs (tests/fixtures/npu_schemas.json "absent"). Each of the
    # three has a CPU reference under the framework's own schema (runtime/ops/reference/custom,
    # torch.ops.custom in the stand-in, tests/fixtures/custom_schemas.json), which is not a
    # device operator: the wheel still lacks them. The cmp_ratio indexer takes int8 query and
    # keys only, so an unquantized conversion has no device operator for CSA's top-k.
    "torch.ops.custom.npu_sparse_attn_sharedkv": False,
    "torch.ops.custom.compressor": False,
    "torch.ops.custom.npu_quant_lightning_indexer (cmp_ratio)": False,
}
#: what each branch runs on the framework's path (modeling_deepseek.py:820, :2184;
#: modules/compressor.py:387; modules/indexer.py:320); its window write
#: (torch.ops.custom.scatter_nd_update_asc, modeling_deepseek.py:1435) is the wheel's
#: npu_scatter_nd_update_, which kvskill emits for every window. Every torch.ops.custom entry
#: below (and each one's _metadata planner) has a reference in runtime/ops/reference/custom.
_FRAMEWORK_OPS = {
    SLIDING: ["npu_scatter_nd_update_", "torch.ops.custom.npu_sparse_attn_sharedkv"],
    CSA: [
        "torch.ops.custom.compressor",
        "torch.ops.custom.npu_quant_lightning_indexer (cmp_ratio)",
        "torch.ops.custom.npu_sparse_attn_sharedkv",
    ],
    HCA: ["torch.ops.custom.compressor", "torch.ops.custom.npu_sparse_attn_sharedkv"],
}
#: manager keys of the compressed groups, as the framework names them
WINDOW_KEY = "win_kv"


def layer_types_of(config: dict[str, Any]) -> list[str] | None:
    """The per-layer kinds of a compressed-attention config, or None when it has none."""
    cfg, _ = text_config(config)
    types = cfg.get("layer_types")
    if isinstance(types, list) and any(t in (CSA, HCA) for t in types):
        return list(types)
    ratios = cfg.get("compress_ratios")
    if isinstance(ratios, list) and any(r in (4, 128) for r in ratios):
        return [_RATIO_TO_TYPE.get(r, f"compress_ratio_{r}") for r in ratios]
    return None


def _ratios(cfg: dict[str, Any]) -> dict[str, int]:
    rates = cfg.get("compress_rates")
    ratios = {CSA: 4, HCA: 128}  # the configuration's default_compress_rates
    if isinstance(rates, dict):
        ratios.update({k: int(v) for k, v in rates.items() if k in ratios})
    for key, name in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if isinstance(cfg.get(key), int):
            ratios[name] = cfg[key]
    return {SLIDING: 1, **ratios}


def decide_compressed_attention(
    spec: ModelSpec, config: dict[str, Any], book: Notebook
) -> CompressedAttentionPlan | None:
    """The Plan's record of the compressed layers, cited; None for any other model."""
    types = layer_types_of(config)
    if types is None:
        return None
    cfg, prefix = text_config(config)
    ratios = _ratios(cfg)
    window = int(cfg.get("sliding_window") or 0)
    index = {
        "n_heads": cfg.get("index_n_heads"),
        "head_dim": cfg.get("index_head_dim"),
        "topk": cfg.get("index_topk"),
    }
    kinds = []
    for layer_type in (SLIDING, CSA, HCA):
        indices = [i for i, t in enumerate(types) if t == layer_type]
        if not indices:
            continue
        caches = _layer_caches(spec, layer_type, ratios[layer_type], window, index, len(indices))
        kinds.append(
            CompressedLayerKind(
                layer_type=layer_type,
                name=_SHORT[layer_type],
                layer_indices=indices,
                compress_ratio=ratios[layer_type],
                sliding_window=window,
                caches=caches,
                bytes_per_token=sum(
                    token_bytes(
                        entry_bytes(int(e.dim), e.num_head, spec.dtype_bytes), e.compress_ratio
                    )
                    for e in caches
                ),
                indexer=index if layer_type == CSA else None,
                operators=_FRAMEWORK_OPS[layer_type],
                operators_missing=[op for op in _FRAMEWORK_OPS[layer_type] if not WHEEL_HAS[op]],
            )
        )
    unknown = sorted({t for t in types if t not in _SHORT})
    if unknown:
        book.warn(
            f"layer types {unknown} are neither sliding, CSA (ratio 4) nor HCA (ratio 128): their "
            "caches are not counted here"
        )
    for kind in kinds:
        book.cite(
            "compressed_attention",
            f"{kind.name}: {len(kind.layer_indices)} layers, window {window}"
            + (f", compress ratio {kind.compress_ratio}" if kind.compress_ratio > 1 else "")
            + (f", indexer {index['n_heads']} heads x {index['head_dim']} top-{index['topk']}"
               if kind.indexer else "")
            + f"; caches {', '.join(entry_text(e) for e in kind.caches)}: "
            f"{kind.bytes_per_token} B/token/layer",
            book.cfg(prefix + ("layer_types" if cfg.get("layer_types") else "compress_ratios")),
        )  # fmt: skip
    return CompressedAttentionPlan(
        kinds=kinds, unknown_layer_types=unknown, wheel_operators=dict(WHEEL_HAS)
    )


def _layer_caches(
    spec: ModelSpec,
    layer_type: str,
    ratio: int,
    window: int,
    index: dict[str, Any],
    num_layers: int,
) -> list[CacheEntryPlan]:
    """One layer's token caches, as the framework declares them (per layer)."""
    dim, dtype = spec.head_dim, spec.dtype
    caches = [
        CacheEntryPlan(
            cache_name=WINDOW_KEY, dim=dim, num_head=1, dtype=dtype, sliding_window=window,
            manager_key=WINDOW_KEY, num_layers=num_layers,
        )
    ]  # fmt: skip
    if layer_type == SLIDING:
        return caches
    key = f"c{ratio}a_cmp_kv"
    caches.append(
        CacheEntryPlan(
            cache_name="sfa_cmp_kv", dim=dim, num_head=1, dtype=dtype, compress_ratio=ratio,
            manager_key=key, num_layers=num_layers,
        )
    )  # fmt: skip
    if layer_type == CSA and isinstance(index["head_dim"], int):
        caches.append(
            CacheEntryPlan(
                cache_name="li_cmp_kv", dim=index["head_dim"], num_head=1, dtype=dtype,
                compress_ratio=ratio, manager_key=key, num_layers=num_layers,
            )
        )  # fmt: skip
    return caches


def entry_text(entry: CacheEntryPlan) -> str:
    """``sfa_cmp_kv 1x512/4``: heads x width per row, and the tokens folded into a row."""
    ratio = f"/{entry.compress_ratio}" if entry.compress_ratio > 1 else ""
    return f"{entry.cache_name} {entry.num_head}x{entry.dim}{ratio}"


def compressed_cache_entries(plan: CompressedAttentionPlan) -> dict[str, list[CacheEntryPlan]]:
    """The Plan's cache entries by attn_type: every layer's window, the compressed groups."""
    entries: dict[str, list[CacheEntryPlan]] = {}
    windows = [e for kind in plan.kinds for e in kind.caches if e.cache_name == WINDOW_KEY]
    if windows:
        total = sum(e.num_layers or 0 for e in windows)
        first = windows[0]
        entries[AttnType.SLIDING_WINDOW.value] = [
            CacheEntryPlan(
                cache_name=first.cache_name, dim=first.dim, num_head=first.num_head,
                dtype=first.dtype, sliding_window=first.sliding_window,
                manager_key=first.manager_key, num_layers=total,
            )
        ]  # fmt: skip
    compressed = [e for kind in plan.kinds for e in kind.caches if e.compress_ratio > 1]
    if compressed:
        entries[AttnType.FULL_ATTENTION.value] = compressed
    return entries


def refusal(
    plan: CompressedAttentionPlan, attention_class: str, where: str, reasons: list[str]
) -> str:
    """One line: why apply cannot convert this compressed attention (REASONS: the limits hit
    and the sub-features missing), and what each part found would run on."""
    kinds = ", ".join(
        f"{k.name} x{len(k.layer_indices)}" + (f" (ratio {k.compress_ratio})" if k.compress_ratio > 1 else "")
        for k in plan.kinds
    )  # fmt: skip
    sinks = " with learnable sinks" if plan.sinks else ""
    return (
        f"{attention_class} ({where}) calls self.compressor(...) and attends its compressed "
        f"entries and its sliding-window keys{sinks} in one softmax ({kinds}): "
        f"{'; '.join(reasons)}; what each part found would run on: "
        f"{features_text(plan.sub_features)}"
    )

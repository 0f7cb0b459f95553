"""The sub-features of a compressed attention (DeepSeek-V4), read from its modeling file.

How transformers 5.24.0 builds it (``models/deepseek_v4/modeling_deepseek_v4.py``):

- Window, K = V, one head (:765-884). ``kv_proj`` projects to one ``head_dim`` head, RMS-
  normed and roped on its trailing ``qk_rope_head_dim`` slice (interleaved pairs, :346-370);
  ``cache.update(kv, kv, ...)`` (:836) appends it to a sliding-window layer that keeps the last
  ``sliding_window - 1`` rows (:189-201), so a query sees itself and the 127 before it. The
  same tensor is the key and the value; the output's rope slice is rotated back by ``-sin``
  at the query position (:878).
- Sinks (:806): ``self.sinks`` [num_heads] float32, one extra logit per head in every layer's
  softmax (``eager_attention_forward``, :727-755, via ``s_aux=`` :867).
- Compressor (HCA :373-455, CSA :600-712). ``kv_proj`` / ``gate_proj`` of the hidden states;
  each closed window of ``compress_ratio`` tokens becomes one entry
  ``kv_norm(sum softmax(gate + position_bias) * kv)``, roped at the window's first position.
  Tokens of an open window wait in the cache layer (``store_compression_weights``, :203-224)
  and the entries emitted so far are kept there too (``update_compressor_states``, :226-237):
  state that lives across steps. CSA overlaps: its projections are ``2 * head_dim`` wide and
  entry ``w`` pools window ``w - 1``'s first half with window ``w``'s second half, so the
  previous window's half is kept across steps as well (``update_overlap_state``, :285-299).
  Query ``t`` may read entry ``w`` only when ``w < (t + 1) // compress_ratio`` (:442-455).
- CSA indexer (:474-597): its own overlapping compressor at ``index_head_dim``, scores
  ``sum_h w_h * relu(q_h . k) * index_head_dim**-0.5`` (:458-471), masks the entries a query
  may not read and keeps ``index_topk`` (:586-597); the CSA compressor turns the selection into
  a -inf bias over its entries (:703-712).
- HCA: ratio 128, no overlap, no indexer; every readable entry is attended.
- The attention concatenates window keys and compressed entries on one axis and runs one
  softmax with the sinks (:838-870).

How the framework runs it (cann-recipes-infer ``fbc225d``, ``models/deepseek_v4``):

- Cache entries (``models/modeling_deepseek.py:879-1010``): ``win_kv`` SlidingWindow
  (manager ``win_kv``, one head); CSA adds ``sfa_cmp_kv`` and ``li_cmp_kv`` (FullAttention,
  ``compress_ratio`` 4, manager ``c4a_cmp_kv``) and the compressor states ``sfa_kv_state`` /
  ``li_kv_state`` (SlidingWindow of 8 token rows, float32 [kv | score], manager
  ``c4a_cmp_state``); HCA adds ``sfa_cmp_kv`` (ratio 128, ``c128a_cmp_kv``) and
  ``sfa_kv_state`` (SlidingWindow of 128 rows, ``c128a_cmp_state``).
- The window write is ``scatter_nd_update_asc`` at ``slot_mapping["win_kv"]`` (:1417-1435);
  the compressor is ``torch.ops.custom.compressor`` reading its state through
  ``block_table["c{ratio}a_cmp_state"]`` with ``coff`` 2 for CSA's overlap
  (``modules/compressor.py:312-387``); the indexer is
  ``torch.ops.custom.npu_quant_lightning_indexer`` with ``cmp_ratio`` 4 over the paged
  ``li_cmp_kv`` (``modules/indexer.py:254-321``); the attention is
  ``torch.ops.custom.npu_sparse_attn_sharedkv`` with the window, the compressed cache, the
  CSA selection and ``sinks`` (:820, :1346-1411).

This module finds those constructs in the file being converted, each with its line, so a
refusal names what is actually there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import dotted_name, is_cache_receiver, method
from kvskill.analyzer.plan import CompressedSubFeature

_EMPTY = cst.Module(body=[])
SHAREDKV = "torch.ops.custom.npu_sparse_attn_sharedkv"
#: the framework builds its custom operators itself (ops/ascendc); the wheel has none of them
#: (kvskill's stand-in registers reference implementations under torch.ops.custom)
NOT_IN_WHEEL = "the framework's own operator, not in torch_npu 2.13.0"
#: custom-npu_sparse_attn_sharedkv.md:65 "ori_win_left ... 仅支持默认值127": the query and the
#: 127 tokens before it
SHAREDKV_WINDOW = 128
#: custom-npu_sparse_attn_sharedkv.md:59 and custom-npu_compressor.md:141 "支持4/128"
CMP_RATIOS = (4, 128)


def _code(node: cst.CSTNode) -> str:
    return _EMPTY.code_for_node(node).strip()


@dataclass(frozen=True, kw_only=True)
class _Found:
    construct: str
    line: int
    owner: str


def _calls(node: cst.CSTNode, attr: str) -> list[cst.Call]:
    return [
        cst.ensure_type(c, cst.Call)
        for c in m.findall(node, m.Call(func=m.Attribute(attr=m.Name(attr))))
    ]


class SourceReader:
    """The modeling file's classes with the line of each node."""

    def __init__(self, source: str) -> None:
        wrapper = cst.metadata.MetadataWrapper(cst.parse_module(source))
        self._positions = wrapper.resolve(cst.metadata.PositionProvider)
        self.classes = {c.name.value: c for c in wrapper.module.body if isinstance(c, cst.ClassDef)}

    def line(self, node: cst.CSTNode) -> int:
        return self._positions[node].start.line

    def first(
        self,
        attr: str,
        owners: list[str],
        method_name: str | None = None,
        receiver: Callable[[str], bool] = lambda _: True,
    ) -> _Found | None:
        """The first ``<x>.<attr>(...)`` call in OWNERS (in their METHOD_NAME when given) whose
        receiver ``<x>`` RECEIVER accepts."""
        for owner in owners:
            cls = self.classes.get(owner)
            scope = method(cls, method_name) if cls is not None and method_name else cls
            for call in _calls(scope, attr) if scope is not None else []:
                func = cst.ensure_type(call.func, cst.Attribute)
                if receiver(dotted_name(func.value)):
                    return _Found(construct=_code(call), line=self.line(call), owner=owner)
        return None

    def first_name(
        self, name: str, owners: list[str], method_name: str | None = None
    ) -> _Found | None:
        """The first use of the bare name NAME (``name(...)`` or ``x = name``) in OWNERS (in
        their METHOD_NAME when given), its construct the statement line it sits on."""
        for owner in owners:
            cls = self.classes.get(owner)
            scope = method(cls, method_name) if cls is not None and method_name else cls
            for stmt in m.findall(scope, m.SimpleStatementLine()) if scope is not None else []:
                if m.findall(stmt, m.Name(name)):
                    return _Found(construct=_code(stmt), line=self.line(stmt), owner=owner)
        return None

    def defining(self, method_name: str) -> list[str]:
        """Classes that define METHOD_NAME themselves, in file order."""
        return [name for name, cls in self.classes.items() if method(cls, method_name)]

    def holders(self, attr: str) -> list[str]:
        """Classes that call ``<x>.<attr>(...)`` anywhere, in file order."""
        return [name for name, cls in self.classes.items() if _calls(cls, attr)]


def _ratio_key(cls: cst.ClassDef) -> str | None:
    """The layer type whose ratio the class reads: ``config.compress_rates["<type>"]``."""
    for sub in m.findall(cls, m.Subscript(value=m.Attribute(attr=m.Name("compress_rates")))):
        index = cst.ensure_type(sub, cst.Subscript).slice[0].slice
        if isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString):
            return index.value.evaluated_value
    return None


def compressed_features(
    source: str,
    file_name: str,
    attention: str,
    *,
    head_dim: int,
    ratios: dict[str, int],
    sinks_line: int | None,
    window: int = SHAREDKV_WINDOW,
) -> list[CompressedSubFeature]:
    """Each sub-feature of ATTENTION's compressed attention found in SOURCE, with its verdict.

    RATIOS maps the config's layer types to their compress ratio (CSA 4, HCA 128); WINDOW is
    the config's ``sliding_window``. A value the operators do not take is named as the limit.
    """
    reader = SourceReader(source)

    def where(line: int) -> str:
        return f"{file_name}:{line}"

    found: list[CompressedSubFeature] = []
    update = reader.first("update", [attention], "forward", is_cache_receiver)
    if update is not None:
        call = cst.parse_expression(update.construct)
        args = cst.ensure_type(call, cst.Call).args
        shared = len(args) >= 2 and _code(args[0].value) == _code(args[1].value)
        found.append(
            CompressedSubFeature(
                name="window",
                construct=update.construct,
                where=where(update.line),
                needs=(
                    "the write: npu_scatter_nd_update_ into win_kv at slot_mapping"
                    + (", one cache for K = V" if shared else "")
                    + f"; the read: {SHAREDKV} (ori_kv, a 128-token window), {NOT_IN_WHEEL}"
                ),
                missing="; ".join(
                    ([] if shared else ["the window keeps separate keys and values; win_kv holds one K = V row"])
                    + (
                        [f"{SHAREDKV} takes a {SHAREDKV_WINDOW}-token window only (ori_win_left 127), the config's sliding_window is {window}"]
                        if window != SHAREDKV_WINDOW
                        else []
                    )
                ),
            )
        )  # fmt: skip
    if sinks_line is not None:
        found.append(
            CompressedSubFeature(
                name="sinks",
                construct="self.sinks",
                where=where(sinks_line),
                needs=(
                    f"{SHAREDKV}(sinks=...) in the same softmax (the wheel's FA v2 "
                    f"learnable_sink needs value d <= 128, head_dim is {head_dim})"
                ),
            )
        )
    # the cache layer classes define the method; the compressors (and the CSA indexer's own
    # compressor) call it on their cache layer
    compressors = reader.holders("store_compression_weights")
    state = reader.first("store_compression_weights", compressors)
    overlap = reader.first("update_overlap_state", compressors)
    if state is not None:
        owners = ", ".join(compressors)
        found.append(
            CompressedSubFeature(
                name="compressor state",
                construct=f"{state.construct.split('(')[0]}(...) in {owners}",
                where=where(state.line),
                needs=(
                    f"torch.ops.custom.compressor ({NOT_IN_WHEEL}) over per-request "
                    "SlidingWindow state rows (sfa_kv_state / li_kv_state, float32 [kv | score], "
                    "state_block_table)"
                    + (
                        f", coff 2 for the overlapping windows ({overlap.owner}: "
                        f"{overlap.construct.split('(')[0]}(...) at {where(overlap.line)})"
                        if overlap
                        else ""
                    )
                ),
                missing="; ".join(
                    f"torch.ops.custom.compressor takes cmp_ratio "
                    f"{' or '.join(map(str, CMP_RATIOS))} only, {layer_type} has {ratio}"
                    for layer_type, ratio in sorted(ratios.items())
                    if ratio > 1 and ratio not in CMP_RATIOS
                ),
            )
        )
    indexer = reader.first("topk", [n for n in compressors if method(reader.classes[n], "forward")])
    if indexer is not None:
        csa = ratios.get("compressed_sparse_attention", 4)
        found.append(
            CompressedSubFeature(
                name="CSA indexer",
                construct=f"{indexer.owner}: {indexer.construct}",
                where=where(indexer.line),
                # npu_lightning_indexer takes no cmp_ratio, but its causal limit is per batch
                # row: one row per query token with key length (p + 1) // ratio is the
                # source's per-token limit (tests/runtime/test_v4_paged_reads.py); the
                # framework's cmp_ratio indexer, npu_quant_lightning_indexer, scores int8
                needs=(
                    f"the wheel's npu_lightning_indexer over the paged li_cmp_kv, one batch row "
                    f"per query token with key length (p + 1) // {csa}, scale in the weights"
                ),
            )
        )
    hca = [
        n
        for n in compressors
        if _ratio_key(reader.classes[n]) == "heavily_compressed_attention"
        and not _calls(reader.classes[n], "update_overlap_state")
    ]
    if hca:
        cls = reader.classes[hca[0]]
        ratio = ratios.get("heavily_compressed_attention", 128)
        found.append(
            CompressedSubFeature(
                name="HCA",
                construct=f"class {hca[0]}",
                where=where(reader.line(cls)),
                needs=f"{SHAREDKV}(cmp_kv=..., cmp_ratio={ratio}) over every readable entry",
            )
        )
    return found


#: the sub-features each layer kind needs the file to have
EXPECTED = {
    "sliding_attention": ("window",),
    "compressed_sparse_attention": ("window", "compressor state", "CSA indexer"),
    "heavily_compressed_attention": ("window", "compressor state", "HCA"),
}
#: custom-npu_sparse_attn_sharedkv.md:27 (N1 64), :85 (D 512), :37 (K2 512): what the device's
#: attention takes; a twin shrunk below them is checked on the CPU only
SHAREDKV_HEADS, SHAREDKV_HEAD_DIM, SHAREDKV_TOPK = 64, 512, 512


def blockers(features: list[CompressedSubFeature], layer_types: list[str]) -> list[str]:
    """What stops the paged rewrite: a limit a sub-feature hits, or a sub-feature the config's
    layer kinds need that the file does not have (its code is not the shape rewritten)."""
    found = {f.name for f in features}
    needed = sorted({n for t in layer_types for n in EXPECTED.get(t, ())} - found)
    return [f"{f.name} ({f.where}): {f.missing}" for f in features if f.missing] + [
        f"no {name} construct found for the config's layers" for name in needed
    ]


def operator_limits(heads_per_rank: int, head_dim: int, topk: int | None) -> list[str]:
    """The device attention's fixed sizes the real config misses."""
    limits = []
    if heads_per_rank != SHAREDKV_HEADS:
        limits.append(
            f"operator limit: {SHAREDKV} takes {SHAREDKV_HEADS} query heads per rank, the "
            f"config has {heads_per_rank} (--attn-tp-size splits them)"
        )
    if head_dim != SHAREDKV_HEAD_DIM:
        limits.append(
            f"operator limit: {SHAREDKV} takes head_dim {SHAREDKV_HEAD_DIM}, the config has "
            f"{head_dim}"
        )
    if topk is not None and topk != SHAREDKV_TOPK:
        limits.append(
            f"operator limit: {SHAREDKV} takes a CSA top-k of {SHAREDKV_TOPK}, the config's "
            f"index_topk is {topk}"
        )
    return limits


def converted_attention(source: str, file_name: str) -> str | None:
    """``Class (file:line)`` of an attention kvskill already converted (it assigns ``self.win_kv``
    and reads with ``npu_sparse_attn_sharedkv``), else None."""
    reader = SourceReader(source)
    for name, cls in reader.classes.items():
        init = method(cls, "__init__")
        wins = (
            m.findall(
                init,
                m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name("win_kv"))),
            )
            if init
            else []
        )
        if wins and _calls(cls, "npu_sparse_attn_sharedkv"):
            return f"{name} ({file_name}:{reader.line(wins[0])})"
    return None  # fmt: skip


def features_text(features: list[CompressedSubFeature]) -> str:
    """``window (modeling_x.py:836 cache.update(kv, kv, ...)) -> <needs>; ...`` on one line."""
    return "; ".join(f"{f.name} ({f.where} {_short(f.construct)}) -> {f.needs}" for f in features)


def _short(construct: str, limit: int = 120) -> str:
    flat = " ".join(construct.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."

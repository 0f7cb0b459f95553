"""What the MLA codemods need from a Plan, validated once at the boundary.

The fused operator's MLA path has hard limits (npu_ops §1.8): rope head dim 64, query head
dim (here ``kv_lora_rank``, the absorbed query of the decode steps) 512 or 128, one key head.
A Plan outside them is refused here, before anything is rewritten, instead of emitting code
that fails on the device. (Prefill steps are not absorbed: npu_ops §9.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvskill.analyzer.indexer import layer_spans
from kvskill.analyzer.plan import (
    AttentionKind,
    FaVersion,
    InputLayout,
    KvMode,
    MlaCacheWrite,
    Plan,
)
from kvskill.core import npu_limits
from kvskill.core.attn_types import AttnType
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.implementer.spec import pinned_state_dtypes

MLA_ROPE_DIM = npu_limits.MLA_ROPE_DIM
MLA_QUERY_DIMS = npu_limits.MLA_LATENT_DIMS
#: block sizes of the MLA paths are multiples of 16 (NZ C0 for fp16/bf16; npu_ops §1.7, §4)
MLA_BLOCK_SIZE = 16


def check_mla_block_size(block_size: int | None) -> None:
    """A block size the MLA caches take (a multiple of MLA_BLOCK_SIZE), or None (default).

    Raises:
        BadInputError: another size.
    """
    if block_size is not None and block_size % MLA_BLOCK_SIZE:
        raise BadInputError(
            f"--block-size {block_size}: the MLA caches need a multiple of {MLA_BLOCK_SIZE} (the "
            "fused attention pages MLA caches in blocks of 16k, ND or NZ)"
        )


#: the sparse modes the MLA path emits: causal prefill (un-absorbed), dense absorbed decode
MLA_SPARSE_MODE = {"prefill": 3, "decode": 0}
#: with a DSA indexer both steps run the sparse attention, causal (bottom-right) in both
DSA_SPARSE_MODE = {"prefill": 3, "decode": 3}


@dataclass(frozen=True, kw_only=True)
class IndexerSpec:
    """The DSA indexer the codemods page: its key cache entry. The top-k is the config's
    (``self.index_topk`` in the converted code), checked against the operator's range by
    ``MlaSpec.from_plan`` (``_check_supported``)."""

    key_cache: str
    #: whether some layers reuse another layer's top-k and keep no key cache (GLM-5)
    shared_layers: bool = False
    #: tokens per scored key (GLM-5.3's ``index_kpool``; 1: one key per token). Pooled keys
    #: are a compressed entry (``compress_ratio`` = pool_size) beside the open pool's state rows
    pool_size: int = 1

    @property
    def sparse_count(self) -> str:
        """The converted code's expression of the operators' ``sparse_count``."""
        return "self.index_topk // self.index_kpool" if self.pool_size > 1 else "self.index_topk"


#: how the latent reaches the caches: the Plan's ``mla_cache_write`` (one enum for both)
CacheWrite = MlaCacheWrite


@dataclass(frozen=True, kw_only=True)
class MlaSpec:
    """Everything the MLA codemods emit that depends on the analyzer's decisions."""

    fa_version: FaVersion
    input_layout: str
    attn_type: str
    #: {"prefill": 3, "decode": 0}
    sparse_mode: dict[str, int]
    cache_write: CacheWrite
    attn_tp_size: int = 1
    block_size: int = 128
    #: whether some layers are recurrent-state (Mamba group) layers (Kimi Linear's KDA)
    has_state_layers: bool = False
    #: {state name: dtype name} of the recurrent states the Plan pins (ConversionSpec's)
    pinned_state_dtypes: dict[str, str] = field(default_factory=dict)
    #: the DSA indexer (indexed sparse attention), None for dense MLA
    indexer: IndexerSpec | None = None
    #: whether some layers have no rope part (NoPE layers): their rope query and key are
    #: zero-padded to the caches' rope width
    nope_layers: bool = False
    #: whether no layer has a rope part (qk_rope_head_dim 0): no rope cache is kept, the
    #: operator's rope inputs are zeros made at call time
    rope_less: bool = False
    #: whether the config proves every layer attends to its own latent (``kv_source_layers``
    #: naming no other layer): then a hand-off of the latent to later layers inside the seam
    #: (``shared_kv_states[...] = ...``) has no reader and is dropped with the seam
    own_latent_only: bool = False

    @classmethod
    def from_plan(
        cls, plan: Plan, *, fa_version: str = "auto", block_size: int | None = None
    ) -> MlaSpec:
        """Validate an MLA Plan and extract the emitted values.

        Raises:
            UnsupportedModelError: the Plan is not MLA, or its dims break the operator limits.
        """
        _check_supported(plan)
        pool = plan.indexer.pool_size if plan.indexer is not None else 1
        if (block_size or plan.block_size) % pool:
            raise BadInputError(
                f"--block-size {block_size or plan.block_size}: index_kpool {pool} does not "
                "divide it; a block must hold whole pools (one pooled key row each)"
            )
        modes = plan.sparse_mode[AttnType.FULL_ATTENTION.value]
        return cls(
            fa_version=FaVersion(plan.fa_version if fa_version == "auto" else fa_version),
            input_layout=plan.input_layout,
            attn_type=AttnType.FULL_ATTENTION.value,
            sparse_mode={"prefill": modes.prefill, "decode": modes.decode},
            cache_write=CacheWrite(plan.mla_cache_write or CacheWrite.SCATTER.value),
            attn_tp_size=plan.attn_tp_size,
            block_size=block_size or plan.block_size,
            has_state_layers=AttnType.MAMBA.value in plan.layer_attn_types(),
            pinned_state_dtypes=pinned_state_dtypes(plan),
            nope_layers=bool(plan.mla and plan.mla.nope_layers),
            rope_less=plan.mla is not None and plan.mla.qk_rope_head_dim == 0,
            own_latent_only=plan.mla is not None and plan.mla.reused_latent == {},
            indexer=(
                IndexerSpec(
                    key_cache=plan.indexer.key_cache,
                    shared_layers=bool(plan.indexer.shared_layers),
                    pool_size=plan.indexer.pool_size,
                )
                if plan.indexer is not None
                else None
            ),
        )


def _check_supported(plan: Plan) -> None:
    reasons: list[str] = list(plan.implementer_blockers)
    if plan.attention is not AttentionKind.MLA or not plan.mla_absorb or not plan.mla:
        reasons.append(
            f"attention is {plan.attention.value!r} with mla_absorb={plan.mla_absorb}; the MLA "
            "rewrite needs an absorbed MLA Plan"
        )
    if plan.kv_mode is not KvMode.PAGED:
        reasons.append(f"kv_mode is {plan.kv_mode.value!r}; only paged is rewritten")
    if plan.input_layout is not InputLayout.TND_NTD:
        reasons.append(f"input_layout {plan.input_layout.value!r}; absorbed MLA uses TND_NTD")
    kinds = {str(AttnType(t).value) for t in plan.layer_attn_types()}
    sliding = [layer.index for layer in plan.layers if layer.attn_type is AttnType.SLIDING_WINDOW]
    if sliding:
        # NOTE: the fused attention documents a band on the absorbed latent (v1 ›
        # query_rope和key_rope参数约束 › sparse为4时: 128 query heads, D 512, BSND, ND cache)
        # and on the un-absorbed TND prompt (Q_D = K_D = 192); neither is emitted yet
        reasons.append(
            f"MLA layers {layer_spans(sliding)} are SlidingWindow{_window_site(plan)}: the MLA "
            "rewrite emits no windowed latent attention (sparse_mode 4 with pre_tokens on the "
            "absorbed latent or the decompressed prompt); only FullAttention MLA layers are "
            "rewritten"
        )
    elif AttnType.FULL_ATTENTION.value not in kinds or kinds - {
        AttnType.FULL_ATTENTION.value,
        AttnType.MAMBA.value,
    }:
        reasons.append(
            f"layers of attn_type {sorted(kinds)}; MLA layers are FullAttention (between "
            "them only recurrent-state Mamba layers)"
        )
    if plan.indexer is not None and plan.indexer.dense_layers:
        reasons.append(
            f"MLA layers {layer_spans(plan.indexer.dense_layers)} run no DSA indexer beside the "
            f"indexed layers {layer_spans(plan.indexer.layers)}: the DSA rewrite reads every MLA "
            "layer through an indexer's top-k (or a shared one), none densely"
        )
    if AttnType.MAMBA.value in kinds and plan.attn_tp_size != 1:
        reasons.append(
            f"attn_tp_size {plan.attn_tp_size} with recurrent-state (Mamba) layers; their "
            "states are not split over ranks yet"
        )
    modes = plan.sparse_mode.get(AttnType.FULL_ATTENTION.value)
    found = {"prefill": modes.prefill, "decode": modes.decode} if modes else {}
    if plan.indexer is not None:
        if found != DSA_SPARSE_MODE:
            reasons.append(
                f"sparse_mode {found}; the DSA sparse attention needs 3 (causal) in prefill "
                "and decode"
            )
        pool = plan.indexer.pool_size
        if not npu_limits.sparse_count_allowed(plan.indexer.topk // pool):
            reasons.append(
                f"index_topk {plan.indexer.topk}"
                + (f" // index_kpool {pool}" if pool > 1 else "")
                + "; npu_lightning_indexer keeps 1.."
                f"{npu_limits.SPARSE_COUNT_MAX_RANGE} or one of "
                f"{list(npu_limits.SPARSE_COUNT_EXTRA)} positions (sparse_count)"
            )
    elif found != MLA_SPARSE_MODE:
        reasons.append(
            f"sparse_mode {found}; absorbed MLA needs prefill 3 (causal, 2048 mask) and "
            "decode 0 (no mask)"
        )
    if plan.mla:
        rope = plan.mla.qk_rope_head_dim
        rank = plan.mla.kv_lora_rank
        if rope == 0 and plan.indexer is None:
            reasons.append(
                "qk_rope_head_dim is 0 on dense MLA; the zero rope inputs of a rope-less latent "
                "are emitted on the DSA path only"
            )
        elif rope not in (0, MLA_ROPE_DIM):
            reasons.append(f"qk_rope_head_dim is {rope}; the fused MLA attention needs 64")
        if rank not in MLA_QUERY_DIMS:
            reasons.append(
                f"kv_lora_rank is {rank}; the absorbed query head dim must be 512 or 128"
            )
    if plan.mla and plan.mla.nope_layers:
        # the zero rope inputs of NoPE layers are written in the DSA seam's scatter path only
        if plan.indexer is None:
            reasons.append(
                f"NoPE layers {plan.mla.nope_layers} (no rope part) on dense MLA; their zero "
                "rope query and key are emitted on the DSA path only"
            )
        if plan.mla_cache_write and CacheWrite(plan.mla_cache_write) is CacheWrite.FUSED:
            reasons.append(
                f"NoPE layers {plan.mla.nope_layers} with the fused latent write: "
                "npu_kv_rmsnorm_rope_cache rotates a 64-wide rope key, which these layers lack"
            )
    if reasons:
        raise UnsupportedModelError(f"{plan.model_type}: cannot convert: " + "; ".join(reasons))


def _window_site(plan: Plan) -> str:
    """`` (Cls at file:line sets self.sliding_window, passed at file:line)`` from the Plan's
    code facts, or "" when no attention class sets one."""
    code = plan.code or {}
    for name, facts in (code.get("attention") or {}).items():
        line = facts.get("sliding_window_line")
        if line:
            where = code.get("modeling_file", "")
            call = facts.get("attention_call_line")
            passed = f", passed to its kernel at {where}:{call}" if call else ""
            return f" ({name} sets self.sliding_window at {where}:{line}{passed})"
    return ""

"""Per-step attention metadata and the scoped context that carries it to every layer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from torch import Tensor


@dataclass(slots=True)
class ForwardMetaData:
    """What one forward step tells the converted attention layers.

    Requests are packed: T = sum of this step's query tokens, no padding. Per-request lists
    are in batch order. Block tables and slot mappings are keyed by group key (the
    ``attn_type`` unless a ``manager_key`` was set).
    """

    is_prefill: bool
    #: tokens in the cache per request after this step, int64 [B]
    kv_len: Tensor
    #: query tokens per request this step
    actual_seq_lengths_q: list[int]
    #: kv tokens per request after this step (context + new); per request, NOT cumulative
    actual_seq_lengths_kv: list[int]
    #: cumulative query lengths, no leading 0, last = T (TND ``actual_seq_lengths``)
    actual_seq_lengths_cu_q: list[int]
    #: cumulative kv lengths, no leading 0
    actual_seq_lengths_cu_kv: list[int]
    #: group key -> int32 [B, max_blocks], padded with the null block 0
    block_table: dict[str, Tensor]
    #: group key -> int64 [T], physical slot of every token of this step
    slot_mapping: dict[str, Tensor]
    #: prompt length per request
    prompt_tokens: list[int]
    #: T
    num_tokens: int
    #: bool [2048, 2048], True = masked (``triu(diagonal=1)``), for sparse_mode 2/3/4
    attention_mask: Tensor | None = None
    #: extras some layers read: the engine always sets "has_initial_state" (bool [B], the
    #: request already has tokens in the cache), which converted state layers require
    extra: dict[str, object] = field(default_factory=dict)


_current: ContextVar[ForwardMetaData | None] = ContextVar("kvskill_forward_md", default=None)


@contextmanager
def forward_context(metadata: ForwardMetaData) -> Iterator[ForwardMetaData]:
    """Make ``metadata`` visible to ``get_forward_metadata`` inside the block.

    The previous value is restored on exit, even when the forward raises, so nested or
    failed steps never leak metadata into the next one.
    """
    token = _current.set(metadata)
    try:
        yield metadata
    finally:
        _current.reset(token)


def get_forward_metadata() -> ForwardMetaData:
    """The metadata of the step being run.

    Raises:
        RuntimeError: when called outside ``forward_context`` (the model was run without
            the runtime, e.g. by plain ``model(...)``).
    """
    md = _current.get()
    if md is None:
        raise RuntimeError(
            "no forward metadata: this converted model must run inside "
            "kvskill.runtime.forward_context(...) (use kvskill.runtime.LLM or the engine)"
        )
    return md

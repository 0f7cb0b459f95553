"""Per-step attention metadata, and how every layer reads it.

``ForwardMetaData`` and ``get_forward_metadata`` / ``set_forward_metadata`` /
``reset_forward_metadata`` equal the Ascend framework's (hicann/cann-recipes-infer at
``fbc225d``, ``executor/utils/forward_metadata.py``) field for field and in meaning, so a
converted layer reads the same fields in either host. The framework keeps one module-level
value; kvskill keeps it in a context variable so ``forward_context`` can scope a step and
restore the previous value, even when the forward raises.

Field meanings (requests packed, T = sum of this step's query tokens, tensors int64 [B]):

- ``actual_seq_lengths_q`` query tokens per request; ``actual_seq_lengths_kv`` kv tokens per
  request after this step (context + new), per request, NOT cumulative;
- ``actual_seq_lengths_cu_q`` / ``_cu_kv`` their running sums, no leading 0 (the TND form);
- ``*_list_*`` the same as Python lists, for captured graphs (the framework fills them for
  decode steps only; kvskill's runtime fills them for every step);
- ``kv_len`` tokens already in the cache before this step (in a decode step, the position of
  the new token), as the framework's decode steps set it;
- ``prompt_tokens`` the tokens a prefill step computes, T (0 in decode).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor


@dataclass
class PrefillCPMetaData:
    """Context-parallel metadata of a prefill step (the framework's; kvskill's runtime runs
    no context parallelism and leaves ``ForwardMetaData.cp_metadata`` None)."""

    enabled: bool = False
    cp_size: int = 1
    global_padded_token_num: int = 0
    local_token_num: int = 0
    local_indices: Tensor | None = None
    restore_indices: Tensor | None = None
    global_valid_indices: Tensor | None = None
    global_slot_mapping: dict[str, Tensor] | None = None
    global_block_table: dict[str, Tensor] | None = None
    persistent_valid_indices: Tensor | None = None
    persistent_slot_mapping: dict[str, Tensor] | None = None
    output_request_indices: Tensor | None = None
    actual_seq_q_prev: Tensor | None = None
    actual_seq_q_next: Tensor | None = None
    kv_len_prev: Tensor | None = None
    kv_len_next: Tensor | None = None
    local_prev_token_num: int = 0
    local_next_token_num: int = 0


@dataclass
class ForwardMetaData:
    """What one forward step tells the converted attention layers (see the module doc)."""

    is_prefill: bool = False
    is_warm_up: bool = False
    #: bool [2048, 2048], True = masked (``triu(diagonal=1)``), for sparse_mode 2/3/4
    attention_mask: Tensor | None = None
    kv_len: Tensor | None = None
    actual_seq_lengths_kv: Tensor | None = None
    actual_seq_lengths_q: Tensor | None = None
    actual_seq_lengths_cu_kv: Tensor | None = None
    actual_seq_lengths_cu_q: Tensor | None = None
    actual_seq_lengths_cu_list_kv: list | None = None
    actual_seq_lengths_cu_list_q: list | None = None
    actual_seq_lengths_list_kv: list | None = None
    actual_seq_lengths_list_q: list | None = None
    prompt_tokens: int = 0
    #: group key -> int32 [B, max_blocks], padded with the null block
    block_table: dict[str, Tensor] | None = None
    #: group key -> int64 [T], physical slot of every token of this step (none for Mamba)
    slot_mapping: dict[str, Tensor] | None = None
    cp_metadata: PrefillCPMetaData | None = None


#: None until a step sets it: reads then see fresh defaults, so nothing can mutate a shared one
_current: ContextVar[ForwardMetaData | None] = ContextVar("kvskill_forward_md", default=None)


#: the metadata of the step torch.compile is tracing (dynamo cannot read a context variable);
#: set only by ``captured_forward_context`` inside the compiled step
_captured: list[ForwardMetaData | None] = [None]


def get_forward_metadata() -> ForwardMetaData:
    """The metadata of the step being run; outside any step, empty defaults (as the
    framework's, whose warm-up reads them)."""
    if torch.compiler.is_compiling():
        md = _captured[0]
    else:
        md = _current.get()
    return ForwardMetaData() if md is None else md


def set_forward_metadata(**fields) -> None:
    """Replace the named fields of the current metadata (``dataclasses.replace``)."""
    _current.set(replace(get_forward_metadata(), **fields))


def reset_forward_metadata() -> None:
    """Back to empty defaults."""
    _current.set(None)


@contextmanager
def forward_context(metadata: ForwardMetaData) -> Iterator[ForwardMetaData]:
    """Make ``metadata`` the current metadata inside the block, and restore the previous one
    on exit, even when the forward raises, so a failed step never leaks into the next."""
    token = _current.set(metadata)
    try:
        yield metadata
    finally:
        _current.reset(token)


#: (live rows, padded rows) of the captured step being traced: set only by
#: ``captured_forward_context`` when the caller padded its batch (kvskill's own; the
#: framework's metadata has no such field)
_captured_rows: list[tuple[Any, int] | None] = [None]


@contextmanager
def captured_forward_context(
    metadata: ForwardMetaData, *, live_rows: Any = None, padded_rows: int = 0
) -> Iterator[ForwardMetaData]:
    """``forward_context`` for a step being compiled: the layers read METADATA through a
    module-level slot that dynamo can trace (a graph input, like the step's tensors).

    LIVE_ROWS (an int traced from a tensor, so it changes without a recompile) of the
    PADDED_ROWS token rows of the step are real; ``live_rows_of`` hands it to the CPU fast
    paths, which then skip the arithmetic of the others."""
    previous, previous_rows = _captured[0], _captured_rows[0]
    _captured[0] = metadata
    _captured_rows[0] = None if live_rows is None else (live_rows, padded_rows)
    try:
        yield metadata
    finally:
        _captured[0], _captured_rows[0] = previous, previous_rows


def live_rows_of(rows: Any) -> Any:
    """How many leading rows of a ROWS-row activation the captured step being traced needs
    computed: its live count when ROWS is the step's padded batch (a row per token, requests
    in order, as every token-wise layer of a decode step has them), else ROWS (all). Outside
    a traced step, ROWS.

    A tensor with another row count (e.g. a mixture-of-experts' gathered tokens, whose count
    is itself traced) is left whole: its rows are not the step's requests."""
    padded = _captured_rows[0] if torch.compiler.is_compiling() else None
    if padded is None or not isinstance(rows, int) or rows != padded[1]:
        return rows
    return padded[0]


def in_paged_step() -> bool:
    """True inside a step of a paged host (its block tables are set)."""
    return get_forward_metadata().block_table is not None


def step_metadata(
    *,
    is_prefill: bool,
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_table: dict[str, Tensor],
    slot_mapping: dict[str, Tensor],
    attention_mask: Tensor | None,
    device: torch.device | str,
) -> ForwardMetaData:
    """The metadata of a step from each request's query and kv lengths (after the step)."""
    q_lens, kv_lens = list(q_lens), list(kv_lens)
    cu_q, cu_kv = list(accumulate(q_lens)), list(accumulate(kv_lens))
    lengths = torch.tensor(
        [q_lens, kv_lens, cu_q, cu_kv, [k - q for q, k in zip(q_lens, kv_lens, strict=True)]],
        dtype=torch.int64,
    ).to(device)
    return ForwardMetaData(
        is_prefill=is_prefill,
        attention_mask=attention_mask,
        kv_len=lengths[4],
        actual_seq_lengths_q=lengths[0],
        actual_seq_lengths_kv=lengths[1],
        actual_seq_lengths_cu_q=lengths[2],
        actual_seq_lengths_cu_kv=lengths[3],
        actual_seq_lengths_list_q=q_lens,
        actual_seq_lengths_list_kv=kv_lens,
        actual_seq_lengths_cu_list_q=cu_q,
        actual_seq_lengths_cu_list_kv=cu_kv,
        prompt_tokens=sum(q_lens) if is_prefill else 0,
        block_table=block_table,
        slot_mapping=slot_mapping,
    )

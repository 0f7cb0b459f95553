"""Build one step's packed model inputs and its ForwardMetaData from the scheduled requests.

Packed layout (a batch of one, no padding), e.g. a prefill of two prompts of 3 and 2
tokens, the first one with 4 tokens already cached (a chunked prefill)::

    request_index  0 0 0 1 1
    position_ids   4 5 6 0 1        -> input_ids / position_ids are [1, T=5]
    actual_seq_lengths_q  = [3, 2]      actual_seq_lengths_cu_q  = [3, 5]
    actual_seq_lengths_kv = [7, 2]      actual_seq_lengths_cu_kv = [7, 9]
    logits_indices        = [2, 4]      (last token of each request)

Per-token values are built as runs (one ``range`` per request, one per block touched for the
slot mapping) in typed arrays and wrapped as tensors without copying, so a step costs a few
tensor constructions whatever its batch: on a host CPU each tensor op costs microseconds,
which is what a decode step of a small model is made of.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import accumulate, chain

import torch
from kvskill.runtime.forward_context import ForwardMetaData, step_metadata
from kvskill.runtime.kv_cache_manager import KVCacheManager
from kvskill.runtime.scheduler import SchedulerOutput
from kvskill.runtime.tables import int64_tensor
from torch import Tensor


@dataclass(slots=True)
class StepInputs:
    input_ids: Tensor  #: int64 [1, T]
    position_ids: Tensor  #: int64 [1, T]
    logits_indices: Tensor  #: int64 [B], index of each request's last token in the packed T
    metadata: ForwardMetaData


def build_step_inputs(
    output: SchedulerOutput,
    kv_manager: KVCacheManager,
    *,
    attention_mask: Tensor | None,
    device: torch.device,
) -> StepInputs:
    """Assemble the tensors the model and the attention layers read for this step.

    The block tables and slot mappings come from ``kv_manager.step_tables``: the managers
    build them from the blocks they hold, so this module never reads their tables.
    """
    scheduled = output.scheduled
    requests = [s.request for s in scheduled]
    q_lens = [s.num_new_tokens for s in scheduled]
    starts = [s.start for s in scheduled]
    kv_lens = [s + q for s, q in zip(starts, q_lens, strict=True)]
    cu_q = list(accumulate(q_lens))
    is_decode = q_lens.count(1) == len(q_lens)  # every request feeds exactly one token

    if is_decode:
        token_ids = array("q", [r.token_at(p) for r, p in zip(requests, starts, strict=True)])
        positions = int64_tensor(starts)  # [T]
    else:
        token_ids = array("q")
        for r, p, q in zip(requests, starts, q_lens, strict=True):
            token_ids.extend(r.fed_token_ids(p, p + q))
        positions = int64_tensor(
            array("q", chain.from_iterable(map(range, starts, kv_lens)))
        )  # [T]

    tables = kv_manager.step_tables(
        [r.request_id for r in requests], starts=starts, num_new_tokens=q_lens
    )
    metadata = step_metadata(
        is_prefill=output.is_prefill,
        q_lens=q_lens,
        kv_lens=kv_lens,
        block_table={key: t.to(device) for key, t in tables.block_table.items()},
        slot_mapping={key: t.to(device) for key, t in tables.slot_mapping.items()},
        attention_mask=attention_mask,
        device=device,
    )
    return StepInputs(
        input_ids=int64_tensor(token_ids).unsqueeze(0).to(device),
        position_ids=positions.unsqueeze(0).to(device),
        logits_indices=int64_tensor([c - 1 for c in cu_q]).to(device),
        metadata=metadata,
    )

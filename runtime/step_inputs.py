"""Build one step's packed model inputs and its ForwardMetaData from the scheduled requests.

Packed layout (a batch of one, no padding), e.g. a prefill of two prompts of 3 and 2
tokens, the first one with 4 tokens already cached (a chunked prefill)::

    request_index  0 0 0 1 1
    position_ids   4 5 6 0 1        -> input_ids / position_ids are [1, T=5]
    actual_seq_lengths_q  = [3, 2]      actual_seq_lengths_cu_q  = [3, 5]
    actual_seq_lengths_kv = [7, 2]      actual_seq_lengths_cu_kv = [7, 9]
    logits_indices        = [2, 4]      (last token of each request)

Everything per token is computed with tensor ops; the only per-request Python work is
reading token ids and block ids out of the scheduler's records.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
from kvskill.runtime.forward_context import ForwardMetaData
from kvskill.runtime.scheduler import SchedulerOutput
from kvskill.runtime.tables import prepare_block_tables, prepare_slot_mapping
from torch import Tensor


@dataclass(slots=True)
class StepInputs:
    input_ids: Tensor  #: int64 [1, T]
    position_ids: Tensor  #: int64 [1, T]
    logits_indices: Tensor  #: int64 [B], index of each request's last token in the packed T
    metadata: ForwardMetaData


def build_step_inputs(
    output: SchedulerOutput,
    kv_manager,
    *,
    attention_mask: Tensor | None,
    device: torch.device,
) -> StepInputs:
    """Assemble the tensors the model and the attention layers read for this step."""
    scheduled = output.scheduled
    q_lens = [s.num_new_tokens for s in scheduled]
    starts = [s.start for s in scheduled]
    kv_lens = [s + q for s, q in zip(starts, q_lens, strict=True)]
    cu_q = list(accumulate(q_lens))
    cu_kv = list(accumulate(kv_lens))
    num_tokens = cu_q[-1]

    token_ids: list[int] = []
    for item in scheduled:
        token_ids.extend(item.request.token_ids_slice(item.start, item.start + item.num_new_tokens))

    # All index math on the host CPU tensors, then one copy each to the device.
    q_len_t = torch.tensor(q_lens, dtype=torch.int64)
    request_index = torch.repeat_interleave(torch.arange(len(scheduled)), q_len_t)  # [T]
    first_token = torch.tensor(cu_q, dtype=torch.int64) - q_len_t  # [B]
    offsets = torch.tensor(starts, dtype=torch.int64) - first_token  # [B]
    positions = torch.arange(num_tokens, dtype=torch.int64) + offsets[request_index]  # [T]

    block_table: dict[str, Tensor] = {}
    slot_mapping: dict[str, Tensor] = {}
    per_request = [kv_manager.get_block_ids(s.request.request_id) for s in scheduled]
    for key in kv_manager.group_keys:
        rows = [ids[key] for ids in per_request]
        # NOTE: the slot mapping indexes the flattened table, so a short row would silently
        # read the next request's blocks; check coverage here, where it is cheap.
        num_blocks_for = kv_manager.managers[key].num_blocks_for
        assert all(len(r) >= num_blocks_for(n) for r, n in zip(rows, kv_lens, strict=True)), (
            f"group {key!r}: a request's blocks do not cover its tokens; the KV manager "
            "allocated too few"
        )
        table = prepare_block_tables(rows)  # int32 [B, M]
        slots = prepare_slot_mapping(table, request_index, positions, kv_manager.block_size_of(key))
        block_table[key] = table.to(device)
        slot_mapping[key] = slots.to(device)

    metadata = ForwardMetaData(
        is_prefill=output.is_prefill,
        attention_mask=attention_mask,
        kv_len=torch.tensor(kv_lens, dtype=torch.int64, device=device),
        actual_seq_lengths_q=q_lens,
        actual_seq_lengths_kv=kv_lens,
        actual_seq_lengths_cu_q=cu_q,
        actual_seq_lengths_cu_kv=cu_kv,
        block_table=block_table,
        slot_mapping=slot_mapping,
        prompt_tokens=[s.request.num_prompt_tokens for s in scheduled],
        num_tokens=num_tokens,
        # Recurrent (Mamba) layers start from a zero state unless the request already has
        # tokens in the cache (a later prefill chunk, or a decode step): bool [B].
        extra={"has_initial_state": torch.tensor([s > 0 for s in starts], device=device)},
    )
    return StepInputs(
        input_ids=torch.tensor(token_ids, dtype=torch.int64).unsqueeze(0).to(device),
        position_ids=positions.unsqueeze(0).to(device),
        logits_indices=torch.tensor(cu_q, dtype=torch.int64, device=device) - 1,
        metadata=metadata,
    )

"""Forward context scoping and the compressed attention mask."""

import pytest
import torch
from kvskill.runtime import (
    ForwardMetaData,
    forward_context,
    get_forward_metadata,
    get_init_attn_mask,
    reset_forward_metadata,
    set_forward_metadata,
    step_metadata,
)
from kvskill.runtime.forward_context import in_paged_step


def _md(num_tokens: int) -> ForwardMetaData:
    return step_metadata(
        is_prefill=True,
        q_lens=[num_tokens],
        kv_lens=[num_tokens],
        block_table={"FullAttention": torch.zeros(1, 1, dtype=torch.int32)},
        slot_mapping={"FullAttention": torch.arange(num_tokens)},
        attention_mask=None,
        device="cpu",
    )


def _is_empty(md: ForwardMetaData) -> bool:
    return md == ForwardMetaData()


def test_metadata_is_scoped_and_restored_even_on_error():
    # outside a step: fresh defaults, as the framework's module-level value starts
    assert _is_empty(get_forward_metadata()) and not in_paged_step()
    assert get_forward_metadata() is not get_forward_metadata()
    outer, inner = _md(3), _md(5)
    with forward_context(outer):
        assert get_forward_metadata() is outer
        with pytest.raises(ValueError), forward_context(inner):
            assert get_forward_metadata() is inner
            raise ValueError("forward failed")
        assert get_forward_metadata() is outer and in_paged_step()
    assert _is_empty(get_forward_metadata())


def test_set_and_reset_replace_fields_as_the_framework_does():
    with forward_context(_md(3)):
        before = get_forward_metadata()
        set_forward_metadata(is_prefill=False, kv_len=torch.tensor([3]))
        after = get_forward_metadata()
        assert after is not before and before.is_prefill  # replaced, not mutated
        assert not after.is_prefill and after.kv_len.tolist() == [3]
        assert after.block_table is before.block_table
        reset_forward_metadata()
        assert _is_empty(get_forward_metadata())
    assert _is_empty(get_forward_metadata())


def test_step_metadata_fills_tensors_and_list_twins():
    md = step_metadata(
        is_prefill=True,
        q_lens=[3, 2],
        kv_lens=[7, 2],
        block_table={},
        slot_mapping={},
        attention_mask=None,
        device="cpu",
    )
    assert md.actual_seq_lengths_cu_q.tolist() == md.actual_seq_lengths_cu_list_q == [3, 5]
    assert md.actual_seq_lengths_cu_kv.tolist() == md.actual_seq_lengths_cu_list_kv == [7, 9]
    assert md.actual_seq_lengths_q.dtype == torch.int64
    assert md.kv_len.tolist() == [4, 0] and md.prompt_tokens == 5 and md.cp_metadata is None


@pytest.mark.parametrize("kind", ["causal", "band"])
def test_mask_is_bool_upper_triangle(kind):
    mask = get_init_attn_mask(2048, kind=kind)
    assert mask.shape == (2048, 2048) and mask.dtype == torch.bool
    i, j = torch.meshgrid(torch.arange(2048), torch.arange(2048), indexing="ij")
    assert torch.equal(mask, j > i)


def test_mask_kind_is_checked():
    with pytest.raises(ValueError, match="causal"):
        get_init_attn_mask(8, kind="sliding")

"""Forward context scoping and the compressed attention mask."""

import pytest
import torch
from kvskill.runtime import (
    ForwardMetaData,
    forward_context,
    get_forward_metadata,
    get_init_attn_mask,
)


def _md(num_tokens: int) -> ForwardMetaData:
    return ForwardMetaData(
        is_prefill=True,
        kv_len=torch.tensor([num_tokens]),
        actual_seq_lengths_q=[num_tokens],
        actual_seq_lengths_kv=[num_tokens],
        actual_seq_lengths_cu_q=[num_tokens],
        actual_seq_lengths_cu_kv=[num_tokens],
        block_table={"FullAttention": torch.zeros(1, 1, dtype=torch.int32)},
        slot_mapping={"FullAttention": torch.arange(num_tokens)},
        prompt_tokens=[num_tokens],
        num_tokens=num_tokens,
    )


def test_metadata_is_scoped_and_restored_even_on_error():
    with pytest.raises(RuntimeError, match="forward_context"):
        get_forward_metadata()
    outer, inner = _md(3), _md(5)
    with forward_context(outer):
        assert get_forward_metadata() is outer
        with pytest.raises(ValueError), forward_context(inner):
            assert get_forward_metadata() is inner
            raise ValueError("forward failed")
        assert get_forward_metadata() is outer
    with pytest.raises(RuntimeError):
        get_forward_metadata()


@pytest.mark.parametrize("kind", ["causal", "band"])
def test_mask_is_bool_upper_triangle(kind):
    mask = get_init_attn_mask(2048, kind=kind)
    assert mask.shape == (2048, 2048) and mask.dtype == torch.bool
    i, j = torch.meshgrid(torch.arange(2048), torch.arange(2048), indexing="ij")
    assert torch.equal(mask, j > i)


def test_mask_kind_is_checked():
    with pytest.raises(ValueError, match="causal"):
        get_init_attn_mask(8, kind="sliding")

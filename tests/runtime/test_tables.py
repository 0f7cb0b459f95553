"""Block tables, token positions and slot mappings against the formula."""

import pytest
import torch
from kvskill.runtime import prepare_block_tables, prepare_slot_mapping, prepare_token_positions


def test_docstring_example():
    table = prepare_block_tables([[7, 2], [5]])
    assert table.dtype == torch.int32
    assert table.tolist() == [[7, 2], [5, 0]]
    request_index, positions = prepare_token_positions(torch.tensor([6, 2]), torch.tensor([1, 1]))
    assert prepare_slot_mapping(table, request_index, positions, 4).tolist() == [10, 22]


def test_pad_to_and_empty_rows():
    table = prepare_block_tables([[3], [], [4, 5, 6]], pad_to=5)
    assert table.tolist() == [[3, 0, 0, 0, 0], [0, 0, 0, 0, 0], [4, 5, 6, 0, 0]]


def test_packed_prefill_positions():
    request_index, positions = prepare_token_positions(torch.tensor([6, 0]), torch.tensor([1, 3]))
    assert request_index.tolist() == [0, 1, 1, 1]
    assert positions.tolist() == [6, 0, 1, 2]


@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_slot_mapping_matches_the_formula_token_by_token(block_size):
    gen = torch.Generator().manual_seed(block_size)
    lengths = [5, 1, 37]
    ids = torch.randperm(200, generator=gen)[: sum(-(-n // block_size) for n in lengths)] + 1
    block_ids, cursor = [], 0
    for n in lengths:
        k = -(-n // block_size)
        block_ids.append(ids[cursor : cursor + k].tolist())
        cursor += k
    table = prepare_block_tables(block_ids)
    request_index, positions = prepare_token_positions(
        torch.zeros(3, dtype=torch.int64), torch.tensor(lengths)
    )
    slots = prepare_slot_mapping(table, request_index, positions, block_size)
    expected = [
        block_ids[b][p // block_size] * block_size + p % block_size
        for b, n in enumerate(lengths)
        for p in range(n)
    ]
    assert slots.dtype == torch.int64
    assert slots.tolist() == expected
    assert len(set(expected)) == len(expected)

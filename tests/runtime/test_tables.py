"""Block tables, token positions and slot mappings against the formula."""

import pytest
import torch
from kvskill.runtime import prepare_block_tables, prepare_slot_mapping, prepare_token_positions
from kvskill.runtime.tables import bool_tensor, int64_tensor, slot_mapping_from_block_ids


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


def test_requests_without_new_tokens_are_skipped():
    # Requests 0, 2 and 4 contribute nothing this step (including the last one).
    computed = torch.tensor([3, 5, 0, 9, 2])
    new = torch.tensor([0, 2, 0, 1, 0])
    request_index, positions = prepare_token_positions(computed, new)
    assert request_index.tolist() == [1, 1, 3]
    assert positions.tolist() == [5, 6, 9]
    empty_index, empty_positions = prepare_token_positions(
        computed, torch.zeros(5, dtype=torch.int64)
    )
    assert empty_index.numel() == 0 and empty_positions.numel() == 0


@pytest.mark.parametrize("block_size", [3, 4, 128])
def test_slot_mapping_random_batches_against_a_token_loop(block_size):
    gen = torch.Generator().manual_seed(block_size)
    computed = torch.randint(0, 300, (9,), generator=gen)
    new = torch.randint(0, 40, (9,), generator=gen)
    totals = (computed + new).tolist()
    ids = torch.randperm(2000, generator=gen) + 1
    block_ids, cursor = [], 0
    for n in totals:
        k = -(-n // block_size)
        block_ids.append(ids[cursor : cursor + k].tolist())
        cursor += k
    table = prepare_block_tables(block_ids, pad_to=40)
    request_index, positions = prepare_token_positions(computed, new, int(new.sum()))
    slots = prepare_slot_mapping(table, request_index, positions, block_size)
    expected = [
        block_ids[b][p // block_size] * block_size + p % block_size
        for b in range(9)
        for p in range(int(computed[b]), totals[b])
    ]
    assert slots.tolist() == expected


def test_int32_and_int64_index_paths_agree():
    computed, new = torch.tensor([4, 0, 17]), torch.tensor([3, 5, 1])
    table = prepare_block_tables([[9, 4, 2], [6, 1], [3, 8, 5, 7, 11]])
    ri64, pos64 = prepare_token_positions(computed, new)
    ri32, pos32 = prepare_token_positions(computed, new, dtype=torch.int32)
    assert ri64.dtype == pos64.dtype == torch.int64 and pos32.dtype == torch.int32
    assert torch.equal(pos64, pos32.long()) and torch.equal(ri64, ri32.long())
    slots = prepare_slot_mapping(table, ri32, pos32, 4)
    assert slots.dtype == torch.int64
    assert torch.equal(slots, prepare_slot_mapping(table, ri64, pos64, 4))
    # r0: positions 4-6 in logical block 1 (id 4); r1: 0-3 in id 6, 4 in id 1; r2: 17 in id 11
    assert slots.tolist() == [16, 17, 18, 24, 25, 26, 27, 4, 45]


def test_position_beyond_the_table_is_an_error_not_a_wrapped_read():
    table = prepare_block_tables([[3], [4]])
    # Position 4 of request 0 needs logical block 1; the flat index would land on row 1.
    with pytest.raises(ValueError, match="logical block 1 but the block table has 1 columns"):
        prepare_slot_mapping(table, torch.tensor([0]), torch.tensor([4]), 4)


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_slot_mapping_from_block_ids_equals_the_tensor_path(block_size):
    gen = torch.Generator().manual_seed(10 + block_size)
    for new_max in (1, 2, 40):  # decode (one token each), short chunks, long prefills
        computed = torch.randint(0, 100, (7,), generator=gen)
        new = torch.randint(1, new_max + 1, (7,), generator=gen)
        totals = (computed + new).tolist()
        ids = (torch.randperm(3000, generator=gen) + 1).tolist()
        block_ids, cursor = [], 0
        for n in totals:
            k = -(-n // block_size)
            block_ids.append(ids[cursor : cursor + k])
            cursor += k
        request_index, positions = prepare_token_positions(computed, new)
        expected = prepare_slot_mapping(
            prepare_block_tables(block_ids), request_index, positions, block_size
        )
        slots = slot_mapping_from_block_ids(block_ids, computed.tolist(), new.tolist(), block_size)
        assert slots.dtype == torch.int64
        assert torch.equal(slots, expected)


def test_slot_mapping_from_block_ids_refuses_short_rows():
    # Position 8 needs logical block 2 of 4-token blocks; the row has two.
    with pytest.raises(IndexError):
        slot_mapping_from_block_ids([[3, 5]], [8], [1], 4)
    with pytest.raises(IndexError):
        slot_mapping_from_block_ids([[3, 5], [7]], [0, 2], [3, 3], 4)


def test_array_backed_tensors():
    assert int64_tensor([3, -1, 2**40]).tolist() == [3, -1, 2**40]
    assert int64_tensor([]).shape == (0,) and int64_tensor([]).dtype == torch.int64
    flags = bool_tensor([True, False, True])
    assert flags.dtype == torch.bool and flags.tolist() == [True, False, True]
    assert bool_tensor([]).shape == (0,)


def test_block_tables_from_typed_arrays_lists_and_other_int_arrays():
    from array import array

    rows = [array("i", [4, 9]), [7], array("q", [1, 2, 3]), array("i")]
    assert prepare_block_tables(rows).tolist() == [[4, 9, 0], [7, 0, 0], [1, 2, 3], [0, 0, 0]]

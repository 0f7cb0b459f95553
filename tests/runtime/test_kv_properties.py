"""Property tests over random request streams: ownership, release, slots, windows, atomicity."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvskill.runtime import (
    NULL_BLOCK_ID,
    KVCacheManager,
    prepare_block_tables,
    prepare_slot_mapping,
    prepare_token_positions,
)
from runtime_factories import Sink, attn_layer, mamba_layer, model_info

# An op is (kind, request number, token count): start a request with a prompt, grow it by
# a chunk (1 = decode), or free it.
OPS = st.lists(
    st.tuples(
        st.sampled_from(["start", "grow", "grow", "grow", "free"]),
        st.integers(0, 5),
        st.integers(1, 12),
    ),
    min_size=1,
    max_size=40,
)
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _manager(
    window: int, block_size: int, num_blocks: int, hybrid: bool, seed: int
) -> KVCacheManager:
    sink = Sink()
    layers = [
        attn_layer(sink, 0),
        attn_layer(sink, 1, "SlidingWindow", sliding_window=window),
    ]
    if hybrid:
        layers.append(mamba_layer(sink, 2))
    return KVCacheManager(
        model_info(layers, block_size),
        num_blocks=num_blocks,
        use_hybrid_blocks=hybrid,
        free_block_order_seed=seed,
    )


def _check_ownership(mgr: KVCacheManager, live: dict[str, int]) -> None:
    """No block is held twice in a pool, and held + free = usable for every pool."""
    owned: dict[int, list[int]] = {}
    for rid in live:
        for key, ids in mgr.get_block_ids(rid).items():
            owned.setdefault(id(mgr.pools[key]), []).extend(b for b in ids if b != NULL_BLOCK_ID)
    for key, pool in mgr.pools.items():
        held = owned.get(id(pool), [])
        assert len(held) == len(set(held)), f"block owned twice in pool of {key}: {held}"
        assert not any(pool.is_free(b) for b in held), "a held block is in the free queue"
        assert len(held) + pool.num_free_blocks == pool.num_usable_blocks


def _check_step(mgr, rid: str, computed: int, total: int, window: int) -> None:
    """The step's tokens get the formula's slots; the window's keys are still held."""
    for key in mgr.group_keys:
        if key == "Mamba":
            assert len(mgr.get_block_ids(rid)[key]) == 1
            continue
        bs = mgr.block_size_of(key)
        ids = mgr.get_block_ids(rid)[key]
        assert len(ids) == -(-total // bs)
        table = prepare_block_tables([ids])
        req, pos = prepare_token_positions(
            torch.tensor([computed]), torch.tensor([total - computed])
        )
        slots = prepare_slot_mapping(table, req, pos, bs).tolist()
        assert slots == [ids[p // bs] * bs + p % bs for p in range(computed, total)]
        first_visible = 0 if key == "FullAttention" else max(0, computed - window + 1)
        assert all(ids[p // bs] != NULL_BLOCK_ID for p in range(first_visible, total))
        if key == "SlidingWindow":
            live_blocks = sum(b != NULL_BLOCK_ID for b in ids)
            assert live_blocks <= -(-(window - 1 + total - computed) // bs) + 1


@SETTINGS
@given(
    ops=OPS,
    window=st.integers(1, 10),
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(4, 40),
    hybrid=st.booleans(),
    seed=st.integers(0, 3),
)
def test_random_request_streams_keep_every_invariant(
    ops, window, block_size, num_blocks, hybrid, seed
):
    mgr = _manager(window, block_size, num_blocks, hybrid, seed)
    live: dict[str, int] = {}  # request id -> tokens computed
    for kind, number, count in ops:
        rid = f"r{number}"
        if kind == "free":
            mgr.free(rid)
            live.pop(rid, None)
        else:
            if kind == "start" and rid in live:
                continue
            computed = live.get(rid, 0)
            total = computed + (count if kind == "start" or rid not in live else count % 3 + 1)
            before = (
                {r: mgr.get_block_ids(r) for r in live},
                mgr.num_free_blocks,
                mgr.get_block_ids(rid),
            )
            expected = mgr.can_allocate(rid, total, computed)
            blocks = mgr.allocate_slots(rid, total, num_computed_tokens=computed)
            assert (blocks is not None) == expected
            if blocks is not None:
                # The blocks it names are the ones appended: they end the request's table.
                held = mgr.get_block_ids(rid)
                for key, new in blocks.new_block_ids.items():
                    assert tuple(held[key][len(held[key]) - len(new) :]) == new
                live[rid] = total
                _check_step(mgr, rid, computed, total, window)
            else:
                # All or nothing: a refused allocation leaves every table and pool as it was.
                after = (
                    {r: mgr.get_block_ids(r) for r in live},
                    mgr.num_free_blocks,
                    mgr.get_block_ids(rid),
                )
                assert after == before
        _check_ownership(mgr, live)
    for rid in list(live):
        mgr.free(rid)
    assert mgr.num_free_blocks == mgr.initial_free_blocks


@SETTINGS
@given(
    window=st.integers(1, 12), block_size=st.sampled_from([1, 2, 3, 4]), steps=st.integers(1, 80)
)
def test_decoding_keeps_sliding_window_blocks_bounded(window, block_size, steps):
    mgr = _manager(window, block_size, num_blocks=200, hybrid=False, seed=0)
    prompt = window + 3
    assert mgr.allocate_slots("r", prompt) is not None
    bound = -(-window // block_size) + 1
    for total in range(prompt + 1, prompt + 1 + steps):
        assert mgr.allocate_slots("r", total) is not None
        ids = mgr.get_block_ids("r")["SlidingWindow"]
        assert sum(b != NULL_BLOCK_ID for b in ids) <= bound
    # Only full attention grows with the sequence.
    used_sliding = mgr.initial_free_blocks["SlidingWindow"] - mgr.num_free_blocks["SlidingWindow"]
    assert used_sliding <= bound

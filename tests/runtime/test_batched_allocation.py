"""Batched decode allocation: the same pools as one allocate_slots per request, and the same
schedules (preemption included) as the one-by-one scheduler path."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvskill.runtime import KVCacheManager
from kvskill.runtime.request import Request, SamplingParams
from kvskill.runtime.scheduler import Scheduler, SchedulerConfig
from runtime_factories import Sink, attn_layer, mamba_layer, model_info

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _manager(window: int, block_size: int, num_blocks: int, hybrid: bool) -> KVCacheManager:
    sink = Sink()
    layers = [attn_layer(sink, 0), attn_layer(sink, 1, "SlidingWindow", sliding_window=window)]
    if hybrid:
        layers.append(mamba_layer(sink, 2))
    return KVCacheManager(
        model_info(layers, block_size),
        num_blocks=num_blocks,
        use_hybrid_blocks=hybrid,
        free_block_order_seed=3,
    )


def _state(mgr: KVCacheManager, request_ids) -> tuple:
    """Everything allocation can change: tables, token counts, free queues in order."""
    return (
        {rid: mgr.get_block_ids(rid) for rid in request_ids},
        {key: dict(m.req_to_num_tokens) for key, m in mgr.managers.items()},
        {key: list(pool.free_block_queue) for key, pool in mgr.pools.items()},
        {key: pool.num_allocations for key, pool in mgr.pools.items()},
    )


@SETTINGS
@given(
    prompts=st.lists(st.integers(1, 14), min_size=1, max_size=6),
    growth=st.lists(st.integers(1, 3), min_size=1, max_size=25),
    window=st.integers(1, 9),
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(6, 40),
    hybrid=st.booleans(),
)
def test_batch_allocation_equals_one_call_per_request(
    prompts, growth, window, block_size, num_blocks, hybrid
):
    batched = _manager(window, block_size, num_blocks, hybrid)
    single = _manager(window, block_size, num_blocks, hybrid)
    ids = [f"r{i}" for i in range(len(prompts))]
    computed = [0] * len(ids)
    totals = list(prompts)
    for step in range(len(growth) + 1):
        served = batched.allocate_slots_batch(ids, totals, computed)
        expected = len(ids)
        for i, rid in enumerate(ids):
            if single.allocate_slots(rid, totals[i], num_computed_tokens=computed[i]) is None:
                expected = i
                break
        assert served == expected
        assert _state(batched, ids) == _state(single, ids)
        if served < len(ids):
            # The scheduler would preempt: drop the newest request from both and go on.
            for mgr in (batched, single):
                mgr.free(ids[-1])
            ids, computed, totals = ids[:-1], computed[: len(ids) - 1], totals[: len(ids) - 1]
            if not ids:
                break
            continue
        if step < len(growth):
            computed = list(totals)
            totals = [t + growth[step] for t in totals]


def test_batch_allocation_skips_requests_inside_their_last_block():
    mgr = _manager(window=64, block_size=4, num_blocks=40, hybrid=False)
    ids = ["a", "b", "c"]
    assert mgr.allocate_slots_batch(ids, [5, 8, 3], [0, 0, 0]) == 3
    full = mgr.managers["FullAttention"]
    # Growing by one token: only b (8 -> 9) crosses a block boundary.
    assert full.requests_to_update(ids, [6, 9, 4], [5, 8, 3]) == [1]
    before = mgr.pools["FullAttention"].num_allocations
    assert mgr.allocate_slots_batch(ids, [6, 9, 4], [5, 8, 3]) == 3
    assert mgr.pools["FullAttention"].num_allocations == before + 1
    assert [full.num_tokens(r) for r in ids] == [6, 9, 4]


def test_batch_allocation_stops_at_the_first_request_that_does_not_fit():
    # 5 usable blocks of 4 tokens: a holds 2, b holds 2, one is free.
    mgr = _manager(window=64, block_size=4, num_blocks=6, hybrid=False)
    assert mgr.allocate_slots_batch(["a", "b"], [8, 8], [0, 0]) == 2
    # a takes the last free block; b cannot grow; c (not reached) is untouched.
    assert mgr.allocate_slots_batch(["a", "b", "c"], [9, 9, 1], [8, 8, 0]) == 1
    assert mgr.managers["FullAttention"].num_tokens("a") == 9
    assert mgr.managers["FullAttention"].num_tokens("b") == 8
    assert mgr.get_block_ids("c") == {"FullAttention": [], "SlidingWindow": []}


def test_batch_allocation_rejects_computed_beyond_total():
    mgr = _manager(window=4, block_size=4, num_blocks=10, hybrid=False)
    try:
        mgr.allocate_slots_batch(["a", "b"], [4, 4], [0, 5])
    except ValueError as error:
        assert "num_computed_tokens=5 exceeds num_tokens=4" in str(error)
    else:
        raise AssertionError("expected a ValueError")
    assert mgr.num_free_blocks == mgr.initial_free_blocks


class _OneByOne(KVCacheManager):
    """Serves no request in the batched call, so the scheduler grows every one by itself."""

    def allocate_slots_batch(self, request_ids, num_tokens, num_computed_tokens) -> int:
        return 0


def _trace(manager_cls, seed: int) -> list:
    sink = Sink()
    info = model_info([attn_layer(sink, 0), attn_layer(sink, 1, "SlidingWindow", sliding_window=6)])
    mgr = manager_cls(info, num_blocks=14, free_block_order_seed=seed)
    scheduler = Scheduler(
        mgr, SchedulerConfig(max_num_batched_tokens=24, max_model_len=40), frozenset()
    )
    rng = random.Random(seed)
    for i in range(7):
        prompt = [rng.randrange(100) for _ in range(rng.randint(3, 12))]
        scheduler.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(4, 20)), 0.0))
    trace = []
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        trace.append(
            (
                output.is_prefill,
                [(s.request.request_id, s.num_new_tokens, s.start) for s in output.scheduled],
                [r.request_id for r in output.preempted],
                {
                    s.request.request_id: mgr.get_block_ids(s.request.request_id)
                    for s in output.scheduled
                },
            )
        )
        sampled = [
            rng.randrange(100)
            if s.start + s.num_new_tokens >= s.request.num_prefill_tokens
            else None
            for s in output.scheduled
        ]
        scheduler.update_from_output(output, sampled, now=0.0)
    assert mgr.num_free_blocks == mgr.initial_free_blocks
    return trace


def test_scheduler_batched_decode_matches_one_by_one_under_preemption():
    for seed in range(4):
        batched, single = _trace(KVCacheManager, seed), _trace(_OneByOne, seed)
        assert batched == single
        # The pool is small enough that decode steps preempt.
        assert any(preempted for is_prefill, _, preempted, _ in batched if not is_prefill)

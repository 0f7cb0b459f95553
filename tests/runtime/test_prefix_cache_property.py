"""Property test: random request streams with shared prefixes through the real scheduler.

A shadow of the KV pools records which token each slot was last written with (what the
model would store there); every step checks that

* every position a request's query can see holds that request's own token (a hit never
  hands out someone else's K/V, a slid-out block is never needed),
* no block is held twice by one request, reference counts equal the holders, a held block
  is not free, and held + free = usable in every pool,
* every cached hash maps to a block that carries that hash and whose shadow content is
  the last block of the tokens the hash names (recomputed from the chain);

and at the end, with every request finished, the pools are back to their initial free
counts. ``KVSKILL_PREFIX_PROPERTY_EXAMPLES`` raises the example count (1000 in the slow
suite's test below).
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvskill.runtime import NULL_BLOCK_ID, KVCacheManager
from kvskill.runtime.prefix_hash import chain_hash, root_hash
from kvskill.runtime.request import Request, RequestStatus, SamplingParams
from kvskill.runtime.scheduler import Scheduler, SchedulerConfig
from runtime_factories import Sink, attn_layer, model_info

FAST_EXAMPLES = int(os.environ.get("KVSKILL_PREFIX_PROPERTY_EXAMPLES", "40"))

STREAM = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**16),
        "num_requests": st.integers(1, 14),
        "block_size": st.sampled_from([1, 2, 4]),
        "window": st.sampled_from([None, 3, 6, 9]),
        "num_blocks": st.integers(8, 48),
        "hybrid": st.booleans(),
        "budget": st.sampled_from([4, 9, 64]),
        "preempt_rate": st.sampled_from([0.0, 0.1, 0.3]),
    }
)


def _manager(window: int | None, block_size: int, num_blocks: int, hybrid: bool, seed: int):
    sink = Sink()
    layers = [attn_layer(sink, 0)]
    if window is not None:
        layers.append(attn_layer(sink, 1, "SlidingWindow", sliding_window=window))
    return KVCacheManager(
        model_info(layers, block_size),
        num_blocks=num_blocks,
        use_hybrid_blocks=hybrid,
        free_block_order_seed=seed,
        enable_prefix_caching=True,
    )


def _requests(rng: random.Random, count: int) -> list[Request]:
    """Prompts drawn from a few shared prefixes with own tails (some identical, some empty)."""
    prefixes = [[rng.randrange(6) for _ in range(rng.randint(0, 14))] for _ in range(3)]
    requests = []
    for i in range(count):
        prompt = rng.choice(prefixes) + [rng.randrange(6) for _ in range(rng.randint(0, 5))]
        prompt = prompt or [rng.randrange(6)]
        params = SamplingParams(max_tokens=rng.randint(1, 6), ignore_eos=True)
        requests.append(Request(f"r{i}", prompt, params, 0.0, index=i))
    return requests


class Shadow:
    """What each pool slot holds: (pool, block, offset) -> token id last written there."""

    def __init__(self, mgr: KVCacheManager) -> None:
        self.mgr = mgr
        self.slots: dict[tuple[int, int, int], int] = {}

    def _where(self, key: str, ids: list[int], pos: int) -> tuple[int, int, int]:
        bs = self.mgr.block_size_of(key)
        block = ids[pos // bs]
        assert block != NULL_BLOCK_ID, f"position {pos} of group {key} is in the null block"
        return id(self.mgr.pools[key]), block, pos % bs

    def write(self, request: Request, start: int, count: int) -> None:
        for key, ids in self.mgr.get_block_ids(request.request_id).items():
            for pos in range(start, start + count):
                self.slots[self._where(key, ids, pos)] = request.token_at(pos)

    def check_reads(self, request: Request, start: int, count: int) -> None:
        """Every key the step's queries see holds the request's own token."""
        for key, ids in self.mgr.get_block_ids(request.request_id).items():
            window = self.mgr.groups[key].sliding_window
            first = 0 if window is None else max(0, start - window + 1)
            for pos in range(first, start):
                assert self.slots.get(self._where(key, ids, pos)) == request.token_at(pos), (
                    f"{request.request_id} reads a foreign token at {pos} in {key}"
                )
            assert len(ids) * self.mgr.block_size_of(key) >= start + count

    def check_cache(self, named: dict[bytes, tuple[str, list[int]]]) -> None:
        """Every cached hash names the tokens its block holds."""
        for key in self.mgr.group_keys:
            pool = self.mgr.pools[key]
            bs = self.mgr.block_size_of(key)
            for block_hash, block in pool.cached_block_hash_to_block.items():
                assert block != NULL_BLOCK_ID and pool.block_hash[block] == block_hash
                group, prefix = named[block_hash]
                if group != key:
                    continue  # a shared page pool: the hash is another group's
                parent = root_hash(group)
                for i in range(0, len(prefix), bs):
                    parent = chain_hash(parent, prefix[i : i + bs])
                assert parent == block_hash
                held = [self.slots.get((id(pool), block, off)) for off in range(bs)]
                assert held == prefix[-bs:], f"cached block {block} holds {held}"


def _check_ownership(mgr: KVCacheManager, live: list[Request]) -> None:
    holders: dict[tuple[int, int], int] = {}
    for request in live:
        for key, ids in mgr.get_block_ids(request.request_id).items():
            real = [b for b in ids if b != NULL_BLOCK_ID]
            assert len(real) == len(set(real)), f"{request.request_id} holds a block twice"
            for b in real:
                where = (id(mgr.pools[key]), b)
                holders[where] = holders.get(where, 0) + 1
    pools = {id(p): p for p in mgr.pools.values()}
    for pid, pool in pools.items():
        held = {b: n for (p, b), n in holders.items() if p == pid}
        for b in range(1, pool.num_blocks):
            assert pool.ref_cnt[b] == held.get(b, 0), f"block {b}: count {pool.ref_cnt[b]}"
        assert len(held) + pool.num_free_blocks == pool.num_usable_blocks


def run_stream(params: dict) -> dict[str, int]:
    rng = random.Random(params["seed"])
    # Room for the longest request (prompt <= 19 + 6 outputs) in every group at once.
    bs, num_groups = params["block_size"], 1 if params["window"] is None else 2
    fits = -(-25 // bs) * (num_groups if params["hybrid"] else 1) + 1
    num_blocks = max(params["num_blocks"], fits)
    mgr = _manager(params["window"], bs, num_blocks, params["hybrid"], params["seed"])
    config = SchedulerConfig(
        max_num_batched_tokens=params["budget"], max_num_seqs=8, max_model_len=64
    )
    scheduler = Scheduler(mgr, config, frozenset())
    requests = _requests(rng, params["num_requests"])
    pending = list(requests)
    shadow = Shadow(mgr)
    steps = 0
    while pending or scheduler.has_unfinished():
        if pending and rng.random() < 0.5:
            scheduler.add(pending.pop(0))
        if not scheduler.has_unfinished():
            continue
        if scheduler.running and rng.random() < params["preempt_rate"]:
            scheduler._preempt(scheduler.running[-1])
        output = scheduler.schedule()
        # A layer writes the whole step's K/V, then every request reads.
        for item in output.scheduled:
            shadow.write(item.request, item.start, item.num_new_tokens)
        sampled = []
        for item in output.scheduled:
            shadow.check_reads(item.request, item.start, item.num_new_tokens)
            ends = item.start + item.num_new_tokens >= item.request.num_prefill_tokens
            sampled.append(rng.randrange(6) if ends else None)
        scheduler.update_from_output(output, sampled, now=0.0)
        live = [r for r in requests if r.status is RequestStatus.RUNNING]
        _check_ownership(mgr, live)
        named = {}
        for request in requests:
            tokens = request.prompt_token_ids + request.output_token_ids
            for group, hashes in request.block_hashes.items():
                bs = mgr.block_size_of(group)
                for i, h in enumerate(hashes):
                    named[h] = (group, tokens[: (i + 1) * bs])
        shadow.check_cache(named)
        steps += 1
        assert steps < 5000, "the stream does not finish"
    assert all(r.status is RequestStatus.FINISHED for r in requests)
    assert mgr.num_free_blocks == mgr.initial_free_blocks
    assert not any(mgr.tracked_request_ids().values())
    return {"hits": scheduler.num_prefix_hit_tokens, "preemptions": scheduler.num_preemptions}


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@settings(max_examples=FAST_EXAMPLES, **SETTINGS)
@given(params=STREAM)
def test_random_streams_with_shared_prefixes_keep_every_invariant(params):
    run_stream(params)


@pytest.mark.slow
@settings(max_examples=1000, **SETTINGS)
@given(params=STREAM)
def test_a_thousand_random_streams(params):
    run_stream(params)


def test_streams_do_hit_and_preempt():
    """The generator is not vacuous: across fixed streams, hits and preemptions happen."""
    totals = {"hits": 0, "preemptions": 0}
    for seed in range(12):
        params = {
            "seed": seed,
            "num_requests": 12,
            "block_size": 2,
            "window": 6 if seed % 2 else None,
            "num_blocks": 24,
            "hybrid": bool(seed % 3 == 0),
            "budget": 9,
            "preempt_rate": 0.2,
        }
        for key, value in run_stream(params).items():
            totals[key] += value
    assert totals["hits"] > 0 and totals["preemptions"] > 0

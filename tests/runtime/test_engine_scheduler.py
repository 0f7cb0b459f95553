"""Scheduler policy stories: packing under the budget, chunking, admission, preemption."""

import torch
from kvskill.runtime import CacheEntry, KVCacheManager, LayerCacheInfo, ModelCacheInfo
from kvskill.runtime.request import Request, RequestStatus, SamplingParams
from kvskill.runtime.scheduler import Scheduler, SchedulerConfig
from runtime_factories import Sink, attn_layer, mamba_layer, model_info


def make_manager(num_blocks: int, block_size: int = 4) -> KVCacheManager:
    entry = CacheEntry(
        cache_name="k_cache",
        attn_type="FullAttention",
        dim=1,
        num_head=1,
        dtype=torch.float32,
        needs_block=True,
        block_size=block_size,
        tensor_setter=lambda t: None,
    )
    info = ModelCacheInfo(num_layers=1, layer_infos=[LayerCacheInfo(0, [entry])])
    return KVCacheManager(info, num_blocks=num_blocks)


def make_scheduler(num_blocks: int, **config) -> Scheduler:
    config.setdefault("max_model_len", 64)
    return Scheduler(make_manager(num_blocks), SchedulerConfig(**config), frozenset())


def make_request(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), 0.0)


def run_step(scheduler: Scheduler, token: int = 1):
    """Schedule one step and feed back a token for every request that samples."""
    output = scheduler.schedule()
    sampled = [
        token if s.start + s.num_new_tokens >= s.request.num_prefill_tokens else None
        for s in output.scheduled
    ]
    scheduler.update_from_output(output, sampled, now=0.0)
    return output


def test_prefill_packs_prompts_and_chunks_the_one_that_overflows():
    scheduler = make_scheduler(64, max_num_batched_tokens=12, mix_decode_with_prefill=False)
    for rid in "abc":
        scheduler.add(make_request(rid, 5))
    # Step 1: a and b whole (10 tokens), then 2 tokens of c fill the budget of 12.
    output = run_step(scheduler)
    assert output.is_prefill
    assert [(s.request.request_id, s.num_new_tokens, s.start) for s in output.scheduled] == [
        ("a", 5, 0),
        ("b", 5, 0),
        ("c", 2, 0),
    ]
    # Step 2: c's remaining 3 tokens; a and b wait, because prefill goes first.
    output = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens, s.start) for s in output.scheduled] == [
        ("c", 3, 2)
    ]
    # Step 3: everyone decodes one token at its own position.
    output = run_step(scheduler)
    assert not output.is_prefill
    assert [(s.request.request_id, s.start) for s in output.scheduled] == [
        ("a", 5),
        ("b", 5),
        ("c", 5),
    ]


def test_decoding_requests_ride_along_with_a_prompt_chunk():
    scheduler = make_scheduler(64, max_num_batched_tokens=12)
    for rid in "abc":
        scheduler.add(make_request(rid, 5))
    output = run_step(scheduler)  # a, b whole and 2 tokens of c, as without mixing
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [
        ("a", 5),
        ("b", 5),
        ("c", 2),
    ]
    # Step 2: c's last 3 prompt tokens leave 9 of the budget: a and b feed their first
    # sampled token in the same step.
    output = run_step(scheduler)
    assert output.is_prefill
    assert [(s.request.request_id, s.num_new_tokens, s.start) for s in output.scheduled] == [
        ("c", 3, 2),
        ("a", 1, 5),
        ("b", 1, 5),
    ]
    assert [len(r.output_token_ids) for r in scheduler.running] == [2, 2, 1]
    # Step 3: no prompt left, a plain decode step at everyone's own position.
    output = run_step(scheduler)
    assert not output.is_prefill
    assert [(s.request.request_id, s.start) for s in output.scheduled] == [
        ("a", 6),
        ("b", 6),
        ("c", 5),
    ]


def test_decoding_requests_ride_along_only_in_what_the_prompts_leave():
    scheduler = make_scheduler(64, max_num_batched_tokens=4)
    for rid in "ab":
        scheduler.add(make_request(rid, 1))
    run_step(scheduler)  # a and b's one-token prompts
    scheduler.add(make_request("c", 7))
    # c's prompt takes the whole budget: a and b wait.
    output = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("c", 4)]
    # Its last 3 tokens leave one: a rides along, b waits for the decode step.
    output = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [
        ("c", 3),
        ("a", 1),
    ]
    output = run_step(scheduler)
    assert not output.is_prefill
    assert [(s.request.request_id, s.start) for s in output.scheduled] == [
        ("a", 2),
        ("b", 1),
        ("c", 7),
    ]


def test_a_model_with_a_state_group_decodes_in_steps_of_its_own():
    # An attention layer and a Mamba layer: the Mamba layer's prefill path is a chunked scan,
    # which its source may compute otherwise than the decode step (nemotron_h's dt clamp).
    sink = Sink()
    info = model_info([attn_layer(sink, 0), mamba_layer(sink, 1)])
    config = SchedulerConfig(max_num_batched_tokens=12, max_model_len=64)
    scheduler = Scheduler(KVCacheManager(info, num_blocks=64), config, frozenset())
    assert "'Mamba'" in scheduler.ride_along_disabled_reason
    for rid in "abc":
        scheduler.add(make_request(rid, 5))
    run_step(scheduler)  # a, b whole and 2 tokens of c
    # Step 2: c's last 3 prompt tokens leave 9 of the budget, but a and b do not ride along.
    output = run_step(scheduler)
    assert output.is_prefill
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("c", 3)]
    # Step 3: everyone decodes, a and b from their first sampled token.
    output = run_step(scheduler)
    assert not output.is_prefill
    assert [(s.request.request_id, s.start) for s in output.scheduled] == [
        ("a", 5),
        ("b", 5),
        ("c", 5),
    ]
    # attention alone mixes, and says nothing
    assert make_scheduler(64).ride_along_disabled_reason is None


def test_max_num_seqs_caps_admission():
    scheduler = make_scheduler(64, max_num_seqs=2)
    for rid in "abc":
        scheduler.add(make_request(rid, 3))
    output = run_step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_admission_waits_for_free_blocks():
    # 4 usable blocks of 4 tokens: a (12 tokens, 3 blocks) fits, b (8 tokens) must wait.
    scheduler = make_scheduler(5)
    scheduler.add(make_request("a", 12, max_tokens=1))
    scheduler.add(make_request("b", 8, max_tokens=1))
    output = run_step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["a"]
    # a finishes (max_tokens=1) and frees its blocks, so b is admitted next step.
    assert scheduler.kv_manager.num_free_blocks["FullAttention"] == 4
    output = run_step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["b"]


def test_decode_preempts_newest_and_it_resumes_by_recompute():
    # 4 usable blocks; a and b hold 2 blocks each after an 8-token prefill.
    scheduler = make_scheduler(5)
    a, b = make_request("a", 8), make_request("b", 8)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)
    # Decoding position 8 needs a third block for each; only the oldest (a) can keep going.
    output = run_step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["a"]
    assert output.preempted == [b]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and scheduler.waiting[0] is b
    # b keeps its generated token: when it comes back it prefills prompt + output (9 tokens).
    assert b.output_token_ids == [1]
    scheduler.kv_manager.free("a")  # make room, as a finishing request would
    scheduler.running.remove(a)
    output = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("b", 9)]


def test_stop_reasons_and_release():
    scheduler = Scheduler(
        make_manager(16), SchedulerConfig(max_model_len=64), eos_token_ids=frozenset({7})
    )
    request = make_request("a", 3)
    scheduler.add(request)
    run_step(scheduler, token=2)
    run_step(scheduler, token=7)  # EOS
    assert request.finish_reason.value == "stop" and request.output_token_ids == [2, 7]
    assert not scheduler.has_unfinished()
    assert scheduler.kv_manager.num_free_blocks == scheduler.kv_manager.initial_free_blocks

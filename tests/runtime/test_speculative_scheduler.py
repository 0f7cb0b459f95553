"""The scheduler's side of speculative decoding: a verify step feeds the last token and the
drafts, keeps only the accepted positions computed, and drafts never outlive a preemption."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvskill.runtime.request import FinishReason, RequestStatus  # noqa: E402
from kvskill.runtime.step_inputs import build_step_inputs  # noqa: E402
from test_engine_scheduler import make_request, make_scheduler  # noqa: E402


def _prefilled(scheduler, *requests):
    for request in requests:
        scheduler.add(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, [7] * len(output.scheduled), now=0.0)


def test_a_verify_step_feeds_the_drafts_and_keeps_the_accepted_positions():
    scheduler = make_scheduler(64, num_speculative_tokens=1)
    a, b = make_request("a", 5, max_tokens=8), make_request("b", 3, max_tokens=8)
    _prefilled(scheduler, a, b)
    a.draft_token_ids[:] = [40]
    b.draft_token_ids[:] = [41]
    output = scheduler.schedule()
    assert not output.is_prefill
    assert [(s.num_new_tokens, s.start) for s in output.scheduled] == [(2, 5), (2, 3)]
    inputs = build_step_inputs(output, scheduler.kv_manager, attention_mask=None, device="cpu")
    # each request's last sampled token, then its draft
    assert inputs.input_ids.tolist() == [[7, 40, 7, 41]]
    assert inputs.position_ids.tolist() == [[5, 6, 3, 4]]
    # a accepted its draft (and gains the bonus token), b rejected it
    steps, _ = scheduler.update_from_output(output, [[40, 50], [60]], now=0.0)
    assert [s.new_token_ids for s in steps] == [[40, 50], [60]]
    assert a.output_token_ids == [7, 40, 50] and a.num_computed_tokens == 7
    # b's draft slot (position 4) is past its computed length: the next step writes it again
    assert b.output_token_ids == [7, 60] and b.num_computed_tokens == 4
    assert a.num_computed_tokens == a.num_tokens - 1 and b.num_computed_tokens == b.num_tokens - 1


def test_accepted_tokens_stop_at_the_one_that_ends_the_request():
    scheduler = make_scheduler(64, num_speculative_tokens=1)
    a = make_request("a", 4, max_tokens=2)
    _prefilled(scheduler, a)
    a.draft_token_ids[:] = [9]
    output = scheduler.schedule()
    steps, finished = scheduler.update_from_output(output, [[9, 10]], now=0.0)
    assert steps[0].new_token_ids == [9] and steps[0].finish_reason is FinishReason.LENGTH
    assert finished == [a] and a.output_token_ids == [7, 9]
    assert scheduler.kv_manager.num_free_blocks == scheduler.kv_manager.initial_free_blocks


def test_a_preempted_request_drops_its_drafts_and_decoding_does_not_ride_along():
    # 3 usable blocks of 4 tokens; two requests of 4 tokens each grow into a second block
    scheduler = make_scheduler(4, num_speculative_tokens=1)
    assert scheduler.ride_along_disabled_reason is not None
    a, b = make_request("a", 4), make_request("b", 4)
    _prefilled(scheduler, a, b)
    a.draft_token_ids[:] = [1]
    b.draft_token_ids[:] = [2]
    output = scheduler.schedule()
    assert [r.request_id for r in output.preempted] == ["b"]
    assert b.status is RequestStatus.WAITING and b.draft_token_ids == []
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("a", 2)]


def test_pools_of_other_kinds_are_refused_for_speculation():
    from kvskill.runtime.speculative import speculation_refusal

    assert speculation_refusal({"FullAttention": "FullAttention"}) is None
    served = {"FullAttention": "FullAttention", "Mamba": "Mamba", "SlidingWindow": "SlidingWindow"}
    assert speculation_refusal(served) is None
    reason = speculation_refusal({**served, "Legacy": "Legacy"})
    assert reason is not None and "['Legacy']" in reason

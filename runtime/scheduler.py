"""Continuous-batching scheduler: waiting/running queues, packed prefill, decode, preemption.

Policy (``ForwardMetaData.is_prefill`` is set on every step that computes prompt tokens):

1. Prefill first. Requests part-way through a chunked prefill continue, then waiting
   requests are admitted in arrival order while the token budget
   (``max_num_batched_tokens``), the sequence cap (``max_num_seqs``) and the KV manager
   allow. A prompt longer than the remaining budget is chunked (or, with chunking off,
   admitted alone in a step of its own). With ``mix_decode_with_prefill`` (the default;
   chunked prefill only), the running requests that are done with their prompt ride along
   in what the prompts leave of the budget: each feeds its last sampled token in the same
   step, as far as the KV manager grows them without preempting anyone. Prompts come first
   because a CPU step costs about what its tokens cost: a decode token taken from a full
   budget would push a prompt's last tokens into one more step (measured: uniform W2 4 %
   slower that way), while the budget a last prompt chunk leaves is free. A model with a
   state group (Mamba) never mixes: its prefill path is a chunked scan, not the decode
   step its source runs for a generated token (``MambaManager.ride_along_unsupported``).
2. Otherwise a decode step feeds every running request its last sampled token. When the
   KV manager cannot grow a request, the most recently admitted running request is
   preempted: its blocks are freed and it goes back to the front of the waiting queue to
   recompute prompt + generated tokens later (its tokens are unchanged by this).

Prefix caching (when the KV manager has it on): a request being admitted first takes the
longest prefix of its tokens whose full blocks are cached in every group
(``KVCacheManager.get_computed_blocks``) and prefills only the rest, from that position; at
least its last token is always computed. The full blocks a prefill step will fill are
offered to the cache when it is scheduled (so later requests of the same step share them:
every layer writes the step's K/V before reading), those a decode step fills after it ran. A preempted request's blocks keep their hashes in the free
queue, so its readmission finds whatever was not evicted meanwhile.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvskill.core.errors import BadInputError
from kvskill.runtime.kv_cache_manager import KVCacheManager
from kvskill.runtime.request import FinishReason, Request, RequestStatus, StepOutput


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    #: tokens of all requests in one step at most (a lone unchunked prompt may exceed it)
    max_num_batched_tokens: int = 2048
    #: requests running at once at most
    max_num_seqs: int = 128
    #: split prompts longer than the step budget across several prefill steps
    enable_chunked_prefill: bool = True
    #: a request stops with "length" when prompt + output reaches this
    max_model_len: int = 2048
    #: steps that compute prompt tokens also feed the decoding requests their next token
    #: (with chunked prefill only: an unchunked prompt longer than the budget runs alone)
    mix_decode_with_prefill: bool = True
    #: speculative decoding: a decode step feeds each request its last token and the tokens
    #: drafted after it (``Request.draft_token_ids``, up to this many); 0 = off
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise BadInputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_speculative_tokens < 0:
            raise BadInputError(
                f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}"
            )


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    #: tokens fed this step
    num_new_tokens: int
    #: position of the first of them (= tokens already in the cache)
    start: int


@dataclass(slots=True)
class SchedulerOutput:
    is_prefill: bool
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    #: requests preempted while building this step
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting and running queues; asks the KV manager before admitting or growing."""

    def __init__(
        self, kv_manager: KVCacheManager, config: SchedulerConfig, eos_token_ids: frozenset[int]
    ) -> None:
        self.kv_manager = kv_manager
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Request] = deque()
        #: in admission order; preemption takes from the end
        self.running: list[Request] = []
        self.num_preemptions = 0
        #: prefix caching: tokens of every admission (readmissions included) looked up in
        #: the cache, and of those the tokens found
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self._caching = kv_manager.enable_prefix_caching
        #: block sizes of the cache groups: a decode step fills a block only when a request's
        #: computed tokens reach a multiple of one of them
        self._block_sizes = sorted({kv_manager.block_size_of(k) for k in kv_manager.group_keys})
        #: why decoding requests do not ride along although mixing is on (None: they do, or
        #: mixing is off): a model with a state group decodes in steps of its own
        self.ride_along_disabled_reason: str | None = None
        self._mixing = config.mix_decode_with_prefill and config.enable_chunked_prefill
        if self._mixing:
            self.ride_along_disabled_reason = kv_manager.ride_along_refusal()
            if config.num_speculative_tokens and self.ride_along_disabled_reason is None:
                # a verify step feeds drafts the prompt steps do not carry
                self.ride_along_disabled_reason = (
                    "speculative decoding verifies in steps of its own"
                )
            self._mixing = self.ride_along_disabled_reason is None

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Build the next step. Preempts running requests when the pool cannot serve any."""
        preempted: list[Request] = []
        while True:
            output = self._schedule_step()
            output.preempted[:0] = preempted
            if output.scheduled or not self.running:
                assert output.scheduled or not self.waiting, (
                    "a waiting request cannot be admitted into an empty KV pool; the engine "
                    "must check at start-up that one request of max_model_len fits"
                )
                return output
            # Every running request is part-way through a prefill and none can grow: make
            # room by recomputing the newest one later.
            preempted.append(self._preempt(self.running[-1]))

    def _schedule_step(self) -> SchedulerOutput:
        """Prompt tokens first (and decoding requests riding along); a decode step when no
        prompt token fits."""
        output = SchedulerOutput(is_prefill=True)
        budget = self._schedule_prompts(output, self.config.max_num_batched_tokens)
        if not output.scheduled:
            return self._schedule_decode()
        if self._mixing and budget > 0:
            output.scheduled += self._ride_along(budget)
        return output

    def _ride_along(self, budget: int) -> list[ScheduledRequest]:
        """Decoding requests grown by one token each, in running order, for the budget the
        prompts left, up to the first the KV manager cannot grow (nobody is preempted)."""
        grown, rest = self._grow_decoding(self._decoding()[:budget])
        # A manager that served fewer than it could (the batched call is an optimisation, not
        # a promise) gets the rest one by one, up to the first that does not fit.
        for request in rest:
            if not self._allocate(request, 1):
                break
            grown.append(ScheduledRequest(request, 1, request.num_computed_tokens))
        return grown

    def _decoding(self) -> list[Request]:
        """The running requests done with their prompt, in running order."""
        return [r for r in self.running if r.num_computed_tokens >= r.num_prefill_tokens]

    def _grow_decoding(
        self, candidates: list[Request]
    ) -> tuple[list[ScheduledRequest], list[Request]]:
        """One batched allocation of one more token for each candidate, in order: (those
        grown, the rest from the first that was not). Only the requests crossing a block
        boundary touch the pools."""
        computed = [r.num_computed_tokens for r in candidates]
        # the last sampled token, and the drafts after it when speculating
        fed = [1 + len(r.draft_token_ids) for r in candidates]
        served = self.kv_manager.allocate_slots_batch(
            [r.request_id for r in candidates],
            [c + f for c, f in zip(computed, fed, strict=True)],
            computed,
        )
        grown = [
            ScheduledRequest(r, f, c)
            for r, f, c in zip(candidates[:served], fed[:served], computed[:served], strict=True)
        ]
        return grown, candidates[served:]

    def _schedule_prompts(self, output: SchedulerOutput, budget: int) -> int:
        """Prompt chunks of running requests part-way through their prefill, then waiting
        requests admitted, into ``output`` within ``budget`` tokens; returns what is left."""
        for request in self.running:
            # (is_prefilling, spelled out: this runs over every running request each step)
            if request.num_computed_tokens >= request.num_prefill_tokens or budget <= 0:
                continue
            remaining = request.num_prefill_tokens - request.num_computed_tokens
            num_new = self._num_new_tokens(remaining, budget, output)
            if num_new == 0 or not self._allocate(request, num_new):
                # NOTE: admitting newcomers now would take the blocks this request waits for.
                return budget
            budget -= num_new
            if self._caching:
                self.kv_manager.cache_blocks(request, request.num_computed_tokens + num_new)
            output.scheduled.append(ScheduledRequest(request, num_new, request.num_computed_tokens))
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit, hit_blocks = (
                self.kv_manager.get_computed_blocks(request) if self._caching else (0, None)
            )
            num_new = self._num_new_tokens(request.num_tokens - hit, budget, output)
            if num_new == 0 or not self._allocate(request, num_new, hit, hit_blocks):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_prefill_tokens = request.num_tokens
            request.num_computed_tokens = request.num_cached_tokens = hit
            if self._caching:
                self.num_prefix_query_tokens += request.num_tokens
                self.num_prefix_hit_tokens += hit
                # NOTE: cached now, before the step computes them, so a request admitted
                # after this one in the same step already shares them: every layer writes
                # the whole step's K/V before it reads any (a hit block is never read
                # before this step has written it). A prefill step is never preempted.
                self.kv_manager.cache_blocks(request, hit + num_new)
            self.running.append(request)
            budget -= num_new
            output.scheduled.append(ScheduledRequest(request, num_new, hit))
        return budget

    def _num_new_tokens(self, remaining: int, budget: int, output: SchedulerOutput) -> int:
        if remaining <= budget:
            return remaining
        if self.config.enable_chunked_prefill:
            return budget
        # Unchunked: a prompt longer than the budget runs alone in its own step.
        return 0 if output.scheduled else remaining

    def _schedule_decode(self) -> SchedulerOutput:
        output = SchedulerOutput(is_prefill=False)
        output.scheduled, rest = self._grow_decoding(self._decoding())
        # The first request that could not grow, and every later one, go through the
        # preempting path one by one, exactly as if the whole batch had.
        for request in rest:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            fed = 1 + len(request.draft_token_ids)
            while not self._allocate(request, fed):
                victim = self._preempt(self.running[-1])
                output.preempted.append(victim)
                if victim is request:
                    break
            else:
                output.scheduled.append(ScheduledRequest(request, fed, request.num_computed_tokens))
        return output

    def _allocate(
        self,
        request: Request,
        num_new_tokens: int,
        start: int | None = None,
        hit_blocks: dict[str, list[int]] | None = None,
    ) -> bool:
        """Whether the KV manager grew the request by ``num_new_tokens`` (None = not now).

        ``start`` and ``hit_blocks``: a request being admitted with a prefix-cache hit of
        ``start`` tokens (it holds no block yet and nothing is computed).
        """
        computed = request.num_computed_tokens if start is None else start
        blocks = self.kv_manager.allocate_slots(
            request.request_id,
            computed + num_new_tokens,
            num_computed_tokens=computed,
            computed_blocks=hit_blocks,
        )
        return blocks is not None

    def _preempt(self, request: Request) -> Request:
        self.kv_manager.free(request.request_id)
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_prefill_tokens = 0
        # drafts come from the MTP cache that was just freed; the recompute drafts anew
        request.draft_token_ids.clear()
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        return request

    def update_from_output(
        self, output: SchedulerOutput, sampled: list[int | None], now: float
    ) -> tuple[list[StepOutput], list[Request]]:
        """Advance every scheduled request by the step's tokens and append its sample.

        Args:
            sampled: one entry per scheduled request: the token sampled from its last
                position, or None for a prefill chunk that does not end the prefill, or
                (a verify step) the tokens accepted: the drafts that agreed and the token
                after them. A verify step keeps the K/V of its first token and of the
                accepted drafts only; the slots of rejected drafts lie past the computed
                length and are written again by the next step before anything reads them.

        Returns:
            the per-request step outputs and the requests that finished (blocks freed).
        """
        step_outputs: list[StepOutput] = []
        finished: list[Request] = []
        caching, cache_blocks = self._caching, self.kv_manager.cache_blocks
        sizes = self._block_sizes
        for item, token in zip(output.scheduled, sampled, strict=True):
            request = item.request
            if isinstance(token, list):
                kept, reason = self._append_accepted(request, token, now)
                request.num_computed_tokens += len(token)
                if caching:
                    # before a finish frees them; K/V and tokens are both known up to here
                    cache_blocks(request, min(request.num_computed_tokens, request.num_tokens))
                if reason is not None:
                    self._finish(request, reason, now)
                    finished.append(request)
                step_outputs.append(StepOutput(request.request_id, kept, reason))
                continue
            request.num_computed_tokens += item.num_new_tokens
            if caching and (
                # (a prefill chunk's blocks were offered when it was scheduled)
                item.num_new_tokens > 1 or any(request.num_computed_tokens % b == 0 for b in sizes)
            ):
                # Before a finish frees them: freed blocks keep their hashes.
                cache_blocks(request, request.num_computed_tokens)
            if token is None:
                step_outputs.append(StepOutput(request.request_id, [], None))
                continue
            request.output_token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            reason = self._finish_reason(request, token)
            if reason is not None:
                self._finish(request, reason, now)
                finished.append(request)
            step_outputs.append(StepOutput(request.request_id, [token], reason))
        return step_outputs, finished

    def _append_accepted(
        self, request: Request, tokens: list[int], now: float
    ) -> tuple[list[int], FinishReason | None]:
        """Append a verify step's accepted tokens up to the first that ends the request:
        (the tokens appended, why it ends or None)."""
        for count, token in enumerate(tokens, start=1):
            request.output_token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            reason = self._finish_reason(request, token)
            if reason is not None:
                return tokens[:count], reason
        return list(tokens), None

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.sampling_params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            return FinishReason.STOP
        num_output = len(request.output_token_ids)
        if num_output >= params.max_tokens:
            return FinishReason.LENGTH
        if len(request.prompt_token_ids) + num_output >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason, now: float) -> None:
        # Release chain: blocks go back to the pool the moment a request ends.
        self.kv_manager.free(request.request_id)
        self.running.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = now

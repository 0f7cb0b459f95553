"""Requests, their sampling parameters and the outputs the engine hands back."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvskill.core.errors import BadInputError


class FinishReason(str, Enum):
    """Why a request stopped: a stop/EOS token, or a length limit."""

    STOP = "stop"
    LENGTH = "length"


class RequestStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class SamplingParams:
    """How to pick each generated token and when to stop.

    ``temperature == 0`` is greedy decoding (top-k / top-p ignored). With a ``seed`` a
    request's sampled tokens depend only on the seed and its own logits, never on which
    other requests share its steps.
    """

    #: generated tokens at most (the first one comes from the prefill step)
    max_tokens: int = 16
    temperature: float = 0.0
    #: keep the k most likely tokens; 0 disables
    top_k: int = 0
    #: keep the smallest set of tokens whose probability reaches top_p; 1.0 disables
    top_p: float = 1.0
    seed: int | None = None
    #: extra token ids that end a request (the id is kept in the output, like EOS)
    stop_token_ids: Sequence[int] = ()
    #: keep generating past the model's EOS token (stop_token_ids still apply)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise BadInputError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise BadInputError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise BadInputError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise BadInputError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise BadInputError(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise BadInputError(f"top_p must be in (0, 1] (1 disables), got {self.top_p!r}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True, eq=False)
class Request:
    """One generation request and its progress. Owned by the scheduler while unfinished.

    Token bookkeeping (``all_token_ids = prompt + output``)::

        prompt: p0 p1 p2 p3 | output: o0 o1
        num_computed_tokens = 5  -> p0..p3, o0 are in the KV cache; o1 is fed next step
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    #: position of the request in submission order (used for tie-breaks and seeding)
    index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    #: tokens whose K/V are in the cache
    num_computed_tokens: int = 0
    #: tokens the current (re)admission must prefill: the prompt, or prompt + outputs after
    #: a preemption (recompute). Prefill is done when num_computed_tokens reaches it.
    num_prefill_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    #: prefix caching: group key -> hashes of the request's full blocks so far (see
    #: ``prefix_hash.block_hashes``); kept across preemption, the tokens do not change
    block_hashes: dict[str, list[bytes]] = field(default_factory=dict)
    #: tokens of the last admission served from the prefix cache (0 = none)
    num_cached_tokens: int = 0
    #: speculative decoding: tokens the MTP layers drafted after the last one, fed with it
    #: in the next (verify) step; dropped on preemption
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prefill_tokens

    def token_at(self, position: int) -> int:
        """Token ``position`` of prompt + output (what a decode step feeds)."""
        num_prompt = len(self.prompt_token_ids)
        if position < num_prompt:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - num_prompt]

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """Tokens ``[start, stop)`` of prompt + output without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]

    def fed_token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens ``[start, stop)`` a step feeds: prompt + output, then the drafts."""
        num_tokens = self.num_tokens
        if stop <= num_tokens:
            return self.token_ids_slice(start, stop)
        return self.token_ids_slice(start, num_tokens) + self.draft_token_ids[: stop - num_tokens]


@dataclass(slots=True)
class RequestOutput:
    """The result of one request (final from ``generate``; partial when streaming)."""

    request_id: str
    prompt_token_ids: list[int]
    #: generated ids, including the EOS / stop token that ended the request
    token_ids: list[int]
    finish_reason: FinishReason | None
    #: seconds from submission to the first generated token
    ttft_s: float | None
    #: seconds from submission to the last generated token
    latency_s: float | None
    #: generated tokens per second over the request's whole life (submission to finish)
    tokens_per_s: float | None
    num_preemptions: int = 0
    #: tokens its last admission found in the prefix cache (their prefill was skipped)
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "prompt_len": len(self.prompt_token_ids),
            "token_ids": list(self.token_ids),
            "finish_reason": None if self.finish_reason is None else self.finish_reason.value,
            "ttft_s": self.ttft_s,
            "latency_s": self.latency_s,
            "tokens_per_s": self.tokens_per_s,
            "num_preemptions": self.num_preemptions,
            "num_cached_tokens": self.num_cached_tokens,
        }

    @classmethod
    def from_request(cls, request: Request) -> RequestOutput:
        ttft = latency = rate = None
        if request.first_token_time is not None:
            ttft = request.first_token_time - request.arrival_time
        if request.finish_time is not None:
            latency = request.finish_time - request.arrival_time
            if latency > 0:
                rate = len(request.output_token_ids) / latency
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
            ttft_s=ttft,
            latency_s=latency,
            tokens_per_s=rate,
            num_preemptions=request.num_preemptions,
            num_cached_tokens=request.num_cached_tokens,
        )


@dataclass(slots=True)
class StepOutput:
    """What one engine step produced for one request (the streaming unit)."""

    request_id: str
    #: tokens generated this step (empty for a non-final prefill chunk)
    new_token_ids: list[int]
    finish_reason: FinishReason | None

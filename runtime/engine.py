"""The generation loop: schedule, build inputs, run the model, sample, release (one step)."""

from __future__ import annotations

import inspect
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from kvskill.core.errors import BadInputError
from kvskill.runtime.executor_host import is_executor_model
from kvskill.runtime.forward_context import ForwardMetaData, forward_context
from kvskill.runtime.kv_cache_manager import KVCacheManager
from kvskill.runtime.model_output import logits_of
from kvskill.runtime.request import Request, RequestOutput, SamplingParams, StepOutput
from kvskill.runtime.sampler import Sampler, make_generator
from kvskill.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvskill.runtime.speculative import SpeculationStats, Speculator
from kvskill.runtime.step_inputs import build_step_inputs
from torch import Tensor, nn

if TYPE_CHECKING:
    from kvskill.runtime.captured_decode import CapturedDecode
    from kvskill.runtime.screened_head import ScreenedHead


@dataclass(slots=True)
class StepRecord:
    """What one step fed the model and got back; handed to step hooks (chains, verify)."""

    step_index: int
    metadata: ForwardMetaData
    request_ids: list[str]
    #: prompt length of each request
    prompt_lens: list[int]
    #: generated tokens each request had before this step
    num_output_tokens: list[int]
    #: ``[B, V]`` logits of each request's last token this step (fp32)
    logits: Tensor
    #: the token sampled per request, None for a prefill chunk that does not end a prompt
    sampled: list[int | None]
    preempted_ids: list[str]


StepHook = Callable[[StepRecord], None]


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    num_prompt_tokens: int = 0  #: prompt tokens computed (recomputation included)
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    #: highest number of blocks in use at once, per group
    peak_blocks_used: dict[str, int] = field(default_factory=dict)
    step_s: float = 0.0  #: wall time inside ``step()``, step hooks excluded
    forward_s: float = 0.0  #: of which inside the model forward
    #: prefix caching on for this engine (see ``KVCacheManager.prefix_caching_disabled_reason``)
    prefix_caching: bool = False
    #: tokens of every admission looked up in the prefix cache (readmissions included)
    num_prefix_query_tokens: int = 0
    #: of which found cached (their prefill was skipped)
    num_prefix_hit_tokens: int = 0
    #: blocks carrying a prefix-cache hash after the last step (held or free)
    num_cached_blocks: int = 0
    #: speculative decoding's counts (acceptance rate, tokens per step); None when off
    speculation: SpeculationStats | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Tokens hit / tokens looked up (0.0 before any lookup)."""
        if not self.num_prefix_query_tokens:
            return 0.0
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens

    def to_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "num_prefill_steps": self.num_prefill_steps,
            "num_decode_steps": self.num_decode_steps,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_preemptions": self.num_preemptions,
            "peak_blocks_used": dict(self.peak_blocks_used),
            "step_s": self.step_s,
            "forward_s": self.forward_s,
            "prefix_caching": self.prefix_caching,
            "num_prefix_query_tokens": self.num_prefix_query_tokens,
            "num_prefix_hit_tokens": self.num_prefix_hit_tokens,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "num_cached_blocks": self.num_cached_blocks,
            "speculation": None if self.speculation is None else self.speculation.to_dict(),
        }


class LLMEngine:
    """Continuous batching over a converted model and its KV-cache manager.

    The engine owns the loop (``step``); the scheduler owns the queues; the KV manager owns
    the blocks. Requests may be added between any two steps.
    """

    def __init__(
        self,
        model: nn.Module,
        kv_manager: KVCacheManager,
        *,
        config: SchedulerConfig,
        vocab_size: int,
        eos_token_ids: Iterable[int] = (),
        attention_mask: Tensor | None,
        device: torch.device,
        seed: int = 0,
        step_hooks: Sequence[StepHook] = (),
        screened_head: ScreenedHead | None = None,
        captured_decode: CapturedDecode | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        self.model = model
        #: speculative decoding with the model's MTP layers (None: one token per decode step)
        self.speculator = speculator
        #: decode steps run as a graph captured per batch bucket (None: every step eager)
        self.captured_decode = captured_decode
        #: the output head's bf16 screen, used on steps whose requests are all greedy
        self.screened_head = screened_head
        #: whether model.forward takes logits_to_keep (read on the first step)
        self._takes_logits_to_keep: bool | None = None
        self.kv_manager = kv_manager
        self.config = config
        self.vocab_size = vocab_size
        self.device = device
        self.seed = seed
        self.attention_mask = attention_mask
        self.scheduler = Scheduler(kv_manager, config, frozenset(int(t) for t in eos_token_ids))
        self.sampler = Sampler()
        self.step_hooks: list[StepHook] = list(step_hooks)
        self.stats = EngineStats(
            peak_blocks_used=dict.fromkeys(kv_manager.group_keys, 0),
            prefix_caching=kv_manager.enable_prefix_caching,
            speculation=None if speculator is None else speculator.stats,
        )
        self._requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self._counter = itertools.count()

    # ---- requests ----------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: Sequence[int] | Tensor,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id.

        Raises:
            BadInputError: for an empty prompt, an id outside the vocabulary, a prompt that
                leaves no room under max_model_len, bad sampling parameters or a duplicate
                id. Nothing is queued then, and requests already queued are unaffected.
        """
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise BadInputError(
                f"sampling_params must be SamplingParams, got {type(params).__name__}"
            )
        index = next(self._counter)
        request_id = str(index) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise BadInputError(f"request id {request_id!r} is already in use")
        prompt = self.validate_prompt(prompt_token_ids, request_id)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            arrival_time=time.perf_counter(),
            index=index,
        )
        self._requests[request_id] = request
        self._generators[request_id] = make_generator(
            params, engine_seed=self.seed, index=index, device=self.device
        )
        self.scheduler.add(request)
        return request_id

    def validate_prompt(
        self, prompt_token_ids: Sequence[int] | Tensor, request_id: str
    ) -> list[int]:
        """The prompt as a list of ints, or a BadInputError naming the request and the fault."""
        if isinstance(prompt_token_ids, Tensor):
            if prompt_token_ids.dim() != 1 or prompt_token_ids.is_floating_point():
                raise BadInputError(
                    f"request {request_id}: prompt tensor must be 1-D integer, got "
                    f"{tuple(prompt_token_ids.shape)} {prompt_token_ids.dtype}"
                )
            prompt = prompt_token_ids.tolist()
        elif isinstance(prompt_token_ids, (str, bytes)):
            raise BadInputError(
                f"request {request_id}: prompts are token id lists (this runtime has no tokenizer)"
            )
        else:
            prompt = list(prompt_token_ids)
        if not prompt:
            raise BadInputError(
                f"request {request_id}: the prompt is empty; give at least one token id"
            )
        # One pass each in C for the usual all-valid prompt; the loop below names the fault.
        valid = all(type(t) is int for t in prompt) and (
            min(prompt) >= 0 and max(prompt) < self.vocab_size
        )
        for pos, token in enumerate(() if valid else prompt):
            if isinstance(token, bool) or not isinstance(token, int):
                raise BadInputError(
                    f"request {request_id}: prompt[{pos}] = {token!r} is not an integer token id"
                )
            if not 0 <= token < self.vocab_size:
                raise BadInputError(
                    f"request {request_id}: prompt[{pos}] = {token} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        if len(prompt) >= self.config.max_model_len:
            raise BadInputError(
                f"request {request_id}: the prompt has {len(prompt)} tokens, which leaves no room "
                f"to generate under max_model_len={self.config.max_model_len}; shorten it "
                "or raise max_model_len"
            )
        return prompt

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_output(self, request_id: str) -> RequestOutput:
        return RequestOutput.from_request(self._requests[request_id])

    def pop_output(self, request_id: str) -> RequestOutput:
        """The request's output; forgets a finished request so long runs do not accumulate."""
        request = self._requests[request_id]
        output = RequestOutput.from_request(request)
        if output.finished:
            del self._requests[request_id]
            self._generators.pop(request_id, None)
        return output

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one prefill or decode step over the scheduled requests."""
        started = time.perf_counter()
        output = self.scheduler.schedule()
        if not output.scheduled:
            return []
        self._account_blocks()
        if self.speculator is not None:
            # (step hooks record one logit row per request; a verify step scores several)
            step_outputs, generated, forward_s = self.speculator.run(self, output)
            self._count(output, generated, forward_s)
            self.stats.step_s += time.perf_counter() - started
            return step_outputs
        inputs = build_step_inputs(
            output, self.kv_manager, attention_mask=self.attention_mask, device=self.device
        )
        forward_started = time.perf_counter()
        with self._head_screening(output):
            logits = self._captured(output, inputs)
            if logits is None:
                logits = self._forward(
                    inputs.input_ids, inputs.position_ids, inputs.logits_indices, inputs.metadata
                )
        forward_s = time.perf_counter() - forward_started

        sampled = self._sample(output, logits)
        # Only step hooks read it; a decode step of a big batch should not pay for it.
        num_outputs_before = (
            [len(s.request.output_token_ids) for s in output.scheduled] if self.step_hooks else []
        )
        step_outputs, _ = self.scheduler.update_from_output(output, sampled, time.perf_counter())
        self._count(output, len(sampled) - sampled.count(None), forward_s)
        # Hooks (recorders of verify and the chains) are not engine time.
        self.stats.step_s += time.perf_counter() - started
        if self.step_hooks:
            record = StepRecord(
                step_index=self.stats.num_steps - 1,
                metadata=inputs.metadata,
                request_ids=[s.request.request_id for s in output.scheduled],
                prompt_lens=[len(s.request.prompt_token_ids) for s in output.scheduled],
                num_output_tokens=num_outputs_before,
                logits=logits,
                sampled=sampled,
                preempted_ids=[r.request_id for r in output.preempted],
            )
            for hook in self.step_hooks:
                hook(record)
        return step_outputs

    def _captured(self, output: SchedulerOutput, inputs) -> Tensor | None:
        """The logits of a decode step from its captured graph; None to run it eagerly."""
        if self.captured_decode is None or output.is_prefill:
            return None
        if is_executor_model(self.model) or not self._keeps_logit_rows():
            # the capture keeps the requests' rows with logits_to_keep, as _forward does
            self.captured_decode.run_eagerly("the model's forward takes no logits_to_keep")
            return None
        return self.captured_decode(inputs)

    def _head_screening(self, output: SchedulerOutput) -> AbstractContextManager:
        """Screen the output head this step when it can: every request greedy (a screened row
        holds -inf outside its candidates, no distribution to sample from) and no step hook
        (verify and the chains record the logits)."""
        head = self.screened_head
        if head is None:
            return nullcontext()
        greedy = all(s.request.sampling_params.is_greedy for s in output.scheduled)
        return head.screening(greedy and not self.step_hooks)

    def _forward(
        self, input_ids: Tensor, position_ids: Tensor, logits_indices: Tensor, md
    ) -> Tensor:
        if is_executor_model(self.model):
            return self._forward_executor_model(input_ids, position_ids, logits_indices, md)
        if not self._keeps_logit_rows():
            return self._forward_all_logits(input_ids, position_ids, logits_indices, md)
        with torch.inference_mode(), forward_context(md):
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=logits_indices,
            )
        logits = logits_of(out)
        expected = (1, logits_indices.numel())
        if logits.dim() != 3 or tuple(logits.shape[:2]) != expected:
            raise RuntimeError(
                f"the model returned logits of shape {tuple(logits.shape)}; expected "
                f"[1, {expected[1]}, vocab] (one row per request: does its forward honour "
                "logits_to_keep given as an index tensor?)"
            )
        return logits[0].float()

    def _keeps_logit_rows(self) -> bool:
        """Whether the model's forward takes ``logits_to_keep`` (transformers >= 4.50 models
        accept an index tensor there); transformers 4.46 models take ``num_logits_to_keep: int``
        and vendor files often neither. Read once per model from the forward's signature."""
        if self._takes_logits_to_keep is None:
            try:
                params = inspect.signature(self.model.forward).parameters
            except (TypeError, ValueError):  # a forward without a readable signature
                params = {}
            self._takes_logits_to_keep = "logits_to_keep" in params
        return self._takes_logits_to_keep

    def _forward_executor_model(
        self, input_ids: Tensor, position_ids: Tensor, logits_indices: Tensor, md
    ) -> Tensor:
        """A model of the framework's executor contract: the packed step as [T] tensors and the
        metadata passed explicitly; it returns [B, 1, vocab], the rows of the requests' last
        tokens (a prefill step) or of every token (a decode step, one per request here)."""
        with torch.inference_mode(), forward_context(md):
            logits = self.model(input_ids.view(-1), position_ids.view(-1), forward_metadata=md)
        expected = (logits_indices.numel(), 1)
        if (
            not isinstance(logits, Tensor)
            or logits.dim() != 3
            or tuple(logits.shape[:2]) != expected
        ):
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise RuntimeError(
                f"the model returned logits {shape}; the executor contract returns "
                f"[{expected[0]}, 1, vocab], one row per request of the step"
            )
        return logits[:, 0].float()

    def _forward_all_logits(
        self, input_ids: Tensor, position_ids: Tensor, logits_indices: Tensor, md
    ) -> Tensor:
        """A forward that cannot keep rows by index computes every position's logits; the
        rows of the requests' last tokens are picked here."""
        with torch.inference_mode(), forward_context(md):
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        logits = logits_of(out)
        if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(input_ids.shape):
            raise RuntimeError(
                f"the model returned logits of shape {tuple(logits.shape)}; expected "
                f"[1, {input_ids.shape[-1]}, vocab] (one row per token, as its forward takes "
                "no logits_to_keep)"
            )
        return logits[0, logits_indices].float()

    def _sample(self, output: SchedulerOutput, logits: Tensor) -> list[int | None]:
        # Only rows whose step reaches the end of the request's prefill (or decodes) sample;
        # a chunk in the middle of a prompt has no next token yet.
        scheduled = output.scheduled
        if output.is_prefill:
            rows = [
                i
                for i, s in enumerate(scheduled)
                if s.start + s.num_new_tokens >= s.request.num_prefill_tokens
            ]
        else:
            rows = range(len(scheduled))  # every decoding request samples
        if not rows:
            return [None] * len(scheduled)
        requests = [scheduled[i].request for i in rows]
        generators = self._generators
        tokens = self.sampler(
            logits if len(rows) == len(scheduled) else logits[list(rows)],
            [r.sampling_params for r in requests],
            [generators[r.request_id] for r in requests],
        )
        if len(rows) == len(scheduled):
            return tokens
        sampled: list[int | None] = [None] * len(scheduled)
        for i, token in zip(rows, tokens, strict=True):
            sampled[i] = token
        return sampled

    def _account_blocks(self) -> None:
        free = self.kv_manager.num_free_blocks
        peak = self.stats.peak_blocks_used
        for key, initial in self.kv_manager.initial_free_blocks.items():
            peak[key] = max(peak.get(key, 0), initial - free[key])

    def _count(self, output: SchedulerOutput, num_generated: int, forward_s: float) -> None:
        stats = self.stats
        stats.num_steps += 1
        if output.is_prefill:
            stats.num_prefill_steps += 1
            # (decoding requests riding along feed a generated token, not a prompt token)
            stats.num_prompt_tokens += sum(
                s.num_new_tokens for s in output.scheduled if s.start < s.request.num_prefill_tokens
            )
        else:
            stats.num_decode_steps += 1
        stats.num_generated_tokens += num_generated
        stats.num_preemptions += len(output.preempted)
        stats.forward_s += forward_s
        if stats.prefix_caching:
            scheduler = self.scheduler
            stats.num_prefix_query_tokens = scheduler.num_prefix_query_tokens
            stats.num_prefix_hit_tokens = scheduler.num_prefix_hit_tokens
            stats.num_cached_blocks = self.kv_manager.num_cached_blocks

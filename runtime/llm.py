"""The Python API: ``LLM(dir_or_model).generate(prompt_token_ids, SamplingParams)``."""

from __future__ import annotations

import gc
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from kvskill.core.attn_types import AttnType
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.runtime.device import select_device
from kvskill.runtime.engine import EngineStats, LLMEngine, StepHook
from kvskill.runtime.engine_config import EngineConfig
from kvskill.runtime.exact_steps import exact_steps
from kvskill.runtime.executor_host import is_executor_model
from kvskill.runtime.fast_paths import FastPaths, switch_on_fast_paths
from kvskill.runtime.kv_cache_setup import prepare_kv_cache
from kvskill.runtime.loader import generation_eos_token_id, load_model, resolve_dtype
from kvskill.runtime.masks import get_init_attn_mask
from kvskill.runtime.ops.reference.npu_profile import (
    check_run_block_size,
    run_profile,
    use_npu_profile,
)
from kvskill.runtime.request import RequestOutput, SamplingParams, StepOutput
from kvskill.runtime.scheduler import SchedulerConfig
from torch import Tensor, nn

logger = logging.getLogger(__name__)

Prompt = Sequence[int] | Tensor


class LLM:
    """A converted model, its paged KV cache and a continuous-batching engine.

    Examples::

        config = EngineConfig(random_weights=True, num_blocks=64, block_size=128)
        llm = LLM("converted/", config)
        outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8))
        outs[0].token_ids, outs[0].finish_reason, outs[0].ttft_s

    Every setting is a field of ``EngineConfig`` (``runtime/engine_config.py``, with its
    default); ``LLM("converted/", random_weights=True, num_blocks=64)`` sets the same fields
    by keyword. The settings named below are those fields.

    ``model`` may also be an already-built ``nn.Module`` with ``get_cache_info()`` (e.g. a
    converted model that shares its weights with a reference), in which case ``dtype``,
    ``random_weights`` and ``trust_remote_code`` are ignored and the module stays on its
    device.

    The first LLM of a process freezes the heap it finds (``gc.freeze()``: the imported
    torch and transformers, some 350k objects), unless ``freeze_startup_heap=False``. Python's
    full garbage collections otherwise walk all of it, about 0.2 s each, and a generation of a
    few thousand steps triggers several; frozen objects are skipped. They are still freed when
    their reference count drops; only reference cycles among them are never collected.

    Prefix caching (``enable_prefix_caching``, on by default): the K/V of every full block
    computed stays in the pool under a hash of its tokens and of all tokens before it, until
    the block is needed for something else (least recently freed first); a new request with
    the same leading tokens shares those blocks and prefills only the rest. Greedy outputs
    are the same with it on or off (bit for bit in an exact run; the fast paths' kernels may
    sum in another order for another batch shape). A model with a recurrent-state group (Mamba, gated delta
    nets) keeps it off: ``prefix_caching_disabled_reason`` says why.

    Fast by default, exact on request (``runtime/fast_paths.py``): where this machine and
    model allow them, the fp32 linear layers run through oneDNN with weights reordered once
    (``prepack_linear``: 2-3x faster than MKL on the CPU measured), the RMSNorm, gated-MLP and
    rotary-embedding code through one-pass compiled kernels (``fuse_layers``, each module
    only when it agrees with its own forward on a probe input), and greedy steps find their
    tokens from a bf16 pass over the output head (``screen_output_head``, CPUs with native
    bf16; each token the exact argmax of fp32 dot products, by a proven rounding bound).
    Each sums in another order than the model's own code, so logits differ in the last bits
    and a greedy token can flip where two logits tie that closely. ``exact=True`` turns them
    all off: the model's own code, bit for bit (what ``verify`` runs); ``fast_paths`` says
    which ran and why any did not.

    ``mix_decode_with_prefill=True`` (with chunked prefill): a step that computes prompt
    tokens also feeds every decoding request its next token, out of the same token budget, so
    running requests keep generating while new prompts are computed (``runtime/scheduler.py``).
    A model with a state group (Mamba) decodes in steps of its own whatever the flag
    (``engine.scheduler.ride_along_disabled_reason`` says why).

    ``speculative_tokens=k``: decode with the model's MTP layer as drafter
    (``runtime/mtp.py``, ``runtime/speculative.py``): its caches are merged into the model's
    pools, each decode step verifies the last token and k drafts per request in one forward,
    and greedy tokens equal one-token-per-step decoding. ``stats.speculation`` gives the
    acceptance rate and tokens per step. Step hooks see one logit row per request per step,
    which a verify step does not have: they are refused with speculation.

    The NPU profile (``runtime/ops/reference/npu_profile.py``) is on by default: every step
    runs the reference operators against the NPU's shape limits (paged block sizes: a
    multiple of 128 in [128, 512]), its head counts and dims, and, in float16/bfloat16, its
    dtypes, so a run that passes here makes calls the device takes. ``cpu_only_shapes=True``
    (or ``KVSKILL_CPU_ONLY_SHAPES=1``) turns it off for tiny CPU-only shapes;
    ``npu_profile=`` gives an exact profile (verify's shrunk twin leaves out dims).
    """

    def __init__(
        self,
        model: str | Path | nn.Module,
        config: EngineConfig | None = None,
        *,
        step_hooks: Sequence[StepHook] = (),
        mtp_state: dict[str, Tensor] | None = None,
        **settings: Any,
    ) -> None:
        """Load MODEL (a directory or a built module) and set up its KV pools and engine.

        Args:
            config: every setting (``EngineConfig``); default: its defaults.
            step_hooks: called with a ``StepRecord`` after every step.
            mtp_state: a built module's MTP-layer tensors under their checkpoint names
                (``model.layers.<N+i>.*``), for speculative_tokens; a directory's come from
                its checkpoint.
            **settings: ``EngineConfig`` fields, replacing those of CONFIG.
        """
        config = replace(config or EngineConfig(), **settings)
        if config.speculative_tokens and step_hooks:
            raise BadInputError(
                "step hooks record one logit row per request per step; a speculative verify "
                "step scores several: give speculative_tokens=0 to record steps"
            )
        #: the settings this LLM runs with
        self.engine_config = config
        if config.freeze_startup_heap:
            _freeze_startup_heap()
        npu_profile = config.npu_profile
        if npu_profile is None:
            dtype_name = str(config.dtype if not isinstance(model, nn.Module) else _dtype_of(model))
            npu_profile = run_profile(
                cpu_only_shapes=config.cpu_only_shapes,
                dtype=dtype_name.removeprefix("torch."),
                real_dims=True,
            )
        #: the hardware-only limits every step is checked against (``profile_report``)
        self.npu_profile = npu_profile
        #: rank 0's handle on the tensor-parallel ranks (None in one process)
        self.tensor_parallel = None
        #: which fast paths run, and why any does not (``runtime/fast_paths.py``)
        self.fast_paths: FastPaths | None = None
        #: fp32 CPU linear layers run through oneDNN (0 when prepack_linear is off)
        self.num_prepacked_linears = 0
        #: RMSNorm, gated-MLP and rope-calling modules on the fused kernels (0 when off)
        self.num_fused_layers = 0
        #: the output head's bf16 screen for greedy steps (None when screen_output_head is off)
        self.output_head_screen = None
        if config.tensor_parallel_size != 1:
            from kvskill.runtime.distributed.start import start_tensor_parallel

            self.tensor_parallel = start_tensor_parallel(
                model,
                config.tensor_parallel_size,
                backend=config.tp_backend,
                dtype=config.dtype,
                device=config.device,
                seed=config.seed,
                random_weights=config.random_weights,
                trust_remote_code=config.trust_remote_code,
            )
        self._given_mtp_state = mtp_state
        try:
            self._set_up(model, config, step_hooks)
        except BaseException:
            self.close(graceful=False)
            raise

    def _set_up(self, model, config: EngineConfig, step_hooks: Sequence[StepHook]) -> None:
        if self.tensor_parallel is not None:
            shard = self.tensor_parallel.shard
            self.model, self.config, self.model_dir = (
                self.tensor_parallel.model,
                shard.config,
                shard.model_dir,
            )
        else:
            self.model, self.config, self.model_dir, mtp_state = _acquire_model(model, config)
            if mtp_state is None:
                mtp_state = self._given_mtp_state
        #: the MTP layers drafting for speculative decoding (None when speculative_tokens is 0)
        self.drafter = self._build_drafter(config, mtp_state) if config.speculative_tokens else None
        self.fast_paths = switch_on_fast_paths(self.model, config)
        self.num_prepacked_linears = self.fast_paths.get("prepack_linear").count
        self.num_fused_layers = self.fast_paths.get("fuse_layers").count
        self.output_head_screen = self.fast_paths.screen
        #: the decoder's config: a vision-language model keeps vocab, positions and EOS there
        self.text_config = _text_config(self.config)
        param = next(self.model.parameters(), None)
        self.device = param.device if param is not None else select_device(config.device)
        kv_kwargs = dict(
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            kv_memory_bytes=config.kv_memory_bytes,
            use_hybrid_blocks=config.use_hybrid_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len
            or getattr(self.text_config, "max_position_embeddings", None),
            log_layout=config.log_layout,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        setup = prepare_kv_cache(
            self.model,
            device=self.device,
            free_block_order_seed=config.free_block_order_seed,
            drafter=self.drafter,
            next_n=config.speculative_tokens if self.drafter is not None else 0,
            **kv_kwargs,
        )
        if self.tensor_parallel is not None:
            # every rank builds its own pool (its heads) with rank 0's block count
            self.tensor_parallel.share_kv_setup(kv_kwargs, setup)
        self.cache_info, self.kv_manager = setup.cache_info, setup.manager
        if self.npu_profile.shapes:  # the paged attention's block sizes, as the run chose them
            # a compressed entry (compress_ratio > 1) is no FA cache: its token block holds
            # block_size // ratio rows, and the operator reading them checks its own block size
            for size in sorted(
                {
                    entry.block_size
                    for _, entry in self.cache_info.entries()
                    if entry.attn_type in (AttnType.FULL_ATTENTION, AttnType.SLIDING_WINDOW)
                    and entry.compress_ratio == 1
                }
            ):
                check_run_block_size(size)
        #: the rule that sized the KV pools, and why (reported by ``kvskill run``)
        self.kv_budget = setup.budget
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            enable_chunked_prefill=config.enable_chunked_prefill,
            mix_decode_with_prefill=config.mix_decode_with_prefill,
            num_speculative_tokens=config.speculative_tokens,
            max_model_len=self._resolve_max_model_len(
                config.max_model_len, config.max_num_batched_tokens, config.enable_chunked_prefill
            ),
        )
        self.engine = LLMEngine(
            self.model,
            self.kv_manager,
            config=scheduler_config,
            vocab_size=self._vocab_size(),
            eos_token_ids=self._eos_token_ids(config.eos_token_id),
            attention_mask=get_init_attn_mask(2048, device=self.device),
            device=self.device,
            seed=config.seed,
            step_hooks=step_hooks,
            screened_head=self.output_head_screen,
            captured_decode=self._captured_decode(config, scheduler_config.max_model_len),
            speculator=self._speculator(config),
        )
        self._batch_ids = itertools.count()

    # ---- set-up helpers -----------------------------------------------------------------
    def _build_drafter(self, config: EngineConfig, mtp_state: dict | None):
        """The model's MTP layers with their checkpoint tensors (speculative_tokens > 0)."""
        from kvskill.runtime.mtp import MtpDrafter

        if is_executor_model(self.model):
            raise BadInputError(
                "speculative_tokens drafts with transformers-style MTP layers; this model "
                "follows the framework executor's contract"
            )
        drafter = MtpDrafter(self.model)
        if mtp_state:
            drafter.load_checkpoint_state(mtp_state)
        elif mtp_state is None:
            raise BadInputError(
                "speculative_tokens reads the MTP layers' tensors from a converted directory's "
                "checkpoint; give the directory, or a built module with mtp_state="
            )
        elif not config.random_weights:
            raise BadInputError(
                "the checkpoint has no MTP tensors (model.layers.<N+i>.*); speculative_tokens "
                "drafts with them"
            )
        return drafter

    def _speculator(self, config: EngineConfig):
        if self.drafter is None:
            return None
        from kvskill.runtime.speculative import Speculator, speculation_refusal

        refusal = speculation_refusal(
            {key: self.kv_manager.managers[key].attn_type for key in self.kv_manager.group_keys},
            [
                name
                for name, module in self.model.named_modules()
                if getattr(module, "attn_type", None) == AttnType.MAMBA.value
                and not getattr(module, "verify_state_rows", False)
            ],
        )
        if refusal is not None:
            raise UnsupportedModelError(f"speculative_tokens: {refusal}")
        return Speculator(self.drafter, config.speculative_tokens)

    def _captured_decode(self, config: EngineConfig, max_model_len: int):
        """The per-bucket decode graph when ``graph`` is on (transformers-style forwards only:
        a framework executor model keeps its own graph mode)."""
        if not config.graph:
            return None
        if is_executor_model(self.model):
            raise BadInputError(
                "graph=True captures transformers-style forwards; this model "
                "follows the framework executor's contract"
            )
        from kvskill.runtime.captured_decode import CapturedDecode

        return CapturedDecode(
            self.model,
            self.kv_manager,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_model_len,
        )

    def _resolve_max_model_len(self, requested: int | None, budget: int, chunked: bool) -> int:
        capacity = self.kv_manager.max_tokens_per_request(
            max_num_batched_tokens=budget, enable_chunked_prefill=chunked
        )
        if requested is not None:
            if requested < 2:
                raise BadInputError(f"max_model_len must be >= 2, got {requested}")
            if requested > capacity:
                raise BadInputError(
                    f"the KV cache holds at most {capacity} tokens for one request but "
                    f"max_model_len={requested}; give more blocks or KV memory, or a smaller "
                    "max_model_len"
                )
            return requested
        limit = getattr(self.text_config, "max_position_embeddings", None) or capacity
        if capacity < 2:
            raise BadInputError(
                f"the KV cache holds only {capacity} token(s) for one request; give more "
                "blocks or KV memory"
            )
        if capacity < limit:
            logger.info(
                "max_model_len capped by the KV cache at %d tokens (model allows %d)",
                capacity,
                limit,
            )
        return min(limit, capacity)

    def _vocab_size(self) -> int:
        vocab = getattr(self.text_config, "vocab_size", None)
        if vocab is None:
            head = (
                self.model.get_output_embeddings()
                if hasattr(self.model, "get_output_embeddings")
                else None
            )
            vocab = getattr(head, "out_features", None)
        if vocab is None:
            raise BadInputError(
                "cannot tell the vocabulary size: the model has no config.vocab_size"
            )
        return int(vocab)

    def _eos_token_ids(self, override: int | Sequence[int] | None) -> list[int]:
        value = override
        if value is None:
            value = generation_eos_token_id(self.model_dir)
        for config in (self.text_config, self.config):
            # NOTE: vision-language checkpoints may name EOS on the composite config only
            value = value if value is not None else getattr(config, "eos_token_id", None)
        if value is None:
            return []
        return [int(value)] if isinstance(value, int) else [int(v) for v in value]

    # ---- generation ---------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on (asked for, and the model's groups allow it)."""
        return self.kv_manager.enable_prefix_caching

    @property
    def prefix_caching_disabled_reason(self) -> str | None:
        """Why prefix caching is off although it was asked for; None otherwise."""
        return self.kv_manager.prefix_caching_disabled_reason

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    def generate(
        self,
        prompts: Sequence[Prompt] | Prompt,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_step: Callable[[list[StepOutput]], None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        Request ids are ``"<call>-<index>"``: the number of this ``generate``/
        ``generate_stream`` call on this LLM (from 0) and the prompt's index, so step hooks
        can map a ``StepRecord`` row back to its prompt.

        Raises:
            BadInputError: for any bad prompt or parameter, before anything runs; the
                message names the prompt's index.
        """
        request_ids = self._add_all(prompts, sampling_params)
        for step_outputs in self._run():
            if on_step is not None:
                on_step(step_outputs)
        return [self.engine.pop_output(rid) for rid in request_ids]

    def generate_stream(
        self,
        prompts: Sequence[Prompt] | Prompt,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StepOutput]:
        """Yield tokens as they come: one StepOutput per request per step that produced one.

        The last item for a request has ``finish_reason`` set. Request ids are the ones
        ``llm.engine.get_output`` accepts, and are returned in order by ``last_request_ids``.
        """
        self.last_request_ids = self._add_all(prompts, sampling_params)
        for step_outputs in self._run():
            for item in step_outputs:
                if item.new_token_ids or item.finish_reason is not None:
                    yield item

    def _run(self) -> Iterator[list[StepOutput]]:
        engine = self.engine
        while engine.has_unfinished_requests():
            # NOTE: set around each step, never across a yield: the caller's context between
            # steps stays its own
            with use_npu_profile(self.npu_profile), exact_steps(self.engine_config.exact):
                outputs = engine.step()
            yield outputs

    def _add_all(self, prompts, sampling_params) -> list[str]:
        prompts = _as_prompt_list(prompts)
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise BadInputError(
                    f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one, or "
                    "one per prompt"
                )
        batch = next(self._batch_ids)
        ids = [f"{batch}-{i}" for i in range(len(prompts))]
        # Validate everything first, so a bad prompt never leaves half a batch queued.
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            if not isinstance(p, SamplingParams):
                raise BadInputError(
                    f"request {rid}: expected SamplingParams, got {type(p).__name__}"
                )
            self.engine.validate_prompt(prompt, f"{rid} (prompt #{rid.split('-')[1]})")
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            self.engine.add_request(prompt, p, request_id=rid)
        return ids

    # ---- tensor parallelism -------------------------------------------------------------
    def close(self, *, graceful: bool = True) -> None:
        """Stop the tensor-parallel ranks (nothing to do in one process); idempotent.
        ``graceful=False`` (after an error or Ctrl-C) terminates them without a goodbye."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close(graceful=graceful)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close(graceful=exc_type is None)

    # ---- hooks --------------------------------------------------------------------------
    @contextmanager
    def step_hook(self, hook: StepHook) -> Iterator[StepHook]:
        """Call ``hook(StepRecord)`` after every step inside the block."""
        if self.engine.speculator is not None:
            raise BadInputError(
                "step hooks record one logit row per request per step; a speculative verify "
                "step scores several"
            )
        self.engine.step_hooks.append(hook)
        try:
            yield hook
        finally:
            self.engine.step_hooks.remove(hook)


_heap_frozen = False


def _freeze_startup_heap() -> None:
    """Move everything alive now out of the garbage collector's sight, once per process.

    Before the model is built, so the model, its cache and the engine stay collectable.
    """
    global _heap_frozen
    if _heap_frozen:
        return
    _heap_frozen = True
    gc.collect()
    gc.freeze()


def _text_config(config):
    """``config.get_text_config()`` (the ``text_config`` of a composite config), else CONFIG."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _acquire_model(model, config: EngineConfig):
    """(model, config, directory or None, the checkpoint's MTP tensors or None): a built
    module as is, or loaded from a directory."""
    if isinstance(model, nn.Module):
        return model, getattr(model, "config", None), None, None
    loaded = load_model(
        model,
        dtype=resolve_dtype(config.dtype),
        device=config.device,
        seed=config.seed,
        random_weights=config.random_weights,
        trust_remote_code=config.trust_remote_code,
    )
    return loaded.model, loaded.config, loaded.model_dir, loaded.mtp_state


def _dtype_of(model: nn.Module) -> torch.dtype:
    param = next(model.parameters(), None)
    return param.dtype if param is not None else torch.float32


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, Tensor):
        return [prompts] if prompts.dim() == 1 else list(prompts)
    if isinstance(prompts, (str, bytes)):
        raise BadInputError("prompts are token id lists (this runtime has no tokenizer)")
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int) and not isinstance(prompts[0], bool):
        return [prompts]  # a single prompt given as one list of ids
    return prompts

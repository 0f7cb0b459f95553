"""The three transformers baselines: padded `generate`, one-at-a-time `generate`, and its own
continuous batching (`generate_batch`) with its paged cache."""

from __future__ import annotations

import logging
import time

import torch
from _common import BLOCK_SIZE, TOKEN_BUDGET, Clock, KVStats, RunResult, Workload


class NotRunnableError(RuntimeError):
    """The system cannot run this model at all (a limitation of it, not a failed measurement)."""


class _FirstCallTimer:
    """A logits processor that records when generate first produces logits (the first token)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.first_s: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.first_s is None:
            self.first_s = self.clock.now()
        return scores


def _generation_config(max_new_tokens: int):
    from transformers import GenerationConfig

    # eos_token_id=None: EOS is ignored, every request produces exactly its budget.
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        use_cache=True,
    )


def _dense_cache_bytes(cache) -> tuple[int, int]:
    """(bytes, cached sequence length) of a transformers DynamicCache, read from its tensors."""
    total, seq_len = 0, 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            total += t.numel() * t.element_size()
            seq_len = t.shape[-2]
    return total, seq_len


def _generate(model, input_ids, attention_mask, max_new_tokens: int, clock: Clock):
    from transformers import LogitsProcessorList

    timer = _FirstCallTimer(clock)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=_generation_config(max_new_tokens),
        logits_processor=LogitsProcessorList([timer]),
        return_dict_in_generate=True,
    )
    return out, timer.first_s


@torch.inference_mode()
def run_hf_padded(model, workload: Workload, *, bytes_per_token: int, batch_size: int = 0):
    """Static batches, left padded, run to the longest budget in the batch; only each request's
    own budget counts as useful output."""
    n = workload.num_requests
    batch_size = batch_size or n
    tokens: list[list[int]] = [[] for _ in range(n)]
    ttft = [0.0] * n
    best = KVStats(held_bytes=0, live_bytes=0)
    clock = Clock()
    for start in range(0, n, batch_size):
        idx = list(range(start, min(n, start + batch_size)))
        width = max(len(workload.prompts[i]) for i in idx)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = workload.prompts[i]
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        steps = max(workload.max_tokens[i] for i in idx)
        out, first_s = _generate(model, ids, mask, steps, clock)
        for row, i in enumerate(idx):
            tokens[i] = out.sequences[row, width : width + workload.max_tokens[i]].tolist()
            ttft[i] = first_s
        # The dense cache is largest at the last step. Only requests whose budget reaches that
        # step still need their KV there; the rest is padding or finished requests.
        held, cached_len = _dense_cache_bytes(out.past_key_values)
        assert cached_len == width + steps - 1, "dense cache length is prompt width + steps - 1"
        live_tokens = sum(
            len(workload.prompts[i]) + steps - 1 for i in idx if workload.max_tokens[i] == steps
        )
        if held > best.held_bytes:
            best = KVStats(held_bytes=held, live_bytes=live_tokens * bytes_per_token)
    return RunResult(tokens=tokens, wall_s=clock.now(), ttft_s=ttft, kv=best)


@torch.inference_mode()
def run_hf_sequential(model, workload: Workload, *, bytes_per_token: int):
    """One request at a time, no padding; later requests wait for earlier ones (TTFT shows it)."""
    tokens, ttft = [], []
    best = KVStats(held_bytes=0, live_bytes=0)
    clock = Clock()
    for prompt, max_new in zip(workload.prompts, workload.max_tokens, strict=True):
        ids = torch.tensor([prompt], dtype=torch.long)
        out, first_s = _generate(model, ids, torch.ones_like(ids), max_new, clock)
        tokens.append(out.sequences[0, len(prompt) :].tolist())
        ttft.append(first_s)
        held, cached_len = _dense_cache_bytes(out.past_key_values)
        if held > best.held_bytes:
            best = KVStats(held_bytes=held, live_bytes=cached_len * bytes_per_token)
    return RunResult(tokens=tokens, wall_s=clock.now(), ttft_s=ttft, kv=best)


class _CBSampler:
    """Samples transformers' paged cache after every scheduling decision: bytes of blocks in use
    and tokens of running requests, keeping the sample where blocks in use peaked."""

    def __init__(self, bytes_per_token: int) -> None:
        self.bytes_per_token = bytes_per_token
        self.peak = KVStats(held_bytes=0, live_bytes=0)
        self.num_steps = 0
        self.num_offloads = 0

    def sample(self, scheduler, num_q_tokens: int) -> None:
        from transformers.generation.continuous_batching.requests import RequestStatus

        cache = scheduler.cache
        total = cache.num_sectors * cache.bytes_per_sector
        held = total - int(cache.compute_free_capacity(relative=False))
        live = num_q_tokens + sum(
            s.position_offset
            for s in scheduler.active_requests.values()
            if s.status in (RequestStatus.PREFILLING, RequestStatus.DECODING)
        )
        self.num_steps += 1
        self.peak.pool_bytes = total
        if held > self.peak.held_bytes:
            self.peak = KVStats(
                held_bytes=held, live_bytes=live * self.bytes_per_token, pool_bytes=total
            )


def _install_cb_sampler(sampler: _CBSampler):
    """Wrap the FIFO scheduler's batch selection (this benchmark process only) to sample KV."""
    from transformers.generation.continuous_batching.scheduler import FIFOScheduler

    original = FIFOScheduler.schedule_batch

    def schedule_batch(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if result[0]:
            sampler.sample(self, int(result[2]))
        return result

    FIFOScheduler.schedule_batch = schedule_batch
    return lambda: setattr(FIFOScheduler, "schedule_batch", original)


class HFContinuousBatching:
    """transformers' continuous batching (`init_continuous_batching` + its manager) with its paged
    cache. The manager is built once and reused across runs (like the kvskill engine's pool),
    and gets an explicit block count and token budget: on CPU its defaults size a mask buffer of
    several GiB. Requests go in through `add_request` so each keeps its own output budget."""

    def __init__(self, model, *, bytes_per_token: int, kv_capacity_tokens: int, max_requests: int):
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
        self.bytes_per_token = bytes_per_token
        config = model.config
        #: The latent (DeepSeek MLA) layout: what the paged cache would have to hold per token.
        self.mla_cache_dims = (
            (config.kv_lora_rank, config.qk_rope_head_dim)
            if isinstance(getattr(config, "kv_lora_rank", None), int)
            else None
        )
        cb_config = ContinuousBatchingConfig(
            page_size=BLOCK_SIZE,
            num_blocks=kv_capacity_tokens // BLOCK_SIZE,
            max_batch_tokens=TOKEN_BUDGET,
            max_requests_per_batch=max_requests,
            # Prefix sharing off: random prompts share nothing, and cached prefixes would count
            # as held blocks.
            allow_block_sharing=False,
            use_cuda_graph=False,
            use_async_batching=False,
            scheduler_type="fifo",
        )
        self.manager = model.init_continuous_batching(
            generation_config=_generation_config(1), continuous_batching_config=cb_config
        )
        self.manager.start()
        self.num_runs = 0

    def close(self) -> None:
        self.manager.stop(block=True, timeout=10)
        self.manager.destroy()

    def run(self, workload: Workload) -> RunResult:
        sampler = _CBSampler(self.bytes_per_token)
        restore = _install_cb_sampler(sampler)
        self.num_runs += 1
        try:
            t0 = time.perf_counter()
            ids = [
                self.manager.add_request(
                    prompt,
                    request_id=f"run{self.num_runs}-{i}",
                    max_new_tokens=budget,
                    record_timestamps=True,
                )
                for i, (prompt, budget) in enumerate(
                    zip(workload.prompts, workload.max_tokens, strict=True)
                )
            ]
            results = {}
            while len(results) < len(ids):
                r = self.manager.get_result(timeout=1)
                if r is not None and r.is_finished():
                    results[r.request_id] = r
                elif r is None and not self.manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped early")
            wall = time.perf_counter() - t0
        finally:
            restore()
        errors = sorted({str(r.error) for r in results.values() if r.error})
        if errors and self.mla_cache_dims and any("slice shape" in e for e in errors):
            # Its pages hold num_key_value_heads x head_dim per token and layer, for K and for V;
            # the MLA attention writes its compressed latent and rope key instead (one "head"
            # each, of other widths), which the page copy refuses.
            latent, rope = self.mla_cache_dims
            raise NotRunnableError(
                "transformers' continuous batching pages K/V as num_key_value_heads x head_dim "
                f"per token; this MLA model caches a 1 x {latent} latent and a 1 x {rope} rope "
                f"key, which its paged cache cannot store ({errors[0]})"
            )
        if errors:
            raise RuntimeError(f"transformers' continuous batching failed requests: {errors}")
        tokens, ttft = [], []
        for rid in ids:
            r = results[rid]
            tokens.append(list(r.generated_tokens))
            ttft.append(r.timestamps[0] - t0 if r.timestamps else float("nan"))
        return RunResult(
            tokens=tokens,
            wall_s=wall,
            ttft_s=ttft,
            kv=sampler.peak,
            extra={"scheduler_steps": sampler.num_steps},
        )

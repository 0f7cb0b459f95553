"""The kvskill runtime as a benchmark system: the model converted by the implementer, loaded
with the reference model's state dict, served by `LLM` (continuous batching, paged KV)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from _common import BLOCK_SIZE, TOKEN_BUDGET, KVStats, ModelSpec, RunResult, Workload


def convert(spec: ModelSpec, out_dir: Path) -> Path:
    """`kvskill apply <model type> --mode framework` with the spec's config, through the
    library."""
    from kvskill.implementer.writer import ApplyOptions, apply_model

    options = ApplyOptions(
        deploy_mode="framework",
        block_size=BLOCK_SIZE,
        config_overrides=dict(spec.overrides),
        force=True,
    )
    apply_model(spec.model_type, out_dir, options)
    return out_dir


class _StepProbe:
    """Per-step timings and KV occupancy, read around the engine's own step.

    The engine's scheduler is wrapped on this instance only: right after it decides a step,
    blocks held by requests and tokens those requests will have in cache are read together.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps: list[tuple[bool, int, float, float]] = []  # prefill?, batch, step s, fwd s
        self.peak = KVStats(held_bytes=0, live_bytes=0)
        self._batch = (False, 0)
        manager = engine.kv_manager
        self._bytes_per_block = {k: manager.groups[k].bytes_per_block() for k in manager.groups}
        # What one cached token costs in this engine's own cache layout (K/V per head, or the
        # MLA latent + rope key), read from the pools rather than assumed.
        self.bytes_per_token = sum(
            b // manager.block_size_of(k) for k, b in self._bytes_per_block.items()
        )
        self.pool_bytes = sum(
            (manager.pools[k].num_blocks - 1) * b for k, b in self._bytes_per_block.items()
        )
        self._schedule = engine.scheduler.schedule
        self._step = engine.step
        engine.scheduler.schedule = self._probed_schedule
        engine.step = self._probed_step

    def close(self) -> None:
        self.engine.scheduler.schedule = self._schedule
        self.engine.step = self._step

    def reset(self) -> None:
        self.steps.clear()
        self.peak = KVStats(held_bytes=0, live_bytes=0, pool_bytes=self.pool_bytes)

    def _probed_schedule(self):
        output = self._schedule()
        manager = self.engine.kv_manager
        free, initial = manager.num_free_blocks, manager.initial_free_blocks
        held = sum((initial[k] - free[k]) * b for k, b in self._bytes_per_block.items())
        after = {id(s.request): s.start + s.num_new_tokens for s in output.scheduled}
        live_tokens = sum(
            after.get(id(r), r.num_computed_tokens) for r in self.engine.scheduler.running
        )
        if held > self.peak.held_bytes:
            self.peak = KVStats(
                held_bytes=held,
                live_bytes=live_tokens * self.bytes_per_token,
                pool_bytes=self.pool_bytes,
            )
        self._batch = (output.is_prefill, len(output.scheduled))
        return output

    def _probed_step(self):
        stats = self.engine.stats
        forward_before = stats.forward_s
        started = time.perf_counter()
        out = self._step()
        elapsed = time.perf_counter() - started
        if self._batch[1]:
            self.steps.append((*self._batch, elapsed, stats.forward_s - forward_before))
        self._batch = (False, 0)
        return out

    def host_overhead(self, *, prefill: bool | None = None, min_batch: int = 0) -> float | None:
        """1 - forward time / step time over the selected steps (None if there are none)."""
        chosen = [
            s for s in self.steps if (prefill is None or s[0] == prefill) and s[1] >= min_batch
        ]
        step_s = sum(s[2] for s in chosen)
        return None if not chosen or step_s <= 0 else 1 - sum(s[3] for s in chosen) / step_s


#: Converted model directories of this process, by spec name. A cell runs several workloads
#: of one model, each with its own pool size (so its own engine), but the converted code is
#: the same: converting once saves seconds of libcst work per workload.
_CONVERTED: dict[str, Path] = {}
_CONVERT_ROOT: tempfile.TemporaryDirectory | None = None


def converted_dir(spec: ModelSpec) -> Path:
    """The spec's model converted in a temporary directory kept until the process exits."""
    global _CONVERT_ROOT
    if spec.name not in _CONVERTED:
        if _CONVERT_ROOT is None:
            _CONVERT_ROOT = tempfile.TemporaryDirectory(prefix="kvskill-bench-")
        _CONVERTED[spec.name] = convert(spec, Path(_CONVERT_ROOT.name) / spec.name)
    return _CONVERTED[spec.name]


class KvskillRuntime:
    def __init__(
        self,
        spec: ModelSpec,
        reference,
        *,
        kv_capacity_tokens: int,
        enable_prefix_caching: bool = True,
        exact: bool = False,
        prepack_linear: bool | None = None,
        fuse_layers: bool | None = None,
        screen_output_head: bool | None = None,
        graph: bool = False,
    ):
        from kvskill.runtime import LLM, EngineConfig
        from kvskill.runtime.loader import load_model

        model_dir = converted_dir(spec)
        loaded = load_model(model_dir, dtype="float32", random_weights=True)
        # The transformers reference's own tensors (assign=True shares their storage): every
        # key must match, and every system reads its weights from the same memory.
        loaded.model.load_state_dict(reference.state_dict(), strict=True, assign=True)
        loaded.model.eval()
        config = EngineConfig(
            block_size=BLOCK_SIZE,
            # +1: block 0 is the reserved null block; usable capacity equals the other
            # paged system's.
            num_blocks=kv_capacity_tokens // BLOCK_SIZE + 1,
            max_num_batched_tokens=TOKEN_BUDGET,
            max_num_seqs=256,
            enable_prefix_caching=enable_prefix_caching,
            exact=exact,
            prepack_linear=prepack_linear,
            fuse_layers=fuse_layers,
            screen_output_head=screen_output_head,
            graph=graph,
        )
        self.llm = LLM(loaded.model, config)
        self.vocab_size = spec.vocab_size
        self.probe = _StepProbe(self.llm.engine)

    @torch.inference_mode()
    def capture_buckets(self, max_batch: int) -> dict:
        """Capture the decode graph of every bucket a batch of up to MAX_BATCH requests
        reaches: MAX_BATCH short requests whose token counts are 2, 3, ..., so once they are
        all decoding the batch shrinks by one request per step through every size. Returns
        the capture's stats (buckets compiled, compile seconds)."""
        from kvskill.runtime import SamplingParams

        prompts = [[(7 * i + j) % self.vocab_size for j in range(4)] for i in range(max_batch)]
        params = [SamplingParams(max_tokens=2 + i, ignore_eos=True) for i in range(max_batch)]
        self.llm.generate(prompts, params)
        self.llm.kv_manager.reset_prefix_cache()
        captured = self.llm.engine.captured_decode
        return {} if captured is None else captured.stats.to_dict()

    def close(self) -> None:
        self.probe.close()

    @torch.inference_mode()
    def run(self, workload: Workload) -> RunResult:
        from kvskill.runtime import SamplingParams

        params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in workload.max_tokens]
        stats = self.llm.engine.stats
        # Repeats of a workload must not find the previous run's prompts in the prefix
        # cache (the other systems recompute them); sharing inside one run stays.
        self.llm.kv_manager.reset_prefix_cache()
        before = stats.to_dict()
        self.probe.reset()
        started = time.perf_counter()
        outputs = self.llm.generate(workload.prompts, params)
        wall = time.perf_counter() - started
        after = stats.to_dict()
        delta = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
        probe = self.probe
        forward_s = sum(s[3] for s in probe.steps)
        batch = workload.num_requests
        extra = {
            "host_overhead": None if wall <= 0 else round(1 - forward_s / wall, 4),
            "host_overhead_decode": probe.host_overhead(prefill=False),
            # Decode steps with every request of the workload in the batch (32 for W1).
            "host_overhead_full_batch": probe.host_overhead(prefill=False, min_batch=batch),
            "full_batch": batch,
            "num_steps": delta["num_steps"],
            "num_prefill_steps": delta["num_prefill_steps"],
            "num_decode_steps": delta["num_decode_steps"],
            "num_preemptions": delta["num_preemptions"],
            "recomputed_prompt_tokens": delta["num_prompt_tokens"]
            - sum(len(p) for p in workload.prompts),
        }
        return RunResult(
            tokens=[list(o.token_ids) for o in outputs],
            wall_s=wall,
            ttft_s=[o.ttft_s for o in outputs],
            kv=probe.peak,
            extra=extra,
        )

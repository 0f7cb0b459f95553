"""Start N tensor-parallel ranks and drive them from rank 0 (this process).

Rank 0 is the caller: it loads its shard, schedules, and before every model forward
broadcasts the step's inputs (token ids, positions, the forward metadata without the 2048^2
mask, which every rank builds itself) to ranks 1..N-1, spawned with torch.multiprocessing.
Every rank holds its own KV pool, sized for its heads, with the same number of blocks, so the
block tables rank 0 computes address every rank's pool.

Failures never hang: ranks report start-up progress and errors through a queue that rank 0
polls while it checks that every process is alive; collectives time out after
``KVSKILL_TP_TIMEOUT_S`` seconds (default 120); a rank whose parent disappears exits; on
shutdown (normal, error or Ctrl-C) rank 0 sends "stop", then terminates and finally kills any
rank still alive.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
import os
import queue as queue_module
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from kvskill.core.errors import (
    BadInputError,
    CheckFailedError,
    KvskillError,
    UnsupportedModelError,
)
from kvskill.runtime.distributed.group import TPGroup, free_port, resolve_backend
from kvskill.runtime.distributed.group import timeout_s as default_timeout_s
from kvskill.runtime.distributed.shard import ShardPlan, apply_shards, plan_shards
from kvskill.runtime.forward_context import forward_context, get_forward_metadata
from torch import nn

logger = logging.getLogger(__name__)

_ERRORS = {
    int(BadInputError.exit_code): BadInputError,
    int(UnsupportedModelError.exit_code): UnsupportedModelError,
    int(CheckFailedError.exit_code): CheckFailedError,
}


class RankFailedError(RuntimeError):
    """A rank other than 0 failed or disappeared."""


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """How every rank loads the model (picklable: it travels to the spawned ranks)."""

    model_dir: str
    dtype: str
    device: str | None
    seed: int
    random_weights: bool
    trust_remote_code: bool


@dataclass(slots=True)
class ShardedModel:
    model: nn.Module
    config: object
    model_dir: Path
    plan: ShardPlan
    #: bytes of the checkpoint this rank read (0 for random weights)
    bytes_read: int
    #: "slices" (safetensors slices) or "whole" (a renaming loader read it all) or "random"
    weights: str


def rank_device(device: str | None, backend: str, rank: int) -> str | None:
    """Each NPU / CUDA rank on its own device index; CPU ranks share the host."""
    if backend in ("hccl", "nccl"):
        kind = "npu" if backend == "hccl" else "cuda"
        return f"{kind}:{rank}"
    return device


def load_shard(spec: LoadSpec, group: TPGroup, device: str | None) -> ShardedModel:
    """Build the model, cut it to this rank's shard and read this rank's slices."""
    from kvskill.runtime.distributed.weights import NamesDiffer, load_sharded_checkpoint
    from kvskill.runtime.loader import load_model

    kwargs = dict(
        dtype=spec.dtype,
        device=device,
        seed=spec.seed,
        random_weights=spec.random_weights,
        trust_remote_code=spec.trust_remote_code,
    )
    loaded = load_model(spec.model_dir, read_weights=False, **kwargs)
    files = sorted(Path(loaded.model_dir).glob("*.safetensors"))
    plan = plan_shards(loaded.model, group.rank, group.world_size)
    apply_shards(loaded.model, plan, group.all_reduce)
    if not files:
        return ShardedModel(loaded.model, loaded.config, loaded.model_dir, plan, 0, "random")
    try:
        read = load_sharded_checkpoint(loaded.model, files, plan)
        return ShardedModel(loaded.model, loaded.config, loaded.model_dir, plan, read, "slices")
    except NamesDiffer as why:
        # transformers renames or fuses this checkpoint's tensors on load: read it whole
        logger.info("tensor parallel: checkpoint read whole (%s)", why)
    del loaded
    whole = load_model(spec.model_dir, **kwargs)
    plan = plan_shards(whole.model, group.rank, group.world_size)
    apply_shards(whole.model, plan, group.all_reduce)
    size = sum(f.stat().st_size for f in files)
    return ShardedModel(whole.model, whole.config, whole.model_dir, plan, size, "whole")


class DriverModel(nn.Module):
    """Rank 0's model: broadcasts each forward's inputs to the other ranks, then runs its
    own shard. Its forward has the wrapped model's signature (the engine reads it)."""

    def __init__(self, inner: nn.Module, group: TPGroup, check: callable) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self._group = group
        self._check = check

        # the engine reads forward's signature (logits_to_keep): give it the inner one
        def forward(*args, **kwargs):
            return self._forward(*args, **kwargs)

        self.forward = functools.update_wrapper(forward, inner.forward)

    def _forward(self, *args, **kwargs):
        md = get_forward_metadata()
        light = dataclasses.replace(md, attention_mask=None)
        # A rank already gone is found here, at the cost of a waitpid per rank: gloo's send to
        # a dead peer sometimes fails at once and sometimes waits out the group's timeout.
        self._check()
        try:
            self._group.broadcast_object(
                ("step", args, kwargs, light, md.attention_mask is not None)
            )
            return self.inner(*args, **kwargs)
        except RuntimeError:
            # a rank that died or failed is the cause: raise its report instead; otherwise
            # the error is rank 0's own (the converted code, an operator) and stands
            self._check()
            raise

    def get_cache_info(self):
        return self.inner.get_cache_info()

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    @property
    def block_size(self):
        return self.inner.block_size

    @block_size.setter
    def block_size(self, value) -> None:
        self.inner.block_size = value


class TensorParallel:
    """Rank 0's handle on the group: the sharded model, the ranks, and their shutdown."""

    def __init__(
        self,
        spec: LoadSpec,
        world_size: int,
        *,
        backend: str = "auto",
        timeout_s: float | None = None,
    ) -> None:
        from kvskill.runtime.device import select_device

        timeout_s = timeout_s if timeout_s is not None else default_timeout_s()
        if world_size < 2:
            raise BadInputError(f"tensor parallel size must be >= 2 here, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.backend = resolve_backend(backend, select_device(spec.device))
        self.procs: list = []
        self.group: TPGroup | None = None
        self._closed = False
        self._threads = torch.get_num_threads()
        _check_split_early(spec, world_size)
        context = torch.multiprocessing.get_context("spawn")
        self.queue = context.Queue()
        port = free_port()
        atexit.register(self.close)
        try:
            for rank in range(1, world_size):
                proc = context.Process(
                    target=_worker_main,
                    args=(rank, world_size, self.backend, port, spec, self.queue, timeout_s),
                    daemon=True,
                    name=f"kvskill-tp-rank{rank}",
                )
                proc.start()
                self.procs.append(proc)
            self._await("up")
            _share_cores(world_size)
            self.group = TPGroup.init(
                rank=0, world_size=world_size, backend=self.backend, port=port, timeout_s=timeout_s
            )
            device = rank_device(spec.device, self.backend, 0)
            self.shard = load_shard(spec, self.group, device)
            self._await("loaded")
            self.model = DriverModel(self.shard.model, self.group, self.check_ranks)
        except BaseException:
            self.close(graceful=False)
            raise

    # ---- start-up -----------------------------------------------------------------------
    def share_kv_setup(self, kv_kwargs: dict, setup) -> None:
        """Every other rank builds its pool from rank 0's arguments; the block counts must
        agree, as rank 0's block tables address every pool."""
        blocks = dict(setup.manager.initial_free_blocks)
        try:
            self.group.broadcast_object(("kv", kv_kwargs, blocks))
        except RuntimeError as exc:
            self.check_ranks()
            raise RankFailedError(f"tensor-parallel set-up failed: {exc}") from exc
        self._await("ready")

    def _await(self, stage: str) -> None:
        """Wait for every rank's STAGE message, failing fast on an error or a dead rank."""
        pending = set(range(1, self.world_size))
        deadline = time.monotonic() + self.timeout_s
        while pending:
            try:
                message = self.queue.get(timeout=0.2)
            except queue_module.Empty:
                message = None
            if message is not None:
                self._raise_if_error(message)
                if message[0] == stage:
                    pending.discard(message[1])
                continue
            self.check_ranks()
            if time.monotonic() > deadline:
                raise RankFailedError(
                    f"tensor-parallel ranks {sorted(pending)} did not reach '{stage}' within "
                    f"{self.timeout_s:g} s"
                )

    def _raise_if_error(self, message) -> None:
        if message[0] != "error":
            return
        _, rank, exit_code, text = message
        error = _ERRORS.get(exit_code)
        text = f"tensor-parallel rank {rank} failed: {text}"
        if error is not None:
            raise error(text)
        raise RankFailedError(text)

    def check_ranks(self) -> None:
        """Raise (with the rank's own message when it sent one) if a rank has died."""
        while True:
            try:
                self._raise_if_error(self.queue.get_nowait())
            except queue_module.Empty:
                break
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                raise RankFailedError(
                    f"tensor-parallel rank {rank} exited unexpectedly (exit code {proc.exitcode})"
                )

    # ---- reporting ----------------------------------------------------------------------
    def report(self, num_steps: int) -> dict:
        stats = self.group.stats if self.group else None
        comm = stats.to_dict() if stats else {}
        total = stats.total_s if stats else 0.0
        return {
            "size": self.world_size,
            "backend": self.backend,
            "weights": self.shard.weights,
            "checkpoint_bytes_read_rank0": self.shard.bytes_read,
            **self.shard.plan.summary(),
            "comm_rank0": comm,
            "comm_s_per_step": total / num_steps if num_steps else None,
        }

    # ---- shutdown -----------------------------------------------------------------------
    def close(self, *, graceful: bool = True) -> None:
        """Stop every rank: 'stop' when the group still works (GRACEFUL: not after an error
        or Ctrl-C, which may have left the ranks inside a collective), then terminate, then
        kill."""
        if self._closed:
            return
        self._closed = True
        if self.group is not None and graceful and all(p.is_alive() for p in self.procs):
            try:
                _with_timeout(lambda: self.group.broadcast_object(("stop",)), 10.0)
            except Exception as exc:  # noqa: BLE001 - shutting down anyway
                logger.debug("tensor parallel: stop not delivered: %s", exc)
        for proc in self.procs:
            proc.join(timeout=10.0 if graceful else 0.1)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        if self.group is not None:  # after the ranks are gone: nothing left to wait for
            try:
                _with_timeout(self.group.close, 5.0)
            except Exception as exc:  # noqa: BLE001 - shutting down anyway
                logger.debug("tensor parallel: destroy_process_group: %s", exc)
        torch.set_num_threads(self._threads)
        atexit.unregister(self.close)


def _with_timeout(call, seconds: float) -> None:
    """Run CALL in a daemon thread, waiting at most SECONDS (a stop must not hang exit)."""
    errors: list[BaseException] = []

    def target():
        try:
            call()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {seconds:g} s")
    if errors:
        raise errors[0]


def _share_cores(world_size: int) -> None:
    """CPU ranks share the host: each takes its share of the cores, never fewer than one."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


def _check_split_early(spec: LoadSpec, world_size: int) -> None:
    """Refuse a head count that does not divide before any process starts (exit 2)."""
    import json

    from kvskill.runtime.distributed.shard import check_tp_size

    path = Path(spec.model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # the loader reports it with its own message
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    heads = text.get("num_attention_heads")
    if not isinstance(heads, int):
        return
    kv = text.get("num_key_value_heads") or heads
    check_tp_size(heads, int(kv), world_size, mla=text.get("kv_lora_rank") is not None)


# ---- ranks 1..N-1 -----------------------------------------------------------------------
def _worker_main(rank, world_size, backend, port, spec, queue, timeout_s) -> None:
    """A spawned rank: join, load its shard, build its pool, run forwards until 'stop'."""
    # Ctrl-C goes to rank 0, which stops the group; a rank never dies of it half-way
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    group = None
    try:
        queue.put(("up", rank))
        _share_cores(world_size)
        group = TPGroup.init(
            rank=rank, world_size=world_size, backend=backend, port=port, timeout_s=timeout_s
        )
        device = rank_device(spec.device, backend, rank)
        shard = load_shard(spec, group, device)
        queue.put(("loaded", rank))
        serve(shard.model, group, queue, device)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then this rank exits
        code = int(exc.exit_code) if isinstance(exc, KvskillError) else 70
        text = " ".join(str(exc).split()) or type(exc).__name__
        if not isinstance(exc, KvskillError):
            text = f"{type(exc).__name__}: {text}"
            logger.debug("rank %d:\n%s", rank, traceback.format_exc())
        queue.put(("error", rank, code, text))
        queue.close()
        queue.join_thread()
        os._exit(1)
    finally:
        if group is not None:
            with contextlib.suppress(Exception):
                group.close()


def serve(model: nn.Module, group: TPGroup, queue, device) -> None:
    """Follow rank 0: build the KV pool it describes, then run each broadcast step."""
    from kvskill.runtime.device import select_device
    from kvskill.runtime.kv_cache_setup import prepare_kv_cache
    from kvskill.runtime.masks import get_init_attn_mask

    message = group.broadcast_object()
    if message[0] == "stop":
        return
    _, kv_kwargs, blocks = message
    torch_device = select_device(device)
    setup = prepare_kv_cache(model, device=torch_device, **kv_kwargs)
    mine = dict(setup.manager.initial_free_blocks)
    if mine != blocks:
        raise RuntimeError(f"KV pool of {mine} blocks differs from rank 0's {blocks}")
    queue.put(("ready", group.rank))
    mask = get_init_attn_mask(2048, device=torch_device)
    while True:
        message = group.broadcast_object()
        if message[0] == "stop":
            return
        _, args, kwargs, md, has_mask = message
        if has_mask:
            md = dataclasses.replace(md, attention_mask=mask)
        with torch.inference_mode(), forward_context(md):
            model(*args, **kwargs)


def _exit_with_parent() -> None:
    """Exit when the parent is gone (killed without a chance to stop us): no orphans."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="kvskill-tp-parent-watch").start()

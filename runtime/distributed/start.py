"""The entry ``LLM(..., tensor_parallel_size=N)`` calls: checks, then the ranks."""

from __future__ import annotations

from pathlib import Path

import torch
from kvskill.core.errors import BadInputError
from kvskill.runtime.distributed.launch import LoadSpec, TensorParallel
from torch import nn


def start_tensor_parallel(
    model,
    world_size: int,
    *,
    backend: str,
    dtype,
    device,
    seed: int,
    random_weights: bool,
    trust_remote_code: bool,
    timeout_s: float | None = None,
) -> TensorParallel:
    """Spawn ranks 1..N-1 and load rank 0's shard of the converted model in MODEL.

    Raises:
        BadInputError: N < 1, a model given as a module (every rank must load it from the
            directory), heads that do not divide by N, an unavailable backend.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise BadInputError(f"tensor_parallel_size must be an integer >= 1, got {world_size!r}")
    if isinstance(model, nn.Module):
        raise BadInputError(
            "tensor_parallel_size > 1 needs the converted model's directory (every rank loads "
            "its own shard), not a built module"
        )
    dtype_name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
    spec = LoadSpec(
        model_dir=str(Path(model)),
        dtype=dtype_name,
        device=None if device is None else str(device),
        seed=seed,
        random_weights=random_weights,
        trust_remote_code=trust_remote_code,
    )
    return TensorParallel(spec, world_size, backend=backend, timeout_s=timeout_s)

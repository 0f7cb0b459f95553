"""Read a rank's slice of a ``*.safetensors`` checkpoint (``safe_open(...).get_slice``): a
rank never reads the parts of a sharded tensor other ranks keep."""

from __future__ import annotations

from pathlib import Path

import torch
from kvskill.runtime.distributed.shard import ShardPlan, Slice
from torch import nn


class NamesDiffer(Exception):
    """The checkpoint's tensor names are not the model's (a renaming or fusing loader is
    needed); the caller loads the whole checkpoint the ordinary way and slices after."""


def load_sharded_checkpoint(model: nn.Module, files: list[Path], plan: ShardPlan) -> int:
    """Copy this rank's slice of every parameter (and persistent buffer) from FILES into the
    already sharded MODEL. Returns the bytes read.

    Raises:
        NamesDiffer: a parameter of the model is not in the checkpoint under its own name.
    """
    from kvskill.core.safetensors_check import check_safetensors
    from safetensors import safe_open

    where: dict[str, Path] = {}
    renamed: dict[str, str] = {}
    for path in files:
        check_safetensors(path)
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                where[key] = path
    targets = dict(model.named_parameters())  # tied parameters appear once
    # a tied tensor saved under another of its names (an LM head for the embedding)
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    for name, param in targets.items():
        if name not in where:
            saved = next((a for a in aliases[id(param)] if a in where), None)
            if saved is not None:
                where[name] = where[saved]
                renamed[name] = saved
    targets.update(
        (name, buf) for name, buf in model.named_buffers() if name in where and name not in targets
    )
    missing = [
        name for name in targets if name not in where and name in dict(model.named_parameters())
    ]
    if missing:
        raise NamesDiffer(f"{len(missing)} parameters not in the checkpoint, e.g. {missing[0]}")
    read = 0
    by_file: dict[Path, list[str]] = {}
    for name in targets:
        by_file.setdefault(where[name], []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as handle:
            for name in names:
                value = _read(handle, renamed.get(name, name), plan.slices.get(name))
                target = targets[name]
                if tuple(value.shape) != tuple(target.shape):
                    raise NamesDiffer(
                        f"{name}: checkpoint slice {tuple(value.shape)} but the sharded model "
                        f"holds {tuple(target.shape)}"
                    )
                with torch.no_grad():
                    target.copy_(value)
                read += value.numel() * value.element_size()
    return read


def _read(handle, name: str, spec: Slice | None) -> torch.Tensor:
    """Only the rows / columns the slice keeps are read from the file."""
    if spec is None:
        return handle.get_tensor(name)
    part = handle.get_slice(name)
    if spec.zero:
        shape = part.get_shape()
        return torch.zeros(shape, dtype=handle.get_tensor(name).dtype)
    pieces = []
    rank = len(part.get_shape())
    for start, stop in spec.ranges:
        index = [slice(None)] * rank
        index[spec.dim] = slice(start, stop)
        pieces.append(part[tuple(index)])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=spec.dim)

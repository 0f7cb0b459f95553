"""The tensor-parallel process group: torch.distributed with gloo on CPU, hccl on an NPU.

Every collective is counted and timed, so the runtime can report the communication time per
step. The rendezvous is on the loopback interface only.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass

import torch
from kvskill.core.errors import BadInputError
from torch import Tensor

#: seconds a rank waits on a peer (rendezvous, a collective) before giving up, unless
#: ``KVSKILL_TP_TIMEOUT_S`` says otherwise (read when a group starts)
DEFAULT_TIMEOUT_S = 120.0


def timeout_s() -> float:
    """``KVSKILL_TP_TIMEOUT_S`` when set to a positive number, else DEFAULT_TIMEOUT_S."""
    try:
        value = float(os.environ.get("KVSKILL_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    except ValueError:
        raise BadInputError("KVSKILL_TP_TIMEOUT_S must be a number of seconds") from None
    if not value > 0:
        raise BadInputError("KVSKILL_TP_TIMEOUT_S must be a positive number of seconds")
    return value


LOOPBACK = "127.0.0.1"
BACKENDS = ("auto", "gloo", "hccl", "nccl")


def resolve_backend(requested: str, device: torch.device) -> str:
    """gloo on the CPU, hccl on an NPU (nccl on CUDA); a named backend that this torch
    cannot run is bad input."""
    import torch.distributed as dist

    if not dist.is_available():
        raise BadInputError("this torch build has no torch.distributed; run with --tp 1")
    if requested not in BACKENDS:
        raise BadInputError(f"backend {requested!r} is not one of {', '.join(BACKENDS)}")
    backend = requested
    if requested == "auto":
        backend = {"npu": "hccl", "cuda": "nccl"}.get(device.type, "gloo")
    if backend == "hccl":
        try:
            import torch_npu  # noqa: F401  (registers the hccl backend)
        except Exception as exc:  # noqa: BLE001 - missing or broken CANN
            raise BadInputError(
                f"backend hccl is not available (torch_npu does not import: "
                f"{type(exc).__name__}); use --tp-backend gloo on the CPU"
            ) from None
    available = getattr(dist, "is_backend_available", None)
    ok = available(backend) if available else backend == "gloo" and dist.is_gloo_available()
    if not ok:
        raise BadInputError(
            f"backend {backend} is not available in this torch; use --tp-backend gloo on the CPU"
        )
    if backend == "gloo" and device.type not in ("cpu",):
        raise BadInputError(f"backend gloo runs on the CPU, not on {device}; use --device cpu")
    return backend


def free_port() -> int:
    """A free TCP port on the loopback interface for the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


@dataclass(slots=True)
class CommStats:
    """Collectives of this rank: how many and how long they took (wall seconds)."""

    all_reduces: int = 0
    all_reduce_s: float = 0.0
    broadcasts: int = 0
    broadcast_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.all_reduce_s + self.broadcast_s

    def to_dict(self) -> dict:
        return {
            "all_reduces": self.all_reduces,
            "all_reduce_s": self.all_reduce_s,
            "broadcasts": self.broadcasts,
            "broadcast_s": self.broadcast_s,
        }


class TPGroup:
    """This process's place in the tensor-parallel group and its timed collectives."""

    def __init__(self, rank: int, world_size: int, backend: str) -> None:
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.stats = CommStats()

    @classmethod
    def init(
        cls,
        *,
        rank: int,
        world_size: int,
        backend: str,
        port: int | None,
        timeout_s: float,
    ) -> TPGroup:
        """Join the default process group: over ``127.0.0.1:PORT``, or from torchrun's
        environment (``MASTER_ADDR``/``MASTER_PORT``) when PORT is None."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        init_method = "env://" if port is None else f"tcp://{LOOPBACK}:{port}"
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        return cls(rank, world_size, backend)

    def all_reduce(self, tensor: Tensor) -> Tensor:
        import torch.distributed as dist

        started = time.perf_counter()
        # NOTE: inference tensors cannot be modified in place outside inference mode; the
        # hooks run inside it, so the sum is written into the tensor the layer returned.
        dist.all_reduce(tensor)
        self.stats.all_reduces += 1
        self.stats.all_reduce_s += time.perf_counter() - started
        return tensor

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0 sends OBJ (pickled) to every rank; every rank returns it."""
        import torch.distributed as dist

        started = time.perf_counter()
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        self.stats.broadcasts += 1
        self.stats.broadcast_s += time.perf_counter() - started
        return box[0]

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

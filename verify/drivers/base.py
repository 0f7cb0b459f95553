"""The small protocol ``verify`` runs a converted model through, whoever drives it.

``verify`` builds the reference and the converted model, picks the prompts and compares; a
driver only runs the converted model on those prompts and checks its own three chains. The
registry of drivers by output kind is ``kvskill.verify.drivers``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from kvskill.runtime.chains import ChainResult
from torch import nn


@dataclass(frozen=True, kw_only=True)
class DriverRun:
    """What a driver saw: per prompt (in prompt order) its tokens and per-step logits."""

    #: generated token ids of each prompt
    token_ids: list[list[int]]
    #: each prompt's logits [vocab] for every generated token it recorded, in step order
    #: (a step it missed ends the list: the comparison counts it as a difference)
    logits: list[list[torch.Tensor]]
    #: the init, runtime and release chains, in that order
    chains: list[ChainResult]
    notes: list[str] = field(default_factory=list)
    #: the split and each rank's KV bytes when the driver ran tensor-parallel ranks
    tensor_parallel: dict | None = None


class VerifyDriver(Protocol):
    """Runs the converted model on verify's prompts and checks the three chains."""

    #: the start of the error line when the converted model fails while it drives it
    failure: str

    def run(
        self, model: nn.Module, prompts: list[list[int]], *, max_new_tokens: int, block_size: int
    ) -> DriverRun:
        """Greedy generation of ``max_new_tokens`` per prompt with blocks of ``block_size``.

        Raises whatever the converted code raises; ``verify`` reports it as a failed check.
        """
        ...

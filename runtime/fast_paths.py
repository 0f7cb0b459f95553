"""The fast paths an ``LLM`` switches on: on by default where the machine and the model allow
them, each off with the reason where not, all off in an exact run.

Three, applied in this order (each reads what the one before left):

1. ``prepack_linear``: fp32 linear layers through oneDNN with weights packed once
   (``prepacked_linear``);
2. ``fuse_layers``: RMSNorm, gated MLP and rotary embedding through one-pass kernels, each
   module only when it agrees with its own code on a probe input (``fused_layers``);
3. ``screen_output_head``: greedy steps find their token from a bf16 pass over the output head
   first (``screened_head``), on CPUs with native bf16.

None is bit-exact against the model's own code (each sums in another order), which is why
``exact=True`` and verify turn them all off. A setting of None ("auto") turns a path on only
where it can run, and never fails a run: a machine or a model it does not fit leaves it off
with the reason. True requires it: what would leave it off is a ``BadInputError`` instead.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
from kvskill.core.errors import BadInputError
from kvskill.runtime.engine_config import EngineConfig
from torch import nn

if TYPE_CHECKING:
    from kvskill.runtime.screened_head import ScreenedHead

#: the EngineConfig fields of the fast paths, in the order they are applied
FAST_PATH_NAMES = ("prepack_linear", "fuse_layers", "screen_output_head")


@dataclass(frozen=True, slots=True)
class FastPath:
    """Whether one fast path ran, what it covered, and why not when it did not."""

    #: the EngineConfig field ("prepack_linear", "fuse_layers", "screen_output_head")
    name: str
    on: bool
    #: linear layers packed / modules fused / 1 for the head; 0 when off
    count: int
    #: why it is off (one line), None when on
    reason: str | None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class FastPaths:
    """The fast paths of one LLM, in the order applied; ``screen`` is the head's screen."""

    paths: tuple[FastPath, ...]
    #: the output head's screen (None unless screen_output_head is on)
    screen: ScreenedHead | None = None

    def get(self, name: str) -> FastPath:
        (path,) = [p for p in self.paths if p.name == name]
        return path

    def to_dict(self) -> dict[str, dict]:
        return {p.name: p.to_dict() for p in self.paths}


def switch_on_fast_paths(model: nn.Module, config: EngineConfig) -> FastPaths:
    """Switch MODEL onto the fast paths CONFIG asks for or allows; returns what ran and why.

    Raises:
        BadInputError: a path set to True that cannot run on this machine or model.
    """
    paths: list[FastPath] = []
    screen = None
    for name in FAST_PATH_NAMES:
        reason = _off_by_setting(name, config) or _off_by_machine(name) or _off_by_model(model)
        if reason is not None:
            if getattr(config, name) is True:
                raise BadInputError(f"{name}=True cannot run: {reason}")
            paths.append(FastPath(name=name, on=False, count=0, reason=reason))
            continue
        count, screen_now, reason = _switch(name, model)
        if screen_now is not None:
            screen = screen_now
        if reason is not None and getattr(config, name) is True:
            raise BadInputError(f"{name}=True cannot run: {reason}")
        paths.append(FastPath(name=name, on=reason is None, count=count, reason=reason))
    return FastPaths(paths=tuple(paths), screen=screen)


def _off_by_setting(name: str, config: EngineConfig) -> str | None:
    asked = getattr(config, name)
    if asked is False:
        return f"{name}=False (--no-{name.replace('_', '-')})"
    if asked is None and config.exact:
        return "exact run (--exact): the model's own code, bit for bit"
    if asked is None and config.tensor_parallel_size != 1:
        # NOTE: the ranks would combine results computed two different ways
        return f"tensor parallel ({config.tensor_parallel_size} ranks): one process only"
    return None


def _off_by_machine(name: str) -> str | None:
    """Why this torch and CPU cannot run the path (no oneDNN, no compiler, no native bf16)."""
    if name == "prepack_linear":
        from kvskill.runtime.prepacked_linear import unavailable_reason
    elif name == "fuse_layers":
        from kvskill.runtime.fused_layers import unavailable_reason
    else:
        from kvskill.runtime.screened_head import unavailable_reason
    return unavailable_reason()


def _off_by_model(model: nn.Module) -> str | None:
    """Why the model's weights are out of every path's reach: all three cover float32 on the
    CPU (a bf16 or device model keeps its own code)."""
    param = next(model.parameters(), None)
    if param is None:
        return "the model has no parameters"
    if param.dtype != torch.float32 or param.device.type != "cpu":
        dtype = str(param.dtype).removeprefix("torch.")
        return f"the model runs {dtype} on {param.device.type}; the fast paths cover float32 on cpu"
    return None


def _switch(name: str, model: nn.Module) -> tuple[int, ScreenedHead | None, str | None]:
    """Apply one path: (modules covered, the head's screen, why it covers nothing)."""
    if name == "prepack_linear":
        from kvskill.runtime.prepacked_linear import prepack_linears

        count = prepack_linears(model)
        return count, None, None if count else "no float32 nn.Linear on the CPU to pack"
    if name == "fuse_layers":
        from kvskill.runtime.fused_layers import fuse_layers

        count = fuse_layers(model)
        why = "no RMSNorm, gated MLP or rotary embedding of this model passed the kernels' probe"
        return count, None, None if count else why
    from kvskill.runtime.screened_head import screen_output_head

    try:
        return 1, screen_output_head(model), None
    except RuntimeError as error:  # the head is not a bias-free fp32 nn.Linear, or none
        return 0, None, str(error).removeprefix("cannot screen the output head: ")

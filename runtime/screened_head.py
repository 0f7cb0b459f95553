"""Opt-in: greedy steps read the output head in bf16 first, then only its top logits in fp32.

Why: at decode batches the output head is the largest GEMM of a step (Qwen3-0.6B: a
151936 x 1024 weight, 622 MB in fp32, about a third of a 32-request decode step on the CPU
measured). A greedy step needs only the argmax of each row, and that can be found exactly
from a cheaper pass: oneDNN's bf16 GEMM (native on CPUs with AVX512-BF16) reads half the
bytes at twice the arithmetic rate, and every logit it gives is within a known bound of the
fp32 logit. A token whose bf16 logit is far enough below the row's largest cannot be the fp32
argmax, so only the few tokens near the top (the candidates) get their fp32 logit computed.

The bound, per row ``x`` (fp32 hidden state, ``n`` features) and vocabulary row ``w``:
rounding ``x`` and ``w`` to bf16 (8 significant bits, round to nearest: ``u = 2**-8``)
moves each product by at most ``(2u + u**2)|x_i w_i|``; summing ``n`` products in fp32 in
any order adds at most ``gamma_n * sum|x_i w_i|`` (``gamma_n = n 2**-24 / (1 - n 2**-24)``),
and the fp32 dot product the candidates are compared by carries the same again; rounding
the GEMM's fp32 sum to its bf16 output ``a`` moves it by at most ``2u |a|``, even if it
truncated. With ``sum|x_i w_i| <= |x| |w|`` (Cauchy-Schwarz):

    |a - fp32 logit| <= c |x| max|w| + 2u |a| + 1e-30,
    c = (2u + u**2 + 3 gamma_n) (1 + 2**-10)

The last factor of ``c`` covers the rounding of the norms themselves, the absolute term
bf16's flushing of values below 2**-126; ``ScreenedHead.threshold`` turns the bound into each
row's cut-off. oneDNN documents fp32 accumulation for bf16 GEMMs; that is the one property of
the library the bound rests on, and ``tests/runtime/test_screened_head.py`` checks it on
inputs built to round the same way in every product, for 256 to 4096 features (where the
error comes within 5 % of the rounding term ``(2u + u**2) |x| max|w|``).

So each row's token is exactly the argmax (first maximal index, as ``torch.argmax``) of the
fp32 dot products ``x . w`` over the whole vocabulary. Those dot products are summed in
another order than the fp32 GEMM of the plain head, so, as with ``prepack_linear``, a
greedy token can differ from the plain path's only where two logits tie to the last bits.

A screened step returns logits that hold the candidates' fp32 values and ``-inf`` everywhere
else: right for greedy sampling and nothing else (a model that maps its logits on, by scale or
soft-capping, keeps the order; only where fp32 soft-capping saturates, at logits beyond about
nine times the cap, could a token tied there with a lower index than every candidate win on
the plain path instead), so the engine screens only steps whose
requests are all greedy and that no step hook records. A step with a row whose bound is not
finite (NaN or inf in the hidden state), or with more than ``MAX_CANDIDATES_PER_ROW``
candidates a row, runs the plain head instead.

In a captured decode step (``runtime/captured_decode.py``) the head is one registered
operator, ``torch.ops.kvskill.screened_head``: which tokens are candidates, and whether the
step screens at all, depend on values a trace cannot know, so the operator decides them when
the graph replays, as an eager call does.
"""

from __future__ import annotations

import itertools
import math
import types
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from kvskill.runtime import prepacked_linear
from kvskill.runtime.forward_context import live_rows_of
from kvskill.runtime.ops.reference.graph_ops import compiling, register
from torch import Tensor, nn

#: bf16 unit roundoff (8 significant bits, round to nearest even)
BF16_UNIT_ROUNDOFF = 2.0**-8
#: a step whose rows average more candidates than this runs the plain fp32 head: the bound is
#: loose for that input (near-constant logits, e.g. an untrained head) and the gather would
#: cost more than it saves
MAX_CANDIDATES_PER_ROW = 256
#: logits per tile of the candidate search (a vocabulary not a multiple of it is one tile)
TILE = 64


def unavailable_reason() -> str | None:
    """Why this torch and CPU cannot screen the head at speed, or None when they can."""
    reason = prepacked_linear.unavailable_reason()  # the same oneDNN linear ops, in bf16
    if reason is not None:
        return reason
    ops = torch.ops.mkldnn
    if not hasattr(ops, "_is_mkldnn_bf16_supported"):
        return "this torch has no torch.ops.mkldnn._is_mkldnn_bf16_supported"
    if not ops._is_mkldnn_bf16_supported():
        # Without native bf16 dot products oneDNN emulates them, slower than the fp32 head.
        return "this CPU has no native bf16 support for oneDNN (AVX512-BF16 or AMX)"
    return None


def error_coefficient(in_features: int) -> float:
    """``c`` of the module docstring's bound for a head of ``in_features`` inputs."""
    u = BF16_UNIT_ROUNDOFF
    accumulated = in_features * 2.0**-24
    gamma = accumulated / (1.0 - accumulated)
    return (2 * u + u * u + 3 * gamma) * (1 + 2.0**-10)


@dataclass
class ScreenStats:
    """What the screen did over a run (rows it decided, candidates computed, plain fallbacks)."""

    num_screened_rows: int = 0
    num_candidates: int = 0
    num_fallback_rows: int = 0

    @property
    def candidates_per_row(self) -> float:
        return self.num_candidates / self.num_screened_rows if self.num_screened_rows else 0.0

    def to_dict(self) -> dict:
        return {
            "num_screened_rows": self.num_screened_rows,
            "num_candidates": self.num_candidates,
            "candidates_per_row": self.candidates_per_row,
            "num_fallback_rows": self.num_fallback_rows,
        }


class ScreenedHead:
    """Wraps a model's output ``nn.Linear``; screens its calls while ``screening`` is on."""

    def __init__(self, head: nn.Linear) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"cannot screen the output head: {reason}")
        if type(head) is not nn.Linear or head.bias is not None:
            raise RuntimeError(
                "cannot screen the output head: it is not a bias-free nn.Linear "
                f"({type(head).__name__})"
            )
        if head.weight.dtype != torch.float32 or head.weight.device.type != "cpu":
            raise RuntimeError(
                "cannot screen the output head: its weight is "
                f"{head.weight.dtype} on {head.weight.device.type}, not float32 on the CPU"
            )
        weight = head.weight.detach()
        self.weight = weight
        self.packed_bf16 = prepacked_linear.packed_weight(weight.to(torch.bfloat16))
        self.max_row_norm = float(weight.norm(dim=1).max())
        self.coefficient = error_coefficient(head.in_features)
        self.stats = ScreenStats()
        self.active = False
        #: this screen's key in _SCREENS: the captured graph's operator finds it by this int
        self.screen_id = next(_SCREEN_IDS)
        _SCREENS[self.screen_id] = self
        # Whatever forward the head has now (the plain one, or prepacked_linear's) stays the
        # path for every call that is not screened.
        self._plain_forward = head.forward
        head.forward = types.MethodType(_screened_forward, head)
        head._kvskill_screen = self

    @contextmanager
    def screening(self, on: bool) -> Iterator[None]:
        """Screen the head's calls inside the block when ``on`` (greedy-only steps)."""
        self.active = on
        try:
            yield
        finally:
            self.active = False

    def forward(self, x: Tensor) -> Tensor:
        if compiling():
            rows = live_rows_of(math.prod(x.shape[:-1]))
            return _SCREENED_HEAD(x, self.screen_id, rows)
        return self.forward_now(x)

    def forward_now(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """The head's logits of ``x``, screened when ``screening`` is on, decided now; written
        into OUT (fp32, ``[*x.shape[:-1], vocab]``) when given."""
        if self.active and x.dtype == torch.float32 and x.device.type == "cpu":
            rows = x.reshape(-1, x.shape[-1])
            logits = self.screen(rows, None if out is None else out.view(rows.shape[0], -1))
            if logits is not None:
                return logits.reshape(*x.shape[:-1], logits.shape[-1])
            self.stats.num_fallback_rows += rows.shape[0]
        logits = self._plain_forward(x)
        return logits if out is None else out.copy_(logits)

    def screen(self, x: Tensor, out: Tensor | None = None) -> Tensor | None:
        """``[N, V]`` logits exact in fp32 at each row's candidates, ``-inf`` elsewhere (in
        OUT when given); None when the bound is not finite or the candidates are too many
        (the caller runs the plain head)."""
        vocab = self.weight.shape[0]
        if x.shape[0] == 0:
            return x.new_empty(0, vocab) if out is None else out
        approx = torch.ops.mkldnn._linear_pointwise(
            x.to(torch.bfloat16), self.packed_bf16, None, "none", [], ""
        ).float()
        # The row maximum and the candidates come from tiles of TILE logits: one vectorised
        # max per tile, then a comparison over the few tiles that reach the threshold only
        # (comparing and listing the whole [N, V] costs several times the maxima).
        tile = TILE if vocab % TILE == 0 else vocab
        tiles = approx.view(x.shape[0], vocab // tile, tile)
        tile_top = tiles.amax(dim=-1)
        threshold = self.threshold(x, tile_top.amax(dim=-1))
        if not bool(torch.isfinite(threshold).all()):
            return None
        # Row-major order, tiles and lanes ascending: each row's candidates come in ascending
        # token order, so the argmax of the returned row picks the first of tied fp32 logits,
        # as over the whole row.
        tile_rows, tile_ids = (tile_top >= threshold.unsqueeze(1)).nonzero(as_tuple=True)
        reached = tiles[tile_rows, tile_ids] >= threshold.index_select(0, tile_rows).unsqueeze(1)
        which, lane = reached.nonzero(as_tuple=True)
        if which.numel() > MAX_CANDIDATES_PER_ROW * x.shape[0]:
            return None
        rows = tile_rows.index_select(0, which)
        tokens = tile_ids.index_select(0, which) * tile + lane
        exact = (x.index_select(0, rows) * self.weight.index_select(0, tokens)).sum(dim=-1)
        if out is None:
            logits = torch.full((x.shape[0], vocab), float("-inf"), dtype=torch.float32)
        else:
            logits = out.fill_(float("-inf"))
        logits[rows, tokens] = exact
        self.stats.num_screened_rows += x.shape[0]
        self.stats.num_candidates += rows.numel()
        return logits

    def threshold(self, x: Tensor, top: Tensor) -> Tensor:
        """Per row, the bf16 logit below which a token's fp32 logit is below the top token's.

        With ``e(a) = cS + 2u|a|`` bounding ``|bf16 logit a - fp32 logit|`` (``cS`` the
        row's ``c |x| max|w|``): the top token's fp32 logit is at least ``top - e(top)``, and a
        token's at most ``a + 2u|a| + cS``, increasing in ``a``; so the threshold solves
        ``a + 2u|a| = top - 2u|top| - 2cS``.
        """
        u2 = 2 * BF16_UNIT_ROUNDOFF
        spread = self.coefficient * x.norm(dim=-1) * self.max_row_norm + 1e-30
        target = top - u2 * top.abs() - 2 * spread
        return torch.where(target >= 0, target / (1 + u2), target / (1 - u2))


def _screened_forward(self: nn.Linear, x: Tensor) -> Tensor:
    return self._kvskill_screen.forward(x)


#: every live screen by its screen_id (weak: a screen lives as long as its head)
_SCREENS: weakref.WeakValueDictionary[int, ScreenedHead] = weakref.WeakValueDictionary()
_SCREEN_IDS = itertools.count()


def _screened_head(x: Tensor, screen_id: int, live_rows: int = -1) -> Tensor:
    """The head's logits as an eager call gives them: screened when the step screens; in a
    captured decode step, of its live rows only (the padded rows' logits are zeros, which the
    step drops), so padded rows neither cost a GEMM row nor add candidates to the screen."""
    screen = _SCREENS[screen_id]
    # the live rows' logits are written in place: at a vocabulary of 152k, a copy of them
    # cost about 3 ms a step (measured, 17 of 24 rows)
    return prepacked_linear.on_live_rows(
        screen.forward_now, x, live_rows, screen.weight.shape[0], dtype=torch.float32
    )


def _screened_head_shape(x: Tensor, screen_id: int, live_rows: int = -1) -> Tensor:
    vocab = _SCREENS[screen_id].weight.shape[0]
    return x.new_empty(*x.shape[:-1], vocab, dtype=torch.float32)


_SCREENED_HEAD = register("screened_head", _screened_head, _screened_head_shape)


def screen_output_head(model: nn.Module) -> ScreenedHead:
    """Screen the model's output head: ``get_output_embeddings()``, else its ``lm_head`` (a
    plain ``nn.Module`` from vendor code has no getter). Call after any prepacking.

    Raises:
        RuntimeError: when the CPU or torch cannot (``unavailable_reason``) or the model's
            output head is not a bias-free fp32 ``nn.Linear`` on the CPU.
    """
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is None:
        head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Module):
        raise RuntimeError("cannot screen the output head: the model exposes none")
    return ScreenedHead(head)

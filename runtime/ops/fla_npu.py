"""How an FLA entry point's call becomes a call of the torch_npu operator doing the same job.

Each ``Route`` reads the entry point's bound arguments (its reference signature, defaults
applied) and either returns a ``NpuCall`` — the operator's arguments in its own schema
(torch_npu 2.13.0, ``tests/fixtures/npu_schemas.json``), what to do to the caller's tensors
first, and how to turn the operator's result back into the entry point's — or says in one
line why the call cannot go to the operator (a feature it lacks, a documented limit the
shapes or dtypes break). The facade (``fla.py``) then runs the reference instead.

Layouts differ on purpose at this boundary: FLA's conv input is channel-major ``[dim, T]``
and its states ``[lines, dim, state_len]`` / ``[lines, HV, K, V]``; the operators are
token-major (``[T, dim]``, ``[lines, state_len, dim]``) and keep the delta-rule state
value-major ``[slots, Nv, Dv, Dk]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from .fla_reference import ACTIVATIONS, activate
from .reference._checks import OpInputError
from .reference.causal_conv import KERNEL_WIDTH, check_device_limits
from .reference.gated_delta import MAX_TOKENS_PER_REQUEST, l2norm
from .reference.gated_delta_limits import check_chunk, check_recurrent
from .reference.npu_profile import npu_limits

#: the models the causal-conv operator lists under 支持的型号 (supported models)
CONV_SOC = "950"


@dataclass(frozen=True)
class NpuCall:
    """One operator call standing in for one entry-point call."""

    args: tuple
    kwargs: dict[str, Any]
    #: turns the operator's result into the entry point's
    finish: Callable[[Any], Any]
    #: runs just before the operator (e.g. zeroing the state rows of new requests)
    prepare: Callable[[], None] = field(default=lambda: None)
    #: what the call changes that the caller should know of (the report shows it)
    note: str = ""


@dataclass(frozen=True)
class Route:
    """An entry point's torch_npu counterpart."""

    #: the torch_npu operator's name
    operator: str
    #: bound entry-point arguments -> the call, or the reason it cannot be made
    plan: Callable[[dict[str, Any]], NpuCall | str]


def _limit_problem(check: Callable[[], None]) -> str | None:
    """The documented limit CHECK finds broken on the device, or None."""
    try:
        with npu_limits():
            check()
    except OpInputError as exc:
        return str(exc)
    return None


def _given(a: dict[str, Any], *names: str) -> str | None:
    used = [n for n in names if a.get(n) is not None]
    return f"{', '.join(used)} given (the operator path covers none of them)" if used else None


@lru_cache(maxsize=1)
def _device_name() -> str | None:
    npu = getattr(torch, "npu", None)
    try:
        return str(npu.get_device_name(0)) if npu is not None and npu.is_available() else None
    except (RuntimeError, AssertionError, AttributeError):
        return None


def _conv_soc_problem() -> str | None:
    # 支持的型号 of npu_fused_causal_conv1d names only the Ascend 950. unconfirmed: the exact
    # string torch.npu.get_device_name() gives there; a device that reports no name is tried.
    name = _device_name()
    if name is None or CONV_SOC in name:
        return None
    return (
        f"npu_fused_causal_conv1d runs on the Ascend {CONV_SOC} only (支持的型号); this is {name}"
    )


def _activate(y: Tensor, bias: Tensor | None, activation: object, dtype: torch.dtype) -> Tensor:
    # The operator applies neither bias nor activation (both 暂不支持, unsupported), so they
    # follow it here: bias, then the activation, in fp32 over the operator's rounded output.
    if bias is None and activation in (None, False):
        return y
    y = y.float() if bias is None else y.float() + bias.float()
    return activate(y, activation).to(dtype)


def _conv_problem(a: dict[str, Any], x_rows: Tensor) -> str | None:
    if a["activation"] not in ACTIVATIONS:
        return f"activation {a['activation']!r}"  # the reference's own error follows
    return _conv_soc_problem() or _limit_problem(
        lambda: check_device_limits(x_rows, a["weight"].t())
    )


def _plan_conv_fn(a: dict[str, Any]) -> NpuCall | str:
    problem = _given(
        a,
        "block_idx_first_scheduled_token",
        "block_idx_last_scheduled_token",
        "initial_state_idx",
        "num_computed_tokens",
    )
    x, states = a["x"], a["conv_states"]
    rows = x.t()  # [T, dim]
    problem = problem or _conv_problem(a, rows)
    if problem:
        return problem
    offsets = a["query_start_loc"].to(torch.int32)
    num_seqs = offsets.numel() - 1
    lines = a["cache_indices"]
    lines = torch.arange(num_seqs, device=x.device) if lines is None else lines.long()
    started = a["has_initial_state"]

    def zero_new_requests() -> None:
        # initial_state_mode is unsupported: the operator always reads the state row, so a
        # request with no history gets a zeroed row first (what has_initial_state=False means)
        fresh = lines != a["pad_slot_id"]
        if started is not None:
            fresh &= ~started.bool()
        states[lines[fresh]] = 0

    return NpuCall(
        args=(rows.contiguous(), a["weight"].t().contiguous(), states.transpose(-1, -2)),
        kwargs={
            "query_start_loc": offsets,
            "cache_indices": lines.to(torch.int32),
            "pad_slot_id": a["pad_slot_id"],
        },
        prepare=zero_new_requests,
        finish=lambda y: _activate(y, a["bias"], a["activation"], x.dtype).t(),
    )


def _update_rows(x: Tensor, dim: int, query_start_loc: Tensor | None):
    """x in the operator's token-major form, and how to give y back x's own form."""
    if query_start_loc is not None:
        return x, {"query_start_loc": query_start_loc.to(torch.int32)}, lambda y: y
    if x.dim() == 2:  # one token per request: the operator's [batch, seq_len = 1, dim]
        return x.unsqueeze(1), {}, lambda y: y.squeeze(1)
    return x.transpose(1, 2), {}, lambda y: y.transpose(1, 2)  # [B, dim, L] -> [B, L, dim]


def _plan_conv_update(a: dict[str, Any]) -> NpuCall | str:
    x, states, weight = a["x"], a["conv_state"], a["weight"]
    problem = _given(
        a,
        "num_accepted_tokens",
        "block_idx_last_scheduled_token",
        "initial_state_idx",
        "retrieve_parent_token",
    )
    if problem:
        return problem
    if x.size(-1 if a["query_start_loc"] is not None or x.dim() == 2 else 1) != weight.size(0):
        return "x does not hold the weight's channels where the entry point expects them"
    if states.size(-1) != weight.size(1) - 1:
        # FLA's update reads the first K-1 columns of a longer row, the operator the last
        return (
            f"conv state rows of {states.size(-1)} columns: the operator and the entry point "
            f"read the same context only when a row holds K-1 = {weight.size(1) - 1}"
        )
    rows, extra, back = _update_rows(x, weight.size(0), a["query_start_loc"])
    problem = _conv_problem(a, rows)
    if problem:
        return problem
    lines = a["conv_state_indices"]
    if lines is not None and lines.dim() != 1:
        return "conv_state_indices with a line per token (a speculative verify step)"
    if lines is not None:
        extra["cache_indices"] = lines.to(torch.int32)
    return NpuCall(
        args=(rows.contiguous(), weight.t().contiguous(), states.transpose(-1, -2)),
        kwargs={**extra, "pad_slot_id": a["pad_slot_id"]},
        finish=lambda y: back(_activate(y, a["bias"], a["activation"], x.dtype)),
    )


@dataclass(frozen=True)
class _Packed:
    """q/k/v/g/beta of an FLA call as the operators' packed rows ([T, ...]) and lengths."""

    query: Tensor
    key: Tensor
    value: Tensor
    g: Tensor
    beta: Tensor
    lengths: list[int]
    scale: float


def _packed(a: dict[str, Any]) -> _Packed:
    q, k, v = a["q"], a["k"], a["v"]
    batch, tokens = q.shape[:2]
    if a["cu_seqlens"] is not None:
        lengths = a["cu_seqlens"].diff().tolist()
    else:
        lengths = [tokens] * batch
    query, key = q.flatten(0, 1), k.flatten(0, 1)
    if a["use_qk_l2norm_in_kernel"]:
        # the operators take normalised q and k (their docs' example normalises first)
        query, key = l2norm(query).to(q.dtype), l2norm(key).to(k.dtype)
    beta = a["beta"]
    beta = torch.ones(v.shape[:3], device=v.device) if beta is None else beta
    scale = a["scale"] if a["scale"] is not None else q.size(-1) ** -0.5
    return _Packed(
        query=query,
        key=key,
        value=v.flatten(0, 1),
        g=a["g"].flatten(0, 1).float(),  # 参数说明: g is float32
        beta=beta.flatten(0, 1).to(q.dtype),  # and beta the query's bfloat16
        lengths=[int(n) for n in lengths],
        scale=float(scale),
    )


def _plan_recurrent(a: dict[str, Any]) -> NpuCall | str:
    problem = _given(a, "num_accepted_tokens", "retrieve_parent_token")
    state, rows = a["initial_state"], a["ssm_state_indices"]
    if problem:
        return problem
    if state is None or not a["inplace_final_state"]:
        return "the operator updates a given state in place (initial_state, inplace_final_state)"
    if rows is not None and (rows.dim() != 1 or bool((rows < 0).any())):
        return "ssm_state_indices with a slot per token or pad slots"
    if a["cu_seqlens"] is not None and a["q"].size(0) != 1:
        return "cu_seqlens with a batch other than 1"  # the reference's own error follows
    p = _packed(a)
    if any(not 1 <= n <= MAX_TOKENS_PER_REQUEST for n in p.lengths):
        return f"requests of {max(p.lengths)} tokens (约束说明: L_i <= {MAX_TOKENS_PER_REQUEST})"
    rows = torch.arange(len(p.lengths), device=state.device) if rows is None else rows.long()
    lengths = torch.tensor(p.lengths, dtype=torch.int32, device=state.device)

    def limits() -> None:
        check_recurrent(
            "npu_recurrent_gated_delta_rule",
            p.query,
            p.value,
            key=p.key,
            state=state.transpose(-1, -2).to(p.query.dtype),
            beta=p.beta,
            g=p.g,
            actual_seq_lengths=lengths,
        )

    problem = _limit_problem(limits)
    if problem:
        return problem
    # The requests' own rows, value-major and contiguous; every token of request n reads and
    # writes local slot n, and the rows go back to the caller's state after the call. The
    # operator keeps its state in bfloat16 (参数说明): rows of a state pinned to float32 are
    # narrowed for the call and widened back, so they carry bf16 rounding on this path.
    local = state[rows].transpose(-1, -2).to(p.query.dtype).contiguous()
    slots = torch.arange(len(p.lengths), device=state.device, dtype=torch.int32)

    def finish(out: Tensor) -> tuple[Tensor, Tensor]:
        state[rows] = local.transpose(-1, -2).to(state.dtype)
        return out.view(*a["v"].shape[:2], *out.shape[1:]).to(a["q"].dtype), state

    return NpuCall(
        args=(p.query, p.key, p.value, local),
        kwargs={
            "beta": p.beta,
            "scale": p.scale,
            "actual_seq_lengths": lengths,
            "ssm_state_indices": slots.repeat_interleave(lengths),
            "g": p.g,
        },
        finish=finish,
        note=_narrowed(state, p.query.dtype),
    )


def _narrowed(state: Tensor | None, dtype: torch.dtype) -> str:
    if state is None or state.dtype == dtype:
        return ""

    def name(d: torch.dtype) -> str:
        return str(d).removeprefix("torch.")

    return f"{name(state.dtype)} state rows narrowed to the operator's {name(dtype)}"


def _plan_chunk(a: dict[str, Any]) -> NpuCall | str:
    if a["head_first"]:
        return "head_first layout"  # the reference's own error follows
    if a["cu_seqlens"] is not None and a["q"].size(0) != 1:
        return "cu_seqlens with a batch other than 1"
    p = _packed(a)
    nv, dv, dk = p.value.size(1), p.value.size(2), p.query.size(2)
    batch = len(p.lengths)
    lengths = torch.tensor(p.lengths, dtype=torch.int32, device=p.query.device)
    given = a["initial_state"]
    # 参数说明: the state is bfloat16 [B, Nv, Dv, Dk]; an fp32 copy of a bf16 row (as the
    # converted prefill gathers it) narrows back without loss
    if given is not None and given.size(0) != batch:
        return f"{given.size(0)} initial states for {batch} sequences"
    start = (
        given.transpose(-1, -2).to(p.query.dtype).contiguous()
        if given is not None
        else p.query.new_zeros(batch, nv, dv, dk)
    )

    def limits() -> None:
        check_chunk(
            "npu_chunk_gated_delta_rule",
            p.query,
            p.value,
            key=p.key,
            beta=p.beta,
            initial_state=start,
            g=p.g,
            actual_seq_lengths=lengths,
        )

    problem = _limit_problem(limits)
    if problem:
        return problem

    def finish(result: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor | None]:
        out, final = result
        out = out.view(*a["v"].shape[:2], *out.shape[1:]).to(a["q"].dtype)
        return out, (final.transpose(-1, -2) if a["output_final_state"] else None)

    return NpuCall(
        args=(p.query, p.key, p.value),
        kwargs={
            "beta": p.beta,
            "initial_state": start,
            "actual_seq_lengths": lengths,
            "scale": p.scale,
            "g": p.g,
        },
        finish=finish,
    )


#: entry point -> its operator route
ROUTES: dict[str, Route] = {
    "causal_conv1d_fn": Route("npu_fused_causal_conv1d", _plan_conv_fn),
    "causal_conv1d_update": Route("npu_fused_causal_conv1d", _plan_conv_update),
    "fused_recurrent_gated_delta_rule": Route("npu_recurrent_gated_delta_rule", _plan_recurrent),
    "chunk_gated_delta_rule": Route("npu_chunk_gated_delta_rule", _plan_chunk),
}
#: entry point -> why no torch_npu 2.13.0 operator does its job
NO_OPERATOR: dict[str, str] = {
    "chunk_kda": "npu_chunk_gated_delta_rule takes one decay per head, not per key channel",
    "fused_recurrent_kda": "npu_recurrent_gated_delta_rule's per-channel decay gk is 暂不支持 "
    "(unsupported) in torch_npu 2.13.0",
    "selective_scan_fn": "torch_npu 2.13.0 has no selective-scan (Mamba-1) operator",
}

__all__ = ["CONV_SOC", "KERNEL_WIDTH", "NO_OPERATOR", "ROUTES", "NpuCall", "Route"]

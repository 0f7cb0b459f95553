"""The fast paths inside a captured step: each kernel is one node of the graph, the graph
gives what the eager step gives, an exact step's trace keeps the model's own code, and a
padded step's live count spares the padded rows' arithmetic without a graph per count."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from kvskill.runtime import fused_layers, prepacked_linear, screened_head
from kvskill.runtime.captured_decode import traced_scalar_reads
from kvskill.runtime.exact_steps import exact_steps
from kvskill.runtime.forward_context import ForwardMetaData, captured_forward_context
from kvskill.runtime.ops.cpu_kernels import fused_elementwise
from kvskill.runtime.ops.reference.graph_ops import dispatched_operators, operator
from torch import nn

TOKENS, HEADS, HEAD_DIM = 3, 2, 8
WIDTH = HEADS * HEAD_DIM


class _RMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(WIDTH, 40, bias=False)
        self.up_proj = nn.Linear(WIDTH, 40, bias=False)
        self.down_proj = nn.Linear(40, WIDTH, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Step(nn.Module):
    """A decoder layer's shape in little: norm, q/k/v siblings, rope, gated MLP, head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = _RMSNorm()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.mlp = _MLP()
        self.lm_head = nn.Linear(WIDTH, 512, bias=False)
        self.register_buffer("cos", torch.randn(TOKENS, HEAD_DIM))
        self.register_buffer("sin", torch.randn(TOKENS, HEAD_DIM))

    def forward(self, x):
        h = self.norm(x)
        q = self.q_proj(h).view(1, TOKENS, HEADS, HEAD_DIM).transpose(1, 2)
        turned = fused_elementwise.rope(q, self.cos, self.sin)
        q = (q if turned is None else turned).transpose(1, 2).reshape(TOKENS, WIDTH)
        h = x + q * self.k_proj(h) + self.v_proj(h)
        return self.lm_head(h + self.mlp(h))


def _capture(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Counter]:
    """MODULE(x) through dynamo (fullgraph: a break fails), and the calls of its graph."""
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(module, backend=keep, fullgraph=True)(x)
    (graph,) = graphs
    calls = Counter(
        str(node.target).removesuffix(".default")
        for node in graph.graph.nodes
        if node.op == "call_function"
    )
    return out, calls


@pytest.fixture
def fast_step(monkeypatch):
    for module in (prepacked_linear, fused_layers):
        if module.unavailable_reason() is not None:
            pytest.skip(module.unavailable_reason())
    # the screen's arithmetic runs without native bf16 too (emulated, slower)
    monkeypatch.setattr(screened_head, "unavailable_reason", lambda: None)
    step = _Step().eval()
    with torch.no_grad():
        expected = step(torch.randn(TOKENS, WIDTH))
    prepacked_linear.prepack_linears(step)
    assert fused_layers.fuse_layers(step) == 2  # the norm and the MLP
    screen = screened_head.screen_output_head(step)
    return step, screen, expected


def test_a_captured_step_keeps_every_fast_kernel_as_one_node_and_gives_the_eager_logits(
    fast_step,
):
    step, screen, _ = fast_step
    x = torch.randn(TOKENS, WIDTH)
    with torch.inference_mode(), screen.screening(True):
        eager = step(x)
        rows_before = screen.stats.num_screened_rows
        captured, calls = _capture(step, x)
    assert calls["kvskill.packed_linear"] == 3  # q/k/v as one GEMM, gate/up as one, down
    assert calls["kvskill.fused_rms_norm"] == 1
    assert calls["kvskill.fused_silu_mul"] == 1
    assert calls["kvskill.fused_rope"] == 1
    assert calls["kvskill.screened_head"] == 1
    assert "<built-in function linear>" not in calls
    # the screen decided when the graph ran (the trace runs no real values through it)
    assert screen.stats.num_screened_rows == rows_before + TOKENS
    assert torch.equal(captured, eager)
    assert torch.isinf(captured).any()  # screened: -inf off the candidates


def test_an_exact_steps_trace_keeps_the_models_own_code(fast_step):
    step, _, expected = fast_step
    x = torch.randn(TOKENS, WIDTH)
    with torch.no_grad():
        own = _Step().eval()(x)  # the same seeded weights, never switched
        with exact_steps():
            captured, calls = _capture(step, x)
    # the step's own linears, norm and MLP; the toy calls the rope kernel itself, and the
    # head's node runs the plain head when it replays (no screening, an exact step)
    assert {name for name in calls if name.startswith("kvskill.")} == {
        "kvskill.fused_rope",
        "kvskill.screened_head",
    }
    assert calls["<built-in function linear>"] == 6
    torch.testing.assert_close(captured, own, rtol=0, atol=0)
    assert expected.shape == captured.shape


def test_eager_calls_routed_through_the_registered_operators_give_the_same_logits(fast_step):
    # bench_captured_decode counts operator calls this way: each kernel is one call
    step, screen, _ = fast_step
    x = torch.randn(TOKENS, WIDTH)
    with torch.inference_mode(), screen.screening(True):
        eager = step(x)
        with dispatched_operators():
            routed = step(x)
    assert torch.equal(routed, eager)
    assert screen.stats.num_screened_rows == 2 * TOKENS


def test_a_graph_captured_fast_is_traced_again_for_an_exact_step(fast_step):
    step, _, _ = fast_step
    x = torch.randn(TOKENS, WIDTH)
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=keep, fullgraph=True)
    with torch.no_grad():
        own = _Step().eval()(x)
        compiled(x)
        with exact_steps():
            exact = compiled(x)
    assert len(graphs) == 2  # the setting is guarded: the exact step did not replay the first
    torch.testing.assert_close(exact, own, rtol=0, atol=0)


def test_with_a_live_count_the_packed_linear_and_head_give_the_live_rows_and_zeros(fast_step):
    step, screen, _ = fast_step
    x = torch.randn(1, 4, WIDTH)
    qkv = step.q_proj._kvskill_fused
    linear, head = operator("packed_linear"), operator("screened_head")
    with torch.inference_mode():
        full = linear(x, qkv.packed, qkv.bias, -1)
        full_plain = head(x, screen.screen_id, -1)
        with screen.screening(True):
            full_logits = head(x, screen.screen_id, -1)
        assert torch.isinf(full_logits).any()  # screened
        for live in (0, 1, 3, 4):
            rows = linear(x, qkv.packed, qkv.bias, live)
            assert torch.equal(rows[:, :live], full[:, :live])
            assert rows.shape == full.shape and not rows[:, live:].any()
            with screen.screening(True):
                logits = head(x, screen.screen_id, live)
            assert torch.equal(logits[:, :live], full_logits[:, :live])
            assert logits.shape == full_logits.shape and not logits[:, live:].any()
            plain = head(x, screen.screen_id, live)  # not screening: the plain head
            assert torch.equal(plain[:, :live], full_plain[:, :live])
            assert plain.shape == full_plain.shape and not plain[:, live:].any()


def test_two_live_counts_of_one_padded_step_replay_one_graph(fast_step):
    step, screen, _ = fast_step
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    def padded_step(x, num_live):
        live_rows = num_live.item()
        with captured_forward_context(ForwardMetaData(), live_rows=live_rows, padded_rows=TOKENS):
            return step(x)

    torch._dynamo.reset()
    compiled = torch.compile(padded_step, backend=keep, fullgraph=True, dynamic=False)
    x = torch.randn(TOKENS, WIDTH)
    with torch.inference_mode(), screen.screening(True), traced_scalar_reads():
        full = step(x)
        for live in (2, 1, TOKENS):
            out = compiled(x, torch.tensor(live))
            assert torch.equal(out[:live], full[:live]), live
            assert not out[live:].any()
    assert len(graphs) == 1  # the live count is a traced int: no recompile per value
    (graph,) = graphs
    live_args = [
        node.args[-1]
        for node in graph.graph.nodes
        if str(node.target).startswith(("kvskill.packed_linear", "kvskill.screened_head"))
    ]
    assert len(live_args) == 4 and all(isinstance(a, torch.fx.Node) for a in live_args)

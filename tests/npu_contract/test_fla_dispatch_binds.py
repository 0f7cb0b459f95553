"""The FLA entry points' operator calls bind against torch_npu 2.13.0's schemas and pass its
documented limits, called directly and from a converted gated-delta model on the stand-in
torch_npu."""

from __future__ import annotations

from pathlib import Path

import fake_torch_npu
import pytest
import torch
from kvskill.implementer.writer import ApplyOptions, apply_model
from kvskill.runtime import LLM, SamplingParams
from kvskill.runtime.ops import fla, fla_npu

BF16 = torch.bfloat16
ROUTED = {
    "npu_fused_causal_conv1d": ("causal_conv1d_fn", "causal_conv1d_update"),
    "npu_chunk_gated_delta_rule": ("chunk_gated_delta_rule",),
    "npu_recurrent_gated_delta_rule": ("fused_recurrent_gated_delta_rule",),
}


@pytest.fixture
def fake_npu(monkeypatch):
    log = fake_torch_npu.CallLog()
    fake_torch_npu.install(monkeypatch, log)
    fla_npu._device_name.cache_clear()
    fla.reset_dispatch_report()
    yield log
    fla.reset_dispatch_report()


def _npu_rows() -> dict[str, str]:
    return {r["entry"]: r["via"] for r in fla.dispatch_report() if r["backend"] == "npu"}


def test_every_route_names_an_operator_of_the_schema_fixture():
    schemas = fake_torch_npu.load_schemas()
    assert {route.operator for route in fla_npu.ROUTES.values()} == set(ROUTED)
    assert set(ROUTED) <= set(schemas)


def test_direct_calls_bind_to_the_schemas(fake_npu):
    torch.manual_seed(0)
    dim, lens = 256, [3, 2]
    x = torch.randn(dim, sum(lens), dtype=BF16)
    weight, states = torch.randn(dim, 3, dtype=BF16), torch.zeros(4, dim, 2, dtype=BF16)
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    lines = torch.tensor([1, 3], dtype=torch.int32)
    fla.causal_conv1d_fn(x, weight, None, states, qsl, lines, activation="silu")
    fla.causal_conv1d_update(torch.randn(2, dim, dtype=BF16), states, weight, None, None, lines)
    q = torch.randn(1, 5, 2, 128, dtype=BF16)
    v = torch.randn(1, 5, 4, 128, dtype=BF16)
    g, beta = -torch.rand(1, 5, 4), torch.rand(1, 5, 4, dtype=BF16)
    fla.chunk_gated_delta_rule(q, q, v, g, beta, cu_seqlens=qsl, output_final_state=True)
    state = torch.zeros(4, 4, 128, 128, dtype=BF16)
    step = slice(0, 2)
    fla.recurrent_gated_delta_rule(
        q[:, step],
        q[:, step],
        v[:, step],
        g=g[:, step],
        beta=beta[:, step],
        initial_state=state,
        cu_seqlens=torch.tensor([0, 1, 2], dtype=torch.int32),
        ssm_state_indices=lines,
    )
    assert set(_npu_rows()) == {entry for entries in ROUTED.values() for entry in entries}
    (recurrent,) = fake_npu.of("npu_recurrent_gated_delta_rule")
    assert recurrent["actual_seq_lengths"].dtype == torch.int32
    assert recurrent["state"].shape == (2, 4, 128, 128)  # the requests' rows, value-major
    assert recurrent["g"].dtype == torch.float32 and recurrent["beta"].dtype == BF16
    (chunk,) = fake_npu.of("npu_chunk_gated_delta_rule")
    assert chunk["actual_seq_lengths"].tolist() == lens
    assert chunk["scale"] == pytest.approx(128**-0.5)  # the operator's default would be 1.0
    prefill, decode = fake_npu.of("npu_fused_causal_conv1d")
    assert prefill["x"].shape == (5, dim) and prefill["weight"].shape == (3, dim)
    assert decode["x"].shape == (2, 1, dim) and decode["conv_states"].shape == (4, 2, dim)


@pytest.mark.slow
def test_a_converted_gated_delta_model_runs_its_state_ops_on_the_operators(tmp_path, fake_npu):
    # qwen3_next with the shapes the three operators take: conv kernel 3, channels a multiple
    # of 128, delta-rule head dims 128; prefill packs two prompts, then one decode step
    config = {
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 512,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 3,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
    }
    out = Path(tmp_path) / "qwen3_next"
    apply_model("qwen3_next", out, ApplyOptions(config_overrides=config))
    llm = LLM(
        out,
        random_weights=True,
        dtype="bfloat16",
        device="cpu",
        block_size=128,
        num_blocks=8,
        freeze_startup_heap=False,
    )
    llm.generate([list(range(1, 20)), list(range(1, 40))], SamplingParams(max_tokens=2))
    assert _npu_rows() == {
        "causal_conv1d_fn": "torch_npu.npu_fused_causal_conv1d",
        "causal_conv1d_update": "torch_npu.npu_fused_causal_conv1d",
        "chunk_gated_delta_rule": "torch_npu.npu_chunk_gated_delta_rule",
        # the gated-delta state is pinned to float32; the operator keeps bfloat16
        "fused_recurrent_gated_delta_rule": "torch_npu.npu_recurrent_gated_delta_rule "
        "(float32 state rows narrowed to the operator's bfloat16)",
    }
    assert all(r["backend"] == "npu" for r in fla.dispatch_report())
    (chunk,) = fake_npu.of("npu_chunk_gated_delta_rule")
    assert chunk["actual_seq_lengths"].tolist() == [19, 39]
    (decode,) = fake_npu.of("npu_recurrent_gated_delta_rule")
    assert decode["actual_seq_lengths"].tolist() == [1, 1]

"""MTP checkpoint tensors: per-expert MoE tensors are fused into the layer's own parameters."""

import torch
from kvskill.runtime.mtp import _fuse_experts


def _split(gate_up: torch.Tensor, down: torch.Tensor, base: str) -> dict[str, torch.Tensor]:
    state = {}
    for j in range(gate_up.shape[0]):
        gate, up = gate_up[j].chunk(2, dim=0)
        state[f"{base}.{j}.gate_proj.weight"] = gate
        state[f"{base}.{j}.up_proj.weight"] = up
        state[f"{base}.{j}.down_proj.weight"] = down[j]
    return state


def test_per_expert_tensors_stack_into_the_fused_parameters():
    base = "layers.0.block.mlp.experts"
    gate_up, down = torch.randn(3, 8, 5), torch.randn(3, 5, 4)  # [E, 2I, H], [E, H, I]
    expected = {f"{base}.gate_up_proj", f"{base}.down_proj", "layers.0.enorm.weight"}
    state = {**_split(gate_up, down, base), "layers.0.enorm.weight": torch.ones(5)}
    fused = _fuse_experts(state, expected)
    assert set(fused) == expected
    assert torch.equal(fused[f"{base}.gate_up_proj"], gate_up)
    assert torch.equal(fused[f"{base}.down_proj"], down)


def test_an_incomplete_expert_set_is_left_for_the_mismatch_error():
    base = "layers.0.block.mlp.experts"
    state = _split(torch.randn(3, 8, 5), torch.randn(3, 5, 4), base)
    del state[f"{base}.1.up_proj.weight"]
    fused = _fuse_experts(state, {f"{base}.gate_up_proj", f"{base}.down_proj"})
    assert f"{base}.gate_up_proj" not in fused and f"{base}.0.gate_proj.weight" in fused
    assert torch.equal(
        fused[f"{base}.down_proj"],
        torch.stack([state[f"{base}.{j}.down_proj.weight"] for j in range(3)]),
    )

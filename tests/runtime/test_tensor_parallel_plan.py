"""Tensor-parallel sharding without processes: the split read from the model's structure,
the per-rank slices, the refusals, and that the ranks' partial outputs sum to the whole."""

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from kvskill.core.errors import BadInputError  # noqa: E402
from kvskill.runtime.distributed.shard import (  # noqa: E402
    Slice,
    apply_shards,
    check_tp_size,
    plan_shards,
)
from kvskill.runtime.distributed.weights import load_sharded_checkpoint  # noqa: E402
from kvskill.runtime.loader import load_model  # noqa: E402
from toy_factory import write_toy_dir  # noqa: E402


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    path = write_toy_dir(tmp_path_factory.mktemp("tp") / "toy", seed=3)
    return path, load_model(path, trust_remote_code=True).model


def test_attention_and_mlp_roles_from_shapes(toy):
    _, model = toy
    plan = plan_shards(model, 1, 2)
    roles = plan.attention_roles["model.layers.0.self_attn"]
    assert roles == {
        "q_proj": "column(q heads)",
        "k_proj": "column(kv heads)",
        "v_proj": "column(kv heads)",
        "o_proj": "row",
    }
    # rank 1 of 2: query heads 2..3 (rows 32..63), KV head 1 (rows 16..31), head_dim 16
    assert plan.slices["model.layers.0.self_attn.q_proj.weight"] == Slice(0, ((32, 64),))
    assert plan.slices["model.layers.0.self_attn.k_proj.weight"] == Slice(0, ((16, 32),))
    assert plan.slices["model.layers.0.self_attn.o_proj.weight"] == Slice(1, ((32, 64),))
    assert plan.mlps == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert plan.kv_heads_per_rank == 1
    assert "model.embed_tokens.weight" not in plan.slices  # replicated
    assert "lm_head.weight" not in plan.slices


def test_kv_heads_replicated_when_ranks_exceed_them(toy):
    _, model = toy  # 4 query heads, 2 KV heads
    rows = [
        plan_shards(model, rank, 4).slices["model.layers.1.self_attn.k_proj.weight"].ranges
        for rank in range(4)
    ]
    # ranks 0,1 share KV head 0, ranks 2,3 KV head 1: each with its own query head
    assert rows == [((0, 16),), ((0, 16),), ((16, 32),), ((16, 32),)]
    assert plan_shards(model, 0, 4).summary()["kv_replicated"] is True


@pytest.mark.parametrize(
    ("heads", "kv", "tp", "message"),
    [
        (4, 2, 3, "4 attention heads do not divide by tensor parallel size 3"),
        (6, 3, 2, "3 KV heads do not divide"),
        (12, 3, 4, "exceeds the 3 KV heads and is not a multiple"),
    ],
)
def test_splits_that_cannot_be_made_are_bad_input(heads, kv, tp, message):
    with pytest.raises(BadInputError, match=message):
        check_tp_size(heads, kv, tp, mla=False)


def test_mla_splits_query_heads_only():
    check_tp_size(4, 1, 4, mla=True)  # the latent is one head on every rank: no KV rule


class _Experts(nn.Module):
    """Experts as 3-D tensors, gate and up fused along dim 1 (transformers 5's layout)."""

    def __init__(self, experts=3, hidden=8, inter=6):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inter))

    def forward(self, x, index, weight):
        out = torch.zeros_like(x)
        for k in range(index.shape[1]):
            for e in range(self.gate_up_proj.shape[0]):
                rows = index[:, k] == e
                gate, up = (x[rows] @ self.gate_up_proj[e].T).chunk(2, dim=-1)
                out[rows] += weight[rows, k, None] * (
                    (torch.nn.functional.silu(gate) * up) @ self.down_proj[e].T
                )
        return out


class _Mlp(nn.Module):
    def __init__(self, hidden=8, inter=4):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter)
        self.up_proj = nn.Linear(hidden, inter)
        self.down_proj = nn.Linear(inter, hidden)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Moe(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 3, bias=False)
        self.experts = _Experts()
        self.shared_expert = _Mlp()

    def forward(self, x):
        weight, index = torch.topk(self.router(x).softmax(-1), 2, dim=-1)
        return self.experts(x, index, weight) + self.shared_expert(x)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = type("C", (), {"hidden_size": 8, "num_attention_heads": 2})()
        self.moe = _Moe()
        self.mlp = _Mlp()

    def forward(self, x):
        return self.mlp(self.moe(x))


def test_rank_partials_sum_to_the_whole_model():
    """MoE experts split by width (tensor parallel), the shared expert and a dense MLP
    column/row: summing the two ranks' outputs at each reduced module gives the original."""
    torch.manual_seed(0)
    whole = _Tiny()
    x = torch.randn(5, 8)
    expected = whole(x)
    ranks = [copy.deepcopy(whole) for _ in range(2)]
    plans = [plan_shards(model, rank, 2) for rank, model in enumerate(ranks)]
    assert plans[0].experts == ["moe.experts"] and plans[0].moe_blocks == ["moe"]
    assert plans[0].reduced == ["moe", "mlp"]
    assert ranks[0].moe.experts.gate_up_proj.shape == (3, 12, 8)  # before the split
    # all-reduce emulated: each reduced module returns the sum of both ranks' partials
    partial = {}
    for rank, (model, plan) in enumerate(zip(ranks, plans, strict=True)):
        apply_shards(model, plan, lambda t, rank=rank: t)
    assert ranks[1].moe.experts.gate_up_proj.shape == (3, 6, 8)
    assert ranks[1].mlp.down_proj.bias.abs().sum() == 0  # the bias is added by rank 0 only
    hidden = x
    for stage in ("moe", "mlp"):
        partial[stage] = [getattr(m, stage)(hidden) for m in ranks]
        hidden = partial[stage][0] + partial[stage][1]
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)


def test_checkpoint_slices_match_in_memory_slicing(toy):
    path, model = toy
    in_memory = copy.deepcopy(model)
    plan = plan_shards(in_memory, 1, 2)
    apply_shards(in_memory, plan, lambda t: t)
    from_file = load_model(path, trust_remote_code=True, read_weights=False, seed=99).model
    apply_shards(from_file, plan_shards(from_file, 1, 2), lambda t: t)
    read = load_sharded_checkpoint(from_file, sorted(path.glob("*.safetensors")), plan)
    whole = sum(p.numel() * 4 for p in model.parameters())
    assert 0 < read < whole  # only this rank's slices were read
    for name, param in in_memory.state_dict().items():
        torch.testing.assert_close(from_file.state_dict()[name], param, atol=0, rtol=0)

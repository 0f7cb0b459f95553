"""Recurrent states and windows under speculative decoding: the pieces a verify step uses
(the conv's state after every token, the 1 + next_n state blocks and their swap, the window
margin, what is refused), each on tiny inputs."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from kvskill.runtime import BlockPool, MambaManager, SlidingWindowManager
from kvskill.runtime.kv_cache_manager import KVCacheManager
from kvskill.runtime.mtp import mtp_tensor_pattern
from kvskill.runtime.ops import fla
from kvskill.runtime.speculative import speculation_refusal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_factories import Sink, attn_layer, mamba_layer, model_info  # noqa: E402


def test_conv_update_writes_the_state_after_every_token_into_its_line():
    torch.manual_seed(0)
    dim, width, lens = 3, 4, [3, 1]
    weight, bias = torch.randn(dim, width), torch.randn(dim)
    states = torch.randn(8, dim, width - 1)
    x = torch.randn(sum(lens), dim)
    # request 0 starts from line 1 and writes lines 1, 5, 6; request 1 from line 2 (pad -1)
    lines = torch.tensor([[1, 5, 6], [2, -1, -1]])
    got = states.clone()
    out = fla.causal_conv1d_update(
        x,
        got,
        weight,
        bias,
        "silu",
        conv_state_indices=lines,
        query_start_loc=torch.tensor([0, 3, 4]),
    )
    # the same tokens one at a time from a copy of each start line
    seq = states.clone()
    expected_out, after = [], {}
    for start, (a, b) in ((1, (0, 3)), (2, (3, 4))):
        for t in range(a, b):
            expected_out.append(
                fla.causal_conv1d_update(
                    x[t : t + 1],
                    seq,
                    weight,
                    bias,
                    "silu",
                    conv_state_indices=torch.tensor([start]),
                )
            )
            after[t] = seq[start].clone()
    torch.testing.assert_close(out, torch.cat(expected_out))
    for t, line in ((0, 1), (1, 5), (2, 6), (3, 2)):
        torch.testing.assert_close(got[line], after[t])
    untouched = [0, 3, 4, 7]
    torch.testing.assert_close(got[untouched], states[untouched])


def test_state_blocks_of_a_verify_step_and_the_swap_to_the_accepted_one():
    mgr = MambaManager(BlockPool(8), group_key="Mamba", block_size=1, next_n=2)
    mgr.allocate_new_blocks("a", 10)
    mgr.allocate_new_blocks("b", 10)
    a, b = mgr.get_block_ids("a"), mgr.get_block_ids("b")
    assert len(a) == len(b) == 3
    # ordinary steps see block 0 only; a verify step of 3 and 1 tokens sees them all
    tables = mgr.step_tables(["a", "b"], starts=[10, 10], num_new_tokens=[1, 1])
    assert tables.block_table.tolist() == [[a[0]], [b[0]]]
    assert mgr.verify_state_table(["a", "b"], [3, 1]).tolist() == [a, [b[0], -1, -1]]
    # two drafts accepted: the state after token 2 becomes the request's
    mgr.keep_state_after("a", 2)
    assert mgr.get_block_ids("a") == [a[2], a[1], a[0]]
    mgr.keep_state_after("b", 0)
    assert mgr.get_block_ids("b") == b
    mgr.free("a")
    mgr.free("b")
    assert mgr.block_pool.num_free_blocks == 7
    assert (
        MambaManager.max_blocks_per_request(
            block_size=1, sliding_window=None, max_num_batched_tokens=None, next_n=2
        )
        == 3
    )


def test_the_kv_manager_gives_state_groups_their_entries_next_n():
    sink = Sink()
    info = model_info([attn_layer(sink, 0), mamba_layer(sink, 1)])
    for _, entry in info.entries():
        if entry.attn_type == "Mamba":
            entry.next_n = 3
    manager = KVCacheManager(info, num_blocks=40)
    assert manager.managers["Mamba"].num_blocks_for(1) == 4
    assert manager.managers["FullAttention"].next_n == 0


def test_window_groups_keep_a_margin_of_two_next_n_tokens():
    sink = Sink()
    info = model_info([attn_layer(sink, 0, "SlidingWindow", sliding_window=8)])
    assert KVCacheManager(info, num_blocks=40, next_n=3).managers["SlidingWindow"].next_n == 3
    # one-token steps: ceil((8 - 1 + 6) / 4) + 1 blocks with the margin, 3 without
    bound = SlidingWindowManager.max_blocks_per_request
    assert bound(block_size=4, sliding_window=8, max_num_batched_tokens=1, next_n=3) == 5
    assert bound(block_size=4, sliding_window=8, max_num_batched_tokens=1) == 3


def test_what_speculation_serves_and_refuses():
    groups = {"FullAttention": "FullAttention", "Mamba": "Mamba", "SlidingWindow": "SlidingWindow"}
    assert speculation_refusal(groups) is None
    refusal = speculation_refusal(groups, ["model.layers.0.mamba", "model.layers.2.mamba"])
    assert "model.layers.0.mamba (and 1 more) keeps one state per request" in refusal
    assert "Legacy" in speculation_refusal({"Legacy": "Legacy"})


def test_qwen3_next_mtp_tensors_are_set_aside_by_the_loader():
    class Config:
        num_hidden_layers = 4
        mtp_num_hidden_layers = 1

    pattern = mtp_tensor_pattern(Config())
    for key in (
        "mtp.fc.weight",
        "mtp.layers.0.self_attn.q_proj.weight",
        "model.layers.4.enorm.weight",
    ):
        assert pattern.match(key), key
    assert not pattern.match("model.layers.3.linear_attn.A_log")

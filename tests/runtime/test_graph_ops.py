"""The reference operators as registered custom operators: fake shapes equal the eager ones,
and a compiled caller captures them as single nodes that still write in place."""

from __future__ import annotations

import pytest
import torch
from kvskill.runtime.ops import reference as ref
from torch._subclasses.fake_tensor import FakeTensorMode

ops = torch.ops.kvskill


def _fake_and_real(op, *args, **kwargs):
    """(eager outputs, fake outputs) of one registered operator on the same inputs."""
    real = op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = op(*fake_args, **kwargs)
    return real, fake


def _same_meta(real, fake) -> None:
    real = real if isinstance(real, tuple) else (real,)
    fake = fake if isinstance(fake, tuple) else (fake,)
    assert len(real) == len(fake)
    for r, f in zip(real, fake, strict=True):
        assert tuple(r.shape) == tuple(f.shape)
        assert r.dtype == f.dtype


def _paged_decode_inputs(heads=4, kv_heads=2, dim=16, block=4, lens=(5, 9, 1)):
    torch.manual_seed(0)
    num_blocks = 12
    table = torch.tensor([[3, 7, 0], [1, 5, 9], [11, 0, 0]], dtype=torch.int32)
    cache_k = torch.randn(num_blocks, block, kv_heads * dim)
    cache_v = torch.randn(num_blocks, block, kv_heads * dim)
    query = torch.randn(len(lens), heads, dim)
    return query, cache_k, cache_v, table, list(lens)


_ATTEND_DEFAULTS = dict(
    query_rope=None,
    key_rope=None,
    pse_shift=None,
    atten_mask=None,
    q_lens_tensor=None,
    kv_lens_tensor=None,
    learnable_sink=None,
    pre_tokens=2147483647,
    next_tokens=2147483647,
    inner_precise=0,
)


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_attention_fake_matches_eager_in_paged_tnd_decode(version, return_lse):
    query, k, v, table, lens = _paged_decode_inputs()
    real, fake = _fake_and_real(
        ops.fused_infer_attention,
        query,
        k,
        v,
        q_lens=[1, 2, 3],
        kv_lens=lens,
        block_table=table,
        num_heads=4,
        num_key_value_heads=2,
        scale=0.25,
        input_layout="TND",
        sparse_mode=0,
        block_size=4,
        return_lse=return_lse,
        version=version,
        **_ATTEND_DEFAULTS,
    )
    _same_meta(real, fake)
    assert real[0].shape == (3, 4, 16)
    # the operator equals the public function it backs
    public = ref.npu_fused_infer_attention_score(
        query,
        k,
        v,
        actual_seq_lengths=[1, 2, 3],
        actual_seq_lengths_kv=lens,
        block_table=table,
        num_heads=4,
        num_key_value_heads=2,
        scale=0.25,
        input_layout="TND",
        block_size=4,
        softmax_lse_flag=return_lse,
    )
    torch.testing.assert_close(real[0], public[0], rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["BSH", "BNSD", "BSND_NBSD"])
def test_attention_fake_matches_eager_in_dense_layouts(layout):
    torch.manual_seed(1)
    b, n, s, kv_s, d = 2, 4, 3, 5, 8
    shapes = {"BSH": ((b, s, n * d), (b, kv_s, n * d)), "BNSD": ((b, n, s, d), (b, n, kv_s, d))}
    shapes["BSND_NBSD"] = ((b, s, n, d), (b, kv_s, n, d))
    q_shape, kv_shape = shapes[layout]
    real, fake = _fake_and_real(
        ops.fused_infer_attention,
        torch.randn(q_shape),
        torch.randn(kv_shape),
        torch.randn(kv_shape),
        q_lens=None,
        kv_lens=None,
        block_table=None,
        num_heads=n,
        num_key_value_heads=0,
        scale=1.0,
        input_layout=layout,
        sparse_mode=0,
        block_size=0,
        return_lse=True,
        version="v1",
        **_ATTEND_DEFAULTS,
    )
    _same_meta(real, fake)


def test_elementwise_and_norm_fakes_match_eager():
    torch.manual_seed(2)
    x = torch.randn(2, 3, 4, 8)
    cos, sin = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    gamma = torch.randn(8)
    cases = [
        (ops.rotary_mul, (x, cos, sin), {}),
        (ops.interleave_rope, (x, cos, sin), {}),
        (ops.rms_norm, (x, gamma), {}),
        (ops.add_rms_norm, (x, x, gamma), {}),
        (ops.swiglu, (x,), {"dim": -1}),
    ]
    for op, args, kwargs in cases:
        _same_meta(*_fake_and_real(op, *args, **kwargs))


def test_kv_rmsnorm_rope_cache_fake_matches_eager():
    torch.manual_seed(3)
    b, s, dc, blocks, block = 3, 1, 32, 4, 4
    kv = torch.randn(b, 1, s, dc + 64)
    cos, sin = torch.randn(b, 1, s, 64), torch.randn(b, 1, s, 64)
    k_cache, ckv_cache = torch.zeros(blocks, block, 1, 64), torch.zeros(blocks, block, 1, dc)
    args = (kv, torch.ones(dc), cos, sin, torch.tensor([0, 5, 9]), k_cache, ckv_cache)
    real, fake = _fake_and_real(ops.kv_rmsnorm_rope_cache, *args, None, None, 1e-5, "PA", True)
    _same_meta(real, fake)


def test_compiled_caller_writes_the_cache_through_the_registered_scatter():
    cache = torch.zeros(8, 2, 4)
    slots = torch.tensor([5, 1, 6])
    rows = torch.randn(3, 2, 4)

    def write(cache, slots, rows):
        ref.npu_scatter_nd_update_(cache, slots.view(-1, 1), rows)
        return cache.sum()

    expected = cache.clone()
    expected[slots] = rows
    compiled = torch.compile(write, backend="eager", fullgraph=True)
    total = compiled(cache, slots, rows)
    torch.testing.assert_close(cache, expected)
    torch.testing.assert_close(total, expected.sum())


def test_compiled_attention_is_one_node_with_lengths_from_a_tensor():
    query, k, v, table, lens = _paged_decode_inputs()
    kv_lens = torch.tensor(lens)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    def attend(query, k, v, table, kv_lens):
        out, _ = ref.npu_fused_infer_attention_score(
            query,
            k,
            v,
            actual_seq_lengths=[1, 2, 3],
            actual_seq_lengths_kv=kv_lens,
            block_table=table,
            num_heads=4,
            num_key_value_heads=2,
            scale=0.25,
            input_layout="TND",
            block_size=4,
        )
        return out

    compiled = torch.compile(attend, backend=backend, fullgraph=True)
    torch.testing.assert_close(
        compiled(query, k, v, table, kv_lens), attend(query, k, v, table, kv_lens)
    )
    calls = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    # the operator, and the pick of its first output
    assert calls == ["kvskill.fused_infer_attention.default", "<built-in function getitem>"]


def test_state_update_fakes_match_eager_and_write_the_states():
    from kvskill.runtime.ops import fla_graph_ops

    torch.manual_seed(4)
    dim, width, lines = 6, 4, 5
    x, weight = torch.randn(2, dim), torch.randn(dim, width)
    conv_state = torch.randn(lines, dim, width - 1)
    indices = torch.tensor([3, 1])
    before = conv_state.clone()
    real, fake = _fake_and_real(
        ops.causal_conv1d_update, x, conv_state, weight, None, "silu", indices, None, -1
    )
    _same_meta(real, fake)
    # the operator writes the state it declares (the helper ran it on a clone: run it here)
    ops.causal_conv1d_update(x, conv_state, weight, None, "silu", indices, None, -1)
    assert not torch.equal(conv_state[3], before[3]) and torch.equal(conv_state[0], before[0])

    q, k = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    v, g = torch.randn(1, 2, 4, 3), -torch.rand(1, 2, 4)
    state = torch.randn(lines, 4, 4, 3)
    args = (q, k, v, g, None, None, state, torch.tensor([0, 1, 2]), indices, True)
    _same_meta(*_fake_and_real(fla_graph_ops.RECURRENT_OP, *args))


def test_packed_conv_update_compiles_to_one_node_and_matches_eager():
    """The converted gated-delta and KDA layers pass their decode tokens packed, with
    ``query_start_loc``: under capture that call is the registered operator (the reference
    reads the offsets on the host, which a traced step cannot), with eager's result and
    state."""
    from kvskill.runtime.ops import fla_graph_ops, fla_reference

    torch.manual_seed(5)
    dim, width, lines = 6, 4, 5
    x, weight = torch.randn(3, dim), torch.randn(dim, width)
    indices, starts = torch.tensor([4, 0, 2]), torch.tensor([0, 1, 2, 3])
    state = torch.randn(lines, dim, width - 1)
    expected_state = state.clone()
    expected = fla_reference.causal_conv1d_update(
        x, expected_state, weight, None, "silu", conv_state_indices=indices, query_start_loc=starts
    )
    graphs = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm

    def step(x, state, indices, starts):
        return fla_graph_ops.conv_update(
            x, state, weight, None, "silu", conv_state_indices=indices, query_start_loc=starts
        )

    out = torch.compile(step, backend=backend, fullgraph=True)(x, state, indices, starts)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(state, expected_state)
    calls = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert calls == ["kvskill.causal_conv1d_update.default"]


def test_selective_state_update_fake_matches_eager():
    torch.manual_seed(5)
    dim, dstate, lines = 6, 4, 3
    state = torch.randn(lines, dim, dstate)
    x, dt, z = torch.randn(2, dim), torch.rand(2, dim), torch.randn(2, dim)
    a, b, c = -torch.rand(dim, dstate), torch.randn(2, dstate), torch.randn(2, dstate)
    args = (state, x, dt, a, b, c, None, z, None, True, torch.tensor([2, 0]), None, -1)
    _same_meta(*_fake_and_real(ops.selective_state_update_, *args))


def _paged_dsa_decode_inputs():
    """A DSA decode step of three requests (kv lengths 7, 10, 3) at toy size: indexer query,
    paged keys and weights; latent / rope query and caches (PA_BSND, block size 4)."""
    g = torch.Generator().manual_seed(7)
    table = torch.tensor([[5, 2, 0], [1, 6, 3], [4, 0, 0]], dtype=torch.int32)
    kv_lens = torch.tensor([7, 10, 3], dtype=torch.int32)
    cu_q = torch.tensor([1, 2, 3], dtype=torch.int32)
    index_q, index_k = torch.randn(3, 2, 8, generator=g), torch.randn(8, 4, 1, 8, generator=g)
    weights = torch.randn(3, 2, generator=g)
    query, rope = torch.randn(3, 4, 16, generator=g), torch.randn(3, 4, 4, generator=g)
    latent, rope_cache = torch.randn(8, 4, 1, 16, generator=g), torch.randn(8, 4, 1, 4, generator=g)
    return index_q, index_k, weights, query, rope, latent, rope_cache, table, cu_q, kv_lens


def _dsa_step(index_q, index_k, weights, query, rope, latent, rope_cache, table, cu_q, kv_lens):
    """The converted DSA decode: the indexer's top-4 positions, then attention over them."""
    paged = dict(block_table=table, actual_seq_lengths_query=cu_q, layout_query="TND")
    top, _ = ref.npu_lightning_indexer(
        index_q, index_k, weights, actual_seq_lengths_key=kv_lens, layout_key="PA_BSND",
        sparse_count=4, sparse_mode=3, **paged,
    )  # fmt: skip
    out, _, _ = ref.npu_sparse_flash_attention(
        query, latent, latent, top, 0.25, actual_seq_lengths_kv=kv_lens, query_rope=rope,
        key_rope=rope_cache, layout_kv="PA_BSND", sparse_mode=3, attention_mode=2, **paged,
    )  # fmt: skip
    return top, out


def test_dsa_operator_fakes_match_eager():
    index_q, index_k, weights, query, rope, latent, rope_cache, table, cu_q, kv_lens = (
        _paged_dsa_decode_inputs()
    )
    paged = dict(
        block_table=table, actual_seq_lengths_query=cu_q, layout_query="TND", sparse_mode=3
    )
    indexer = _fake_and_real(
        ops.lightning_indexer, index_q, index_k, weights, actual_seq_lengths_key=kv_lens,
        layout_key="PA_BSND", sparse_count=4, **paged,
    )  # fmt: skip
    _same_meta(*indexer)
    top = indexer[0][0]
    assert tuple(top.shape) == (3, 1, 4) and top.dtype == torch.int32
    attention = dict(attention_mode=2, query_rope=rope, key_rope=rope_cache)
    _same_meta(
        *_fake_and_real(
            ops.sparse_flash_attention, query, latent, latent, top, 0.25,
            actual_seq_lengths_kv=kv_lens, layout_kv="PA_BSND", **paged, **attention,
        )
    )  # fmt: skip
    # softmax max / sum [B, KV_N, S1, G] (BSND keys: A2/A3 refuse the lse with PA_BSND)
    attention.update(query_rope=rope.unsqueeze(1), key_rope=rope_cache[:3])
    real, fake = _fake_and_real(
        ops.sparse_flash_attention, query.unsqueeze(1), latent[:3], latent[:3], top.unsqueeze(1),
        0.25, return_softmax_lse=True, **attention,
    )  # fmt: skip
    _same_meta(real, fake)
    assert tuple(fake[1].shape) == (3, 1, 1, 4)


def test_compiled_dsa_step_is_two_operator_nodes_and_matches_eager():
    inputs = _paged_dsa_decode_inputs()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(_dsa_step, backend=backend, fullgraph=True)
    top, out = compiled(*inputs)
    eager_top, eager_out = _dsa_step(*inputs)
    assert torch.equal(top, eager_top)
    torch.testing.assert_close(out, eager_out)
    # the selection keeps 4 of 7 and 10 keys: it decides those rows
    assert (top[:2] >= 0).sum() == 8
    calls = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert [c for c in calls if "getitem" not in c] == [
        "kvskill.lightning_indexer.default",
        "kvskill.sparse_flash_attention.default",
    ]

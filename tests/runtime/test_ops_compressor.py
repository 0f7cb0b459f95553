"""custom.compressor against per-token loops: softmax-gated pooling of every cmp_ratio tokens
(overlapping for ratio 4), RMSNorm and RoPE, with the unfinished window carried across calls in
a paged fp32 state (shuffled block table), and its documented limits."""

from __future__ import annotations

import math

import pytest
import torch
from kvskill.runtime.ops.npu_standin import npu_standin
from kvskill.runtime.ops.reference import OpInputError
from kvskill.runtime.ops.reference.custom import compressor
from kvskill.runtime.ops.reference.npu_profile import npu_limits

I32 = torch.int32
HIDDEN, DIM, ROPE = 12, 16, 8
EPS = 1e-6


class Layer:
    """One compressor's weights plus a cos/sin row per entry position (random: the test checks
    the rotation formula, not the angles)."""

    def __init__(self, ratio, coff, seed, entries=8):
        g = torch.Generator().manual_seed(seed)
        self.ratio, self.coff = ratio, coff
        self.wkv = torch.randn(coff * DIM, HIDDEN, generator=g) / 3
        self.wgate = torch.randn(coff * DIM, HIDDEN, generator=g)
        self.ape = torch.randn(ratio, coff * DIM, generator=g)
        self.norm = torch.rand(DIM, generator=g) + 0.5
        self.cos = torch.rand(entries, ROPE, generator=g)
        self.sin = torch.rand(entries, ROPE, generator=g)

    def naive(self, x):
        """Every finished window of one request's tokens x [N, H], loops per token and feature."""
        r, d = self.ratio, DIM
        kv = [self.wkv.double() @ x[p].double() for p in range(x.size(0))]
        score = [self.wgate.double() @ x[p].double() + self.ape[p % r].double() for p in range(x.size(0))]  # fmt: skip
        rows = []
        for w in range(x.size(0) // r):
            slots = []  # (kv, score) pairs of D features
            if self.coff == 2 and w > 0:
                slots += [(kv[p][:d], score[p][:d]) for p in range((w - 1) * r, w * r)]
            lo = d if self.coff == 2 else 0
            slots += [(kv[p][lo : lo + d], score[p][lo : lo + d]) for p in range(w * r, (w + 1) * r)]  # fmt: skip
            c = torch.zeros(d, dtype=torch.float64)
            for f in range(d):
                top = max(float(s[f]) for _, s in slots)
                weights = [math.exp(float(s[f]) - top) for _, s in slots]
                c[f] = sum(wt * float(k[f]) for wt, (k, _) in zip(weights, slots, strict=True)) / sum(weights)  # fmt: skip
            c = self.norm.double() * c / math.sqrt(float((c * c).mean()) + EPS)
            out = c.clone()
            for i in range(ROPE // 2):  # interleaved pairs of the trailing ROPE features
                a, b = d - ROPE + 2 * i, d - ROPE + 2 * i + 1
                cos, sin = self.cos[w].double(), self.sin[w].double()
                out[a] = c[a] * cos[2 * i] - c[b] * sin[2 * i]
                out[b] = c[b] * cos[2 * i + 1] + c[a] * sin[2 * i + 1]
            rows.append(out)
        return torch.stack(rows) if rows else torch.zeros(0, d, dtype=torch.float64)

    def call(self, x, state, table, starts, lengths, packed, op=compressor, seqused=None):
        """One compressor call; cos/sin rows are those of the entries it will finish."""
        r = self.ratio
        finished = [range(s // r, (s + n) // r) for s, n in zip(starts, lengths, strict=True)]
        if packed:
            t = x.size(0)
            width = min(t, t // r + len(lengths))
            cos, sin = torch.zeros(width, ROPE), torch.zeros(width, ROPE)
            ws = [w for f in finished for w in f]
            cos[: len(ws)], sin[: len(ws)] = self.cos[ws], self.sin[ws]
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=I32)
        else:
            width = -(-x.size(1) // r)
            cos, sin = torch.zeros(len(lengths), width, ROPE), torch.zeros(len(lengths), width, ROPE)  # fmt: skip
            for b, f in enumerate(finished):
                cos[b, : len(f)], sin[b, : len(f)] = self.cos[list(f)], self.sin[list(f)]
            cu = None
        return op(
            x, self.wkv, self.wgate, state, self.ape, self.norm, sin, cos, ROPE, r,
            state_block_table=table, cu_seqlens=cu, seqused=seqused,
            start_pos=torch.tensor(starts, dtype=I32), coff=self.coff, norm_eps=EPS,
            rotary_mode=2,
        )  # fmt: skip


def state_for(layer, batch, tokens, block_size=16, seed=0):
    """A paged fp32 state with shuffled block ids from 1 (0 marks "no state")."""
    per = -(-tokens // block_size)
    ids = torch.randperm(batch * per, generator=torch.Generator().manual_seed(seed)) + 1
    state = torch.randn(batch * per + 1, block_size, 2 * layer.coff * DIM)  # noise until written
    return state, ids.view(batch, per).to(I32)


def test_ratio_4_overlapping_windows_across_a_packed_prefill_and_decode_steps():
    layer = Layer(4, 2, seed=0)
    x = torch.randn(2, 16, HIDDEN)  # two requests' whole token streams
    state, table = state_for(layer, 2, 16, seed=1)
    # prefill: 10 and 7 tokens packed (TND); then one decode token per request per step
    prefill = layer.call(torch.cat([x[0, :10], x[1, :7]]), state, table, [0, 0], [10, 7], True)
    assert prefill.shape == (min(17, 17 // 4 + 2), DIM)  # doc: [min(T, T//r + B), D]
    got = [[prefill[:2]], [prefill[2:3]]]  # 10 tokens finish entries 0, 1; 7 tokens entry 0
    assert bool((prefill[3:] == 0).all())
    starts = [10, 7]
    for _ in range(6):
        step = torch.stack([x[0, starts[0]], x[1, starts[1]]]).unsqueeze(1)  # [B, 1, H]
        out = layer.call(step, state, table, starts, [1, 1], False)
        assert out.shape == (2, 1, DIM)
        for b in range(2):
            if (starts[b] + 1) % 4 == 0:
                got[b].append(out[b])
            else:
                assert bool((out[b] == 0).all())
        starts = [s + 1 for s in starts]
    for b, n in enumerate(starts):
        want = layer.naive(x[b, :n])
        assert (torch.cat(got[b]).double() - want).abs().max() < 1e-5


def test_ratio_128_through_the_dispatcher_with_a_multi_token_decode():
    layer = Layer(128, 1, seed=2)
    x = torch.randn(260, HIDDEN)
    state, table = state_for(layer, 1, 260, seed=3)
    before = state.clone()
    with npu_standin():
        import custom_ops  # noqa: F401

        op = torch.ops.custom.compressor
        first = layer.call(x[:130], state, table, [0], [130], True, op=op)
        assert not torch.equal(state, before)  # the in-place state write reached the caller
        second = layer.call(x[130:256].unsqueeze(0), state, table, [130], [126], False, op=op)
    assert first.shape == (2, DIM) and second.shape == (1, 1, DIM)
    want = layer.naive(x[:256])
    assert (first[0].double() - want[0]).abs().max() < 1e-5
    assert (second[0, 0].double() - want[1]).abs().max() < 1e-5


def test_seqused_and_block_zero_leave_the_state_alone():
    layer = Layer(4, 2, seed=4)
    state, table = state_for(layer, 1, 16, seed=5)
    before = state.clone()
    out = layer.call(torch.randn(1, 4, HIDDEN), state, table, [0], [4], False,
                     seqused=torch.tensor([0], dtype=I32))  # fmt: skip
    assert bool((out == 0).all()) and torch.equal(state, before)
    table[0, 0] = 0  # the doc's "no update" entry
    layer.call(torch.randn(1, 3, HIDDEN), state, table, [0], [3], False)
    assert torch.equal(state, before)
    with pytest.raises(OpInputError, match="state position 0 is needed but its .* entry is 0"):
        layer.call(torch.randn(1, 1, HIDDEN), state, table, [3], [1], False)


def _call(**change):
    layer = Layer(4, 2, seed=6)
    state, table = state_for(layer, 1, 16, seed=7)
    args = dict(
        x=torch.randn(1, 4, HIDDEN), wkv=layer.wkv, wgate=layer.wgate, state_cache=state,
        ape=layer.ape, norm_weight=layer.norm, rope_sin=torch.zeros(1, 1, ROPE),
        rope_cos=torch.zeros(1, 1, ROPE), rope_head_dim=ROPE, cmp_ratio=4,
        state_block_table=table, coff=2, rotary_mode=2,
    )  # fmt: skip
    args.update(change)
    return compressor(**args)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"coff": 1}, "cmp_ratio 4 takes coff 2"),
        ({"cmp_ratio": 16}, r"cmp_ratio must be one of \[4, 128\]"),
        ({"cache_mode": 2}, "cache_mode takes only 1"),
        ({"state_cache": torch.zeros(2, 16, 4 * DIM, dtype=torch.bfloat16)}, "must be float32"),
        ({"ape": torch.zeros(4, DIM)}, r"`ape` must be \[4, 32\]"),
        ({"rope_sin": torch.zeros(1, 2, ROPE)}, r"`rope_sin` must be float32 of shape \[1, 1, 8\]"),
        ({"cu_seqlens": torch.tensor([0, 4], dtype=I32)}, "cu_seqlens must be None"),
        ({"seqused": torch.tensor([5], dtype=I32)}, r"seqused\[0\]=5 must be in \[0, 4\]"),
        ({"state_block_table": torch.tensor([[99]], dtype=I32)}, "names block 99"),
        ({"state_block_table": None}, "state_block_table is required"),
    ],
)
def test_documented_limits_are_refused_in_one_line(change, message):
    with pytest.raises(OpInputError, match=message):
        _call(**change)


def test_hardware_limits_hold_under_the_npu_profile():
    with npu_limits(), pytest.raises(OpInputError, match=r"\(D, coff, cmp_ratio\) must be one of"):
        _call(x=torch.randn(1, 4, HIDDEN).bfloat16(), wkv=torch.zeros(32, HIDDEN).bfloat16(),
              wgate=torch.zeros(32, HIDDEN).bfloat16())  # fmt: skip


def test_the_fake_gives_the_documented_output_shapes():
    meta = {"device": "meta"}
    layer = Layer(4, 2, seed=8)
    with npu_standin():
        out = torch.ops.custom.compressor(
            torch.empty(9, HIDDEN, **meta), layer.wkv.to("meta"), layer.wgate.to("meta"),
            torch.empty(3, 16, 4 * DIM, **meta), layer.ape.to("meta"), layer.norm.to("meta"),
            torch.empty(4, ROPE, **meta), torch.empty(4, ROPE, **meta), ROPE, 4,
            state_block_table=torch.empty(2, 1, dtype=I32, **meta),
            cu_seqlens=torch.empty(3, dtype=I32, **meta), coff=2,
        )  # fmt: skip
    assert out.shape == (min(9, 9 // 4 + 2), DIM) and out.device.type == "meta"


@pytest.mark.parametrize(
    ("kind", "ratio", "coff", "tokens"), [("HCA", 128, 1, 300), ("CSA", 4, 2, 23)]
)
def test_matches_the_pooling_of_transformers_deepseek_v4_compressors(kind, ratio, coff, tokens):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    config = DeepseekV4Config(
        hidden_size=32, head_dim=32, num_attention_heads=2, num_hidden_layers=2, q_lora_rank=8,
        o_lora_rank=8, o_groups=1, index_n_heads=2, index_head_dim=16, index_topk=4,
        sliding_window=8, vocab_size=50,
    )  # fmt: skip
    torch.manual_seed(5)
    cls = v4.DeepseekV4HCACompressor if kind == "HCA" else v4.DeepseekV4CSACompressor
    module = cls(config).float()
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(1, tokens, 32)
    with torch.no_grad():  # stateless: every finished window of the prompt
        want = module(x, torch.randn(1, tokens, 8), torch.arange(tokens)[None], None, 0)[0][0, 0]
    entries = want.size(0)
    positions = (torch.arange(entries) * ratio)[None]  # transformers' entry positions
    cos, sin = module.rotary_emb(want, position_ids=positions, layer_type="compress")
    rope = 2 * cos.size(-1)
    width = min(tokens, tokens // ratio + 1)
    rope_cos, rope_sin = torch.zeros(width, rope), torch.zeros(width, rope)
    rope_cos[:entries] = cos[0].repeat_interleave(2, -1)
    rope_sin[:entries] = sin[0].repeat_interleave(2, -1)
    blocks = -(-tokens // 16)
    got = compressor(
        x[0], module.kv_proj.weight, module.gate_proj.weight,
        torch.zeros(blocks + 1, 16, 2 * coff * 32), module.position_bias, module.kv_norm.weight,
        rope_sin, rope_cos, rope, ratio,
        state_block_table=torch.arange(1, blocks + 1, dtype=I32)[None],
        cu_seqlens=torch.tensor([0, tokens], dtype=I32), coff=coff,
        norm_eps=config.rms_norm_eps, rotary_mode=2,
    )  # fmt: skip
    assert entries == tokens // ratio
    assert (got[:entries] - want).abs().max() < 1e-5

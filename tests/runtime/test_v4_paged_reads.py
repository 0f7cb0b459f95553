"""DeepSeek-V4's attention reads on the paged operators, against transformers' own layer.

A CSA layer and an HCA layer of a tiny transformers DeepSeek-V4 run a prompt; what reaches its
eager attention (the query, the window rows, the compressed entries, the indexer's inputs) is
captured and put into paged caches with shuffled block tables. Then:

- the CSA top-k comes from the wheel's ``npu_lightning_indexer`` with one batch row per query
  token, whose key length is the entries that token may read, ``(p + 1) // ratio``: the
  operator has no ``cmp_ratio``, and this gives every row its own causal limit;
- ``custom.npu_sparse_attn_sharedkv`` attends the window, the selected (CSA) or all (HCA)
  compressed entries and the sinks in one softmax, for two requests in one call: the whole
  prompt, and its last 3 tokens as a chunk after a cached prefix.

Both must give transformers' attention output; attending all CSA entries instead of the
selection must not (the prompt is longer than top-k x ratio, so the indexer drops entries).
The compressor is checked on its own: ``custom.compressor`` over paged fp32 state rows, called
once per chunk of a prompt (prefill, decodes, chunked prefill), gives the entries transformers'
compressor and CSA indexer keep in their cache layer across calls.
"""

from __future__ import annotations

import pytest
import torch
from kvskill.runtime.ops.reference.custom import register_custom_operators
from kvskill.runtime.ops.reference.lightning_indexer import npu_lightning_indexer
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

BLOCK = 16
WINDOW = 128  # the attention operator's only window (ori_win_left 127)
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def _config(layer_type: str) -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, head_dim=32,
        partial_rotary_factor=0.5, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        index_n_heads=8, index_head_dim=16, index_topk=4, sliding_window=WINDOW,
        layer_types=[layer_type], mlp_layer_types=["moe"],
    )  # fmt: skip


def _captured_layer(layer_type: str, tokens: int):
    """Run transformers' attention on TOKENS positions; keep what its softmax and indexer saw."""
    torch.manual_seed(0)
    config = _config(layer_type)
    config._attn_implementation = "eager"
    model = v4.DeepseekV4Model(config).float().eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    attention = model.layers[0].self_attn
    hidden = torch.randn(1, tokens, config.hidden_size)
    positions = torch.arange(tokens).unsqueeze(0)
    seen: dict[str, torch.Tensor] = {}

    def eager(module, query, key, value, mask, **kwargs):
        seen.update(query=query, kv=key, mask=mask)
        out, weights = v4.eager_attention_forward(module, query, key, value, mask, **kwargs)
        seen["out"] = out
        return out, weights

    def scorer_inputs(_module, args):
        seen.update(index_q=args[0], index_k=args[1], index_hidden=args[2])

    if layer_type == CSA:
        attention.compressor.indexer.scorer.register_forward_pre_hook(scorer_inputs)
    rows = torch.arange(tokens)
    band = (rows[None, :] <= rows[:, None]) & (rows[None, :] > rows[:, None] - WINDOW)
    mask = torch.zeros(tokens, tokens).masked_fill(~band, float("-inf"))[None, None]
    embeddings = {
        kind: model.rotary_emb(hidden, position_ids=positions, layer_type=kind)
        for kind in ("main", "compress")
    }
    original = v4.ALL_ATTENTION_FUNCTIONS.get_interface
    v4.ALL_ATTENTION_FUNCTIONS.get_interface = lambda *_a, **_k: eager
    try:
        with torch.no_grad():
            attention(hidden, embeddings, positions, mask)
    finally:
        v4.ALL_ATTENTION_FUNCTIONS.get_interface = original
    return config, attention, seen


def _paged(rows: torch.Tensor, block_rows: int, generator: torch.Generator, copies: int = 1):
    """COPIES requests holding ROWS [n, D] each, in shuffled blocks of BLOCK_ROWS rows of one
    cache: (cache [blocks, rows, 1, D], table [copies, blocks per request])."""
    per = max(1, -(-rows.size(0) // block_rows))
    order = torch.randperm(copies * per + 3, generator=generator)[: copies * per]
    cache = torch.randn(copies * per + 3, block_rows, 1, rows.size(-1), generator=generator)
    for i, block in enumerate(order.tolist()):
        chunk = rows[(i % per) * block_rows : (i % per + 1) * block_rows]
        cache[block, : chunk.size(0), 0] = chunk
    return cache, order.to(torch.int32).view(copies, per)


def _csa_selection(config, attention, seen, generator) -> torch.Tensor:
    """Top-k per query token from npu_lightning_indexer, one batch row per token."""
    ratio = config.compress_rates[CSA]
    q = seen["index_q"][0]  # [S, H, D]
    keys = seen["index_k"][0]  # [E, D]
    tokens = q.size(0)
    scorer = attention.compressor.indexer.scorer
    weights = scorer.weights_proj(seen["index_hidden"][0]) * (
        scorer.weights_scaling * scorer.softmax_scale
    )  # relu(c x) = c relu(x): both positive scales go into the weights
    cache, table = _paged(keys, BLOCK // ratio, generator)
    visible = (torch.arange(tokens) + 1) // ratio  # entries each token may read
    indices, _ = npu_lightning_indexer(
        q.contiguous(),
        cache,
        weights.float(),
        actual_seq_lengths_query=torch.arange(1, tokens + 1, dtype=torch.int32),
        actual_seq_lengths_key=visible.to(torch.int32),
        block_table=table.expand(tokens, -1).contiguous(),
        layout_query="TND",
        layout_key="PA_BSND",
        sparse_count=config.index_topk,
        sparse_mode=3,
    )
    return indices  # [S, 1, top-k], -1 after the candidates


def _sharedkv(config, attention, seen, generator, selection, *, all_entries=False, tail=3):
    """Two requests in one call over the same history: request 0 the whole prompt (a
    prefill), request 1 its last TAIL tokens only (a chunk after a prefix): [S + TAIL, N, D]."""
    q = seen["query"][0].transpose(0, 1).contiguous()  # [S, N, D]
    tokens = q.size(0)
    kv = seen["kv"][0, 0]  # [S + E, D]: window rows, then the compressed entries
    ratio = config.compress_rates[config.layer_types[0]]
    window, cmp = kv[:tokens], kv[tokens:]
    ori_kv, ori_table = _paged(window, BLOCK, generator, copies=2)
    cmp_kv, cmp_table = _paged(cmp, BLOCK // ratio if ratio < BLOCK else 1, generator, copies=2)
    indices = None
    if not all_entries and selection is not None:
        indices = torch.cat([selection, selection[-tail:]]).contiguous()
    q = torch.cat([q, q[-tail:]])
    cu_q = torch.tensor([0, tokens, tokens + tail], dtype=torch.int32)
    used = torch.tensor([tokens, tokens], dtype=torch.int32)
    metadata = torch.ops.custom.npu_sparse_attn_sharedkv_metadata(
        q.size(1), 1, q.size(2), cu_seqlens_q=cu_q, seqused_kv=used, batch_size=2,
        max_seqlen_q=tokens, max_seqlen_kv=tokens,
        cmp_topk=indices.size(-1) if indices is not None else 0, cmp_ratio=ratio,
        layout_q="TND", has_ori_kv=True, has_cmp_kv=True, device="cpu",
    )  # fmt: skip
    out, _ = torch.ops.custom.npu_sparse_attn_sharedkv(
        q, ori_kv=ori_kv, cmp_kv=cmp_kv, cmp_sparse_indices=indices, ori_block_table=ori_table,
        cmp_block_table=cmp_table, cu_seqlens_q=cu_q, seqused_kv=used, sinks=attention.sinks,
        metadata=metadata, softmax_scale=attention.scaling, cmp_ratio=ratio, layout_q="TND",
        layout_kv="PA_ND",
    )  # fmt: skip
    return out


@pytest.mark.parametrize(("layer_type", "tokens"), [(CSA, 150), (HCA, 300)])
@torch.no_grad()  # inference, as the runtime runs it
def test_paged_reads_give_transformers_attention(layer_type, tokens):
    register_custom_operators()  # torch.ops.custom.*, as the stand-in's custom_ops does
    config, attention, seen = _captured_layer(layer_type, tokens)
    generator = torch.Generator().manual_seed(1)
    expected = seen["out"][0]  # [S, N, D], before the output's inverse rope
    ratio = config.compress_rates[layer_type]
    assert seen["kv"].size(2) == tokens + tokens // ratio  # window rows + compressed entries
    selection = None
    if layer_type == CSA:
        selection = _csa_selection(config, attention, seen, generator)
        assert selection.shape == (tokens, 1, config.index_topk)
        # the indexer drops entries: the last token may read tokens // ratio > top-k of them
        assert tokens // ratio > config.index_topk
        # the same selection as transformers' block bias (entries it left at 0)
        chosen = [set(r[r >= 0].tolist()) for r in selection[:, 0]]
        bias = seen["mask"][0, 0, :, tokens:]
        assert chosen == [set(torch.nonzero(b == 0).flatten().tolist()) for b in bias]
    got = _sharedkv(config, attention, seen, generator, selection)
    # the chunk's rows sit at the prompt's last positions (p = seqused_kv - S + i)
    expected = torch.cat([expected, expected[-3:]])
    diff = (got - expected).abs().max().item()
    assert diff < 1e-5, diff
    if layer_type == CSA:
        every = _sharedkv(config, attention, seen, generator, selection, all_entries=True)
        assert (every - expected).abs().max().item() > 1e-2


class _OneLayerCache:
    """What transformers' compressors read from a cache: ``cache.layers[layer_idx]``."""

    def __init__(self, layer) -> None:
        self.layers = [layer]


def _op_entries(module, config, chunks, hidden, generator) -> torch.Tensor:
    """custom.compressor over the CHUNKS of HIDDEN one call each (a prefill, decodes, a chunked
    prefill), its state in paged fp32 rows with a shuffled table: every entry, in order."""
    ratio, coff = module.compress_rate, module.kv_proj.weight.size(0) // module.head_dim
    dim = module.head_dim
    rope = config.qk_rope_head_dim
    blocks = -(-hidden.size(0) // BLOCK)
    # block 0 is the operator's "no state here" (the runtime's null block): never a real block
    table = (torch.randperm(blocks, generator=generator) + 1).to(torch.int32).unsqueeze(0)
    state = torch.zeros(blocks + 1, BLOCK, 2 * coff * dim)
    entries, start = [], 0
    for n in chunks:
        x = hidden[start : start + n]
        done = [p for p in range(start, start + n) if p % ratio == ratio - 1]
        rows = min(n, n // ratio + 1)
        cos = torch.zeros(rows, rope)
        sin = torch.zeros(rows, rope)
        if done:
            at = torch.tensor([(p // ratio) * ratio for p in done]).unsqueeze(0)
            c, s = module.rotary_emb(x[None], position_ids=at, layer_type="compress")
            cos[: len(done)] = c[0].repeat_interleave(2, dim=-1)
            sin[: len(done)] = s[0].repeat_interleave(2, dim=-1)
        out = torch.ops.custom.compressor(
            x, module.kv_proj.weight, module.gate_proj.weight, state, module.position_bias,
            module.kv_norm.weight.float(), sin, cos, rope, ratio, state_block_table=table,
            cu_seqlens=torch.tensor([0, n], dtype=torch.int32),
            start_pos=torch.tensor([start], dtype=torch.int32), coff=coff,
            norm_eps=module.kv_norm.variance_epsilon, rotary_mode=2,
        )  # fmt: skip
        entries.append(out[: len(done)])
        start += n
    return torch.cat(entries)


@pytest.mark.parametrize(
    ("layer_type", "chunks"), [(CSA, [13, 1, 1, 1, 6, 3]), (HCA, [130, 1, 126, 2])]
)
@torch.no_grad()
def test_compressor_state_across_steps_gives_transformers_entries(layer_type, chunks):
    """transformers' compressor keeps the open window (and CSA's previous half) in its cache
    layer between calls; custom.compressor keeps it in paged state rows: the same entries."""
    register_custom_operators()
    torch.manual_seed(0)
    config = _config(layer_type)
    model = v4.DeepseekV4Model(config).float().eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    compressor = model.layers[0].self_attn.compressor
    cache_class = v4.DeepseekV4CSACache if layer_type == CSA else v4.DeepseekV4HCACache
    cache = _OneLayerCache(cache_class(config))
    hidden = torch.randn(sum(chunks), config.hidden_size)
    residual = torch.randn(sum(chunks), config.q_lora_rank)
    start = 0
    for n in chunks:
        positions = torch.arange(start, start + n).unsqueeze(0)
        compressor(hidden[None, start : start + n], residual[None, start : start + n],
                   positions, cache, 0)  # fmt: skip
        start += n
    generator = torch.Generator().manual_seed(2)
    modules = {"compressor": compressor}
    if layer_type == CSA:
        modules["indexer"] = compressor.indexer
    for name, module in modules.items():
        expected = cache.layers[0].compressed_kv[name][0]  # [E, D]
        got = _op_entries(module, config, chunks, hidden, generator)
        assert got.shape == expected.shape == (sum(chunks) // module.compress_rate, module.head_dim)
        assert (got - expected).abs().max().item() < 1e-5, name

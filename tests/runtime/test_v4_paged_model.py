"""A tiny transformers DeepSeek-V4 (a sliding, a CSA and an HCA layer) served by the runtime on
the cache entries the framework declares and the operators it calls, against transformers'
own greedy generation.

The model's code is not rewritten here: its attention keeps computing q and the window rows as
written, and the kernel it calls (``attention_interface``) is replaced, for the runtime's runs
only, by a paged one that

- writes this step's window rows into ``win_kv`` at ``slot_mapping["win_kv"]``;
- runs ``custom.compressor`` on the layer's hidden states with the compressor's (and the CSA
  indexer's) weights, its state in the ``*_kv_state`` SlidingWindow rows, and writes the
  entries it completes at their rows of the compressed caches (block table, no slot mapping);
- selects CSA's entries with ``npu_lightning_indexer``, one batch row per query token;
- attends with ``custom.npu_sparse_attn_sharedkv`` (window, entries, sinks).

(The entries the model's own compressor computes without a cache are ignored.) These are the
steps the rewrite (KVR028 / KVR029) emits; this test holds the runtime and the operators to them
without the codemod, on a model built in the test.
"""

from __future__ import annotations

from types import MethodType

import pytest
import torch
from kvskill.runtime import LLM, CacheEntry, LayerCacheInfo, ModelCacheInfo, SamplingParams
from kvskill.runtime.forward_context import get_forward_metadata
from kvskill.runtime.ops.reference.custom import register_custom_operators
from kvskill.runtime.ops.reference.lightning_indexer import npu_lightning_indexer
from kvskill.runtime.tables import prepare_slot_mapping
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

BLOCK = 128  # an NPU block size (a multiple of 128 for a paged prefill)
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
PAGED = "kvskill_v4_paged"


def _config() -> DeepseekV4Config:
    config = DeepseekV4Config(
        vocab_size=64, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=32,
        partial_rotary_factor=0.5, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        index_n_heads=8, index_head_dim=16, index_topk=4, sliding_window=128,
        layer_types=["sliding_attention", CSA, HCA], mlp_layer_types=["moe"] * 3,
        eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return config


def _entries(attention, rows_per_block: bool) -> list[CacheEntry]:
    """The framework's declarations (modeling_deepseek.py:879-1010) for one layer. With
    ROWS_PER_BLOCK a compressed block holds BLOCK rows (``block_size = BLOCK * ratio`` tokens,
    as the framework declares it); else it covers the BLOCK tokens of every other group and
    holds BLOCK // ratio rows."""

    def setter(name):
        return lambda tensor: setattr(attention, name, tensor)

    head_dim = attention.head_dim
    entries = [
        CacheEntry("win_kv", "SlidingWindow", head_dim, 1, torch.float32, True, block_size=BLOCK,
                   manager_key="win_kv", tensor_setter=setter("win_kv"),
                   sliding_window=attention.sliding_window),
    ]  # fmt: skip
    compressor = attention.compressor
    if compressor is None:
        return entries
    ratio = compressor.compress_rate
    modules = {"sfa": compressor}
    if getattr(compressor, "indexer", None) is not None:
        modules["li"] = compressor.indexer
    for prefix, module in modules.items():
        coff = module.kv_proj.out_features // module.head_dim
        entries += [
            CacheEntry(f"{prefix}_cmp_kv", "FullAttention", module.head_dim, 1, torch.float32,
                       True, block_size=BLOCK * ratio if rows_per_block else BLOCK,
                       manager_key=f"c{ratio}a_cmp_kv",
                       tensor_setter=setter(f"{prefix}_cmp_kv"), compress_ratio=ratio),
            CacheEntry(f"{prefix}_kv_state", "SlidingWindow", [coff, module.head_dim], 2,
                       torch.float32, True, block_size=BLOCK, manager_key=f"c{ratio}a_cmp_state",
                       tensor_setter=setter(f"{prefix}_kv_state"), sliding_window=coff * ratio),
        ]  # fmt: skip
    return entries


def _get_cache_info(model) -> ModelCacheInfo:
    layers = [
        LayerCacheInfo(i, _entries(layer.self_attn, model.rows_per_block))
        for i, layer in enumerate(model.model.layers)
    ]
    return ModelCacheInfo(num_layers=len(layers), layer_infos=layers)


def _step_requests(md):
    """Per token: its request; per request: tokens before this step, cumulative q lengths."""
    q_lens = md.actual_seq_lengths_q.long()
    owner = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
    start = (md.actual_seq_lengths_kv.long() - q_lens).to(torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32)
    return owner, start, cu


def _write_rows(cache, block_table, owner, rows, values):
    """Row ``rows[i]`` of request ``owner[i]``: ``table[c // per] * per + c % per``."""
    per = cache.shape[1]
    slots = prepare_slot_mapping(block_table, owner, rows, per)
    cache[slots // per, slots % per] = values.view(-1, *cache.shape[2:])


def _compress(module, hidden, positions, state, cmp_cache, md, ratio):
    """custom.compressor over this step's tokens; its entries written at their rows."""
    owner, start, cu = _step_requests(md)
    done = positions % ratio == ratio - 1
    entries = positions[done] // ratio
    rows_out = min(hidden.shape[0], hidden.shape[0] // ratio + owner.max().item() + 1)
    cos, sin = module.rotary_emb(hidden[None], (entries * ratio)[None], layer_type="compress")
    rope = 2 * cos.shape[-1]
    rope_cos = hidden.new_zeros(rows_out, rope)
    rope_sin = hidden.new_zeros(rows_out, rope)
    rope_cos[: entries.numel()] = cos[0].repeat_interleave(2, dim=-1)
    rope_sin[: entries.numel()] = sin[0].repeat_interleave(2, dim=-1)
    out = torch.ops.custom.compressor(
        hidden.contiguous(), module.kv_proj.weight, module.gate_proj.weight, state.flatten(-3),
        module.position_bias, module.kv_norm.weight.float(), rope_sin, rope_cos, rope, ratio,
        state_block_table=md.block_table[f"c{ratio}a_cmp_state"].to(torch.int32),
        cu_seqlens=cu, start_pos=start, coff=module.kv_proj.out_features // module.head_dim,
        norm_eps=module.kv_norm.variance_epsilon, rotary_mode=2,
    )  # fmt: skip
    if entries.numel():
        table = md.block_table[f"c{ratio}a_cmp_kv"]
        _write_rows(cmp_cache, table, owner[done], entries, out[: entries.numel()])


def _select(indexer, hidden, q_residual, positions, md, ratio):
    """Top-k compressed entries per token: npu_lightning_indexer, one batch row per token."""
    owner, _, _ = _step_requests(md)
    tokens = hidden.shape[0]
    cos, sin = indexer.rotary_emb(hidden[None], positions[None], layer_type="compress")
    q = indexer.q_b_proj(q_residual).view(1, tokens, -1, indexer.head_dim).transpose(1, 2)
    q = v4.apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)[0]  # [T, H, D]
    scorer = indexer.scorer
    weights = scorer.weights_proj(hidden) * (scorer.weights_scaling * scorer.softmax_scale)
    table = md.block_table[f"c{ratio}a_cmp_kv"].to(torch.int32)
    indices, _ = npu_lightning_indexer(
        q.contiguous(), indexer.paged_keys, weights.float(),
        actual_seq_lengths_query=torch.arange(1, tokens + 1, dtype=torch.int32),
        actual_seq_lengths_key=((positions + 1) // ratio).to(torch.int32),
        block_table=table[owner].contiguous(), layout_query="TND", layout_key="PA_BSND",
        sparse_count=indexer.index_topk, sparse_mode=3,
    )  # fmt: skip
    return indices


def paged_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The kernel of one V4 attention call, on the paged caches (module docstring)."""
    md = get_forward_metadata()
    seen = module.paged_inputs
    hidden, positions = seen["hidden"][0], seen["positions"][0]
    tokens = query.shape[2]
    owner, _, cu = _step_requests(md)
    q = query[0].transpose(0, 1).contiguous()  # [T, N, D]
    _write_rows(module.win_kv, md.block_table["win_kv"], owner, positions, key[0, 0, :tokens])
    cmp_kv = cmp_table = indices = None
    ratio = 0
    compressor = module.compressor
    if compressor is not None:
        ratio = compressor.compress_rate
        _compress(compressor, hidden, positions, module.sfa_kv_state, module.sfa_cmp_kv, md, ratio)
        cmp_kv, cmp_table = module.sfa_cmp_kv, md.block_table[f"c{ratio}a_cmp_kv"]
        indexer = getattr(compressor, "indexer", None)
        if indexer is not None:
            _compress(indexer, hidden, positions, module.li_kv_state, module.li_cmp_kv, md, ratio)
            indexer.paged_keys = module.li_cmp_kv
            indices = _select(indexer, hidden, seen["q_residual"][0], positions, md, ratio)
            if module.attend_every_entry:  # the negative control: no selection at all
                indices = None
    used = md.actual_seq_lengths_kv.to(torch.int32)
    metadata = torch.ops.custom.npu_sparse_attn_sharedkv_metadata(
        q.size(1), 1, q.size(2), cu_seqlens_q=cu, seqused_kv=used, batch_size=used.numel(),
        max_seqlen_q=int(md.actual_seq_lengths_q.max()), max_seqlen_kv=int(used.max()),
        cmp_topk=indices.size(-1) if indices is not None else 0,
        cmp_ratio=ratio if ratio else -1, layout_q="TND", has_ori_kv=True,
        has_cmp_kv=cmp_kv is not None, device="cpu",
    )  # fmt: skip
    out, _ = torch.ops.custom.npu_sparse_attn_sharedkv(
        q, ori_kv=module.win_kv, cmp_kv=cmp_kv, cmp_sparse_indices=indices,
        ori_block_table=md.block_table["win_kv"].to(torch.int32),
        cmp_block_table=cmp_table.to(torch.int32) if cmp_table is not None else None,
        cu_seqlens_q=cu, seqused_kv=used, sinks=module.sinks, metadata=metadata,
        softmax_scale=scaling, cmp_ratio=ratio, layout_q="TND", layout_kv="PA_ND",
    )  # fmt: skip
    return out.unsqueeze(0), None


def _tiny_v4():
    torch.manual_seed(0)
    model = v4.DeepseekV4ForCausalLM(_config()).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    for layer in model.model.layers:
        attention = layer.self_attn
        attention.paged_inputs = {}

        def keep_inputs(module, args, kwargs):
            module.paged_inputs["hidden"] = args[0] if args else kwargs["hidden_states"]
            module.paged_inputs["positions"] = kwargs["position_ids"]

        def keep_residual(module, args, output, attention=attention):
            attention.paged_inputs["q_residual"] = output

        attention.register_forward_pre_hook(keep_inputs, with_kwargs=True)
        attention.q_a_norm.register_forward_hook(keep_residual)
        attention.attend_every_entry = False
    model.block_size = BLOCK
    model.rows_per_block = True
    model.get_cache_info = MethodType(_get_cache_info, model)
    return model


def _reference(model, prompts, max_tokens):
    """transformers' greedy tokens and the logits of every step, one request at a time."""
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
            tokens.append(out.sequences[0, len(prompt) :].tolist())
            logits.append(torch.cat(out.logits))
    return tokens, logits


def _serve(model, prompts, max_tokens, **settings):
    """The runtime's tokens, the logits of every step per request, and the LLM."""
    model.config._attn_implementation = PAGED
    try:
        llm = LLM(model, exact=True, **settings)
        rows: dict[str, list[torch.Tensor]] = {}

        def keep(record) -> None:
            for i, rid in enumerate(record.request_ids):
                if record.sampled[i] is not None:
                    rows.setdefault(rid, []).append(record.logits[i].clone())

        with llm.step_hook(keep):
            outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens))
    finally:
        model.config._attn_implementation = "eager"
    logits = [torch.stack(rows[o.request_id][-max_tokens:]) for o in outputs]
    return [o.token_ids for o in outputs], logits, llm


STEPS = 6
#: over the 128-token window (150, 140) and under it, crossing a 128-token block while
#: decoding (125, 126); 150 // 4 = 37 CSA entries > top-4
LENGTHS = [150, 125, 140, 126]


@pytest.fixture(scope="module")
def served():
    register_custom_operators()
    v4.ALL_ATTENTION_FUNCTIONS.register(PAGED, paged_attention)
    model = _tiny_v4()
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (n,), generator=generator).tolist() for n in LENGTHS]
    return model, prompts, _reference(model, prompts, STEPS)


def _max_diff(got, expected) -> float:
    return max((g - e).abs().max().item() for g, e in zip(got, expected, strict=True))


def test_the_runtime_serves_v4_token_exact(served):
    model, prompts, (tokens, logits) = served
    got, got_logits, llm = _serve(model, prompts, STEPS, num_blocks=8)
    assert got == tokens
    assert _max_diff(got_logits, logits) < 1e-4
    groups = llm.kv_manager.usage()["groups"]
    assert sorted(groups) == [
        "c128a_cmp_kv", "c128a_cmp_state", "c4a_cmp_kv", "c4a_cmp_state", "win_kv"
    ]  # fmt: skip
    assert llm.model.model.layers[2].self_attn.sfa_cmp_kv.shape[1] == BLOCK  # rows per block


def test_attending_every_csa_entry_instead_of_the_selection_fails(served):
    model, prompts, (tokens, logits) = served
    csa = model.model.layers[1].self_attn
    csa.attend_every_entry = True
    try:
        got, got_logits, _ = _serve(model, prompts, STEPS, num_blocks=8)
    finally:
        csa.attend_every_entry = False
    assert _max_diff(got_logits, logits) > 1e-2


def test_preemption_and_prefix_hits_give_the_roomy_tokens(served):
    """Compressed blocks on the other groups' 128-token boundary (BLOCK // ratio rows each): a
    pool of 4 blocks per group preempts while decoding across a block, and the prompts run
    again hit the prefix cache (a compressed entry's block boundary is the token block's)."""
    model, prompts, (tokens, _) = served
    model.rows_per_block = False
    try:
        roomy, _, _ = _serve(model, prompts, STEPS, num_blocks=32, cpu_only_shapes=True)
        model.config._attn_implementation = PAGED
        llm = LLM(
            model, exact=True, num_blocks=4, enable_prefix_caching=True,
            free_block_order_seed=5, cpu_only_shapes=True,
        )  # fmt: skip
        params = SamplingParams(max_tokens=STEPS)
        first = [o.token_ids for o in llm.generate(prompts, params)]
        again = [o.token_ids for o in llm.generate(prompts[:2], params)]
    finally:
        model.rows_per_block = True
        model.config._attn_implementation = "eager"
    assert roomy == first == tokens
    assert again == tokens[:2]
    assert llm.stats.num_preemptions > 0
    assert llm.stats.num_prefix_hit_tokens >= BLOCK
    assert llm.kv_manager.num_free_blocks == llm.kv_manager.initial_free_blocks

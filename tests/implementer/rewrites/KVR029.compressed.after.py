"""A compressed attention in miniature, written for the per-rewrite tests: a K = V window with
sinks, a compressor that keeps its open window in the cache between calls, an indexer that
keeps the top entries, and a causal-LM head. Never run; only rewritten."""

import torch
from torch import nn

from ...masking_utils import create_sliding_window_causal_mask
from ...modeling_utils import ALL_ATTENTION_FUNCTIONS
from .configuration_mini import MiniConfig


def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1):
    # a comment in an untouched function
    return x * cos.unsqueeze(unsqueeze_dim) + x.flip(-1) * sin.unsqueeze(unsqueeze_dim)


class MiniNorm(nn.Module):
    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps


class MiniRotary(nn.Module):
    def forward(self, x, position_ids, layer_type=None):
        freqs = position_ids[..., None].float()
        return freqs.cos(), freqs.sin()


class MiniScorer(nn.Module):
    def __init__(self, config: MiniConfig):
        super().__init__()
        self.softmax_scale = config.index_head_dim**-0.5
        self.weights_scaling = config.index_n_heads**-0.5
        self.weights_proj = nn.Linear(config.hidden_size, config.index_n_heads, bias=False)


class MiniIndexer(nn.Module):
    rope_layer_type = "compress"

    def __init__(self, config: MiniConfig):
        super().__init__()
        self.compress_rate = config.compress_rates["compressed_sparse_attention"]
        self.head_dim = config.index_head_dim
        self.index_topk = config.index_topk
        self.kv_proj = nn.Linear(config.hidden_size, 2 * self.head_dim, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, 2 * self.head_dim, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(self.compress_rate, 2 * self.head_dim))
        self.kv_norm = MiniNorm(self.head_dim)
        self.q_b_proj = nn.Linear(config.q_lora_rank, config.index_n_heads * self.head_dim)
        self.rotary_emb = MiniRotary()
        self.scorer = MiniScorer(config)

    def forward(self, hidden_states, q_residual, position_ids, cache, layer_idx):
        kv, gate = self.kv_proj(hidden_states), self.gate_proj(hidden_states)
        chunk, _, _ = cache.layers[layer_idx].store_compression_weights("indexer", kv, gate)
        scores = chunk.sum(-1)
        return scores.topk(min(self.index_topk, scores.shape[-1]), dim=-1).indices


class MiniCompressor(nn.Module):
    rope_layer_type = "compress"

    def __init__(self, config: MiniConfig):
        super().__init__()
        self.compress_rate = config.compress_rates["compressed_sparse_attention"]
        self.head_dim = config.head_dim
        self.kv_proj = nn.Linear(config.hidden_size, 2 * self.head_dim, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, 2 * self.head_dim, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(self.compress_rate, 2 * self.head_dim))
        self.kv_norm = MiniNorm(self.head_dim)
        self.rotary_emb = MiniRotary()
        self.indexer = MiniIndexer(config)

    def forward(self, hidden_states, q_residual, position_ids, cache, layer_idx):
        kv, gate = self.kv_proj(hidden_states), self.gate_proj(hidden_states)
        layer = cache.layers[layer_idx]
        chunk_kv, chunk_gate, _ = layer.store_compression_weights("compressor", kv, gate)
        layer.update_overlap_state("compressor", chunk_kv, chunk_gate, self.head_dim)
        top = self.indexer(hidden_states, q_residual, position_ids, cache, layer_idx)
        return chunk_kv[..., : self.head_dim].unsqueeze(1), top


class MiniAttention(nn.Module):
    def __init__(self, config: MiniConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_b_proj = nn.Linear(config.q_lora_rank, config.num_attention_heads * self.head_dim)
        self.kv_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size)
        self.sinks = nn.Parameter(torch.zeros(config.num_attention_heads))
        compressed = config.layer_types[layer_idx] != "sliding_attention"
        self.compressor = MiniCompressor(config) if compressed else None

    def forward(self, hidden_states, position_embeddings, position_ids, attention_mask, cache=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        cos, sin = position_embeddings
        q_residual = self.q_a_proj(hidden_states)
        q = apply_rotary_pos_emb(self.q_b_proj(q_residual).view(hidden_shape).transpose(1, 2), cos, sin)
        kv = apply_rotary_pos_emb(self.kv_proj(hidden_states).view(hidden_shape).transpose(1, 2), cos, sin)

        # Paged compressed attention: this step's window rows go to win_kv at slot_mapping; the
        # compressor (and the CSA indexer's own) pools the windows these tokens close, with its state
        # rows, into the compressed caches; CSA picks its entries with the lightning indexer; one
        # softmax takes the window, the entries and the sinks (npu_sparse_attn_sharedkv).
        md = get_forward_metadata()
        query_tnd = q.transpose(1, 2).reshape(-1, self.num_heads_per_rank, q.shape[-1]).contiguous()
        self.update_cache(md.slot_mapping["win_kv"], kv.transpose(1, 2).reshape(-1, kv.shape[-1]))
        compressed = self.compressed_inputs(hidden_states, q_residual, position_ids, md)
        _, _, cu_seqlens_q = self.step_requests(md, query_tnd.shape[0])
        seqused_kv = md.actual_seq_lengths_kv.to(torch.int32)
        attn_output, _ = torch.ops.custom.npu_sparse_attn_sharedkv(
            query_tnd,
            ori_kv=self.win_kv,
            ori_block_table=md.block_table["win_kv"].to(torch.int32),
            cu_seqlens_q=cu_seqlens_q,
            seqused_kv=seqused_kv,
            sinks=self.sinks.float(),  # the operator takes float32 sinks whatever the model's dtype
            metadata=self.sharedkv_metadata(query_tnd, cu_seqlens_q, seqused_kv, compressed),
            softmax_scale=self.scaling,
            layout_q="TND",
            layout_kv="PA_ND",
            **compressed,
        )
        attn_output = attn_output.unsqueeze(0)  # [1, T, N, D], as the source kernel returns
        attn_weights = None
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def update_cache(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write this step's window rows ([T, head_dim], K = V) into win_kv at their slots
        (a page-pool view cannot be flattened: it is written through (block, row) pairs)."""
        if self.win_kv.is_contiguous():
            torch_npu.npu_scatter_nd_update_(self.win_kv.view(-1, 1, rows.shape[-1]), slots.view(-1, 1), rows.reshape(-1, 1, rows.shape[-1]))
            return
        per = self.win_kv.shape[1]
        where = torch.stack((slots // per, slots % per), dim=-1)
        torch_npu.npu_scatter_nd_update_(self.win_kv, where, rows.reshape(-1, 1, rows.shape[-1]))

    @staticmethod
    def write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """ROWS at SLOTS (block * rows per block + row) of CACHE [blocks, rows, heads, dim].

        A page-pool view cannot be flattened (its block stride is the page), so it is
        written through (block, row) pairs.
        """
        tail = cache.shape[2:]
        if cache.is_contiguous():
            torch_npu.npu_scatter_nd_update_(cache.view(-1, *tail), slots.view(-1, 1), rows.reshape(-1, *tail))
            return
        per = cache.shape[1]
        where = torch.stack((slots // per, slots % per), dim=-1)
        torch_npu.npu_scatter_nd_update_(cache, where, rows.reshape(-1, *tail))

    @staticmethod
    def step_requests(md, tokens: int):
        """Per token its request; per request its tokens before this step; cumulative q.

        TOKENS (the step's, the sum of the query lengths) sizes the owner list, so a captured
        step knows its shape without reading the lengths.
        """
        q_lens = md.actual_seq_lengths_q.long()
        owner = torch.repeat_interleave(torch.arange(q_lens.numel(), device=q_lens.device), q_lens, output_size=tokens)
        start = (md.actual_seq_lengths_kv.long() - q_lens).to(torch.int32)
        cu = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32)
        return owner, start, cu

    def compress(self, prefix: str, hidden: torch.Tensor, positions: torch.Tensor, md) -> None:
        """Pool the windows this step's tokens close (custom.compressor, its state in
        {prefix}_kv_state) and write each entry at its row of {prefix}_cmp_kv.

        Every shape here is the step's token count, never the number of windows closed, so a
        captured decode step needs no data-dependent size: a token that closes its window
        (position p with p % ratio == ratio - 1) is the k-th such token, k = its rank, and its
        entry p // ratio is the compressor's k-th output row. Ratio 4, positions 5 6 7 8 9 10 11:
        closing 7 and 11, ranks 0 and 1, entries 1 and 2. The other tokens' rope rows go to a
        spare row past the output and their writes to the null block's slot 0, which no table
        reads (block tables pad with it and no length reaches into it).
        """
        module = self.compressed_modules[prefix]
        ratio = module.compress_rate
        x = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        tokens = x.shape[0]
        owner, start, cu = self.step_requests(md, tokens)
        pos = positions.reshape(-1)
        done = pos % ratio == ratio - 1
        entries = pos // ratio
        rank = done.long().cumsum(0) - 1
        rows_out = min(tokens, tokens // ratio + start.numel())
        row = torch.where(done, rank, rows_out)
        # each entry is roped at its window's first position
        cos, sin = module.rotary_emb(x[None], position_ids=(entries * ratio)[None], layer_type=module.rope_layer_type)
        rope = 2 * cos.shape[-1]
        rope_cos = torch.zeros(rows_out + 1, rope, dtype=torch.float32, device=x.device)
        rope_sin = torch.zeros(rows_out + 1, rope, dtype=torch.float32, device=x.device)
        rope_cos[row] = cos[0].repeat_interleave(2, dim=-1).float()
        rope_sin[row] = sin[0].repeat_interleave(2, dim=-1).float()
        pooled = torch.ops.custom.compressor(
            x,
            module.kv_proj.weight,
            module.gate_proj.weight,
            getattr(self, f"{prefix}_kv_state").flatten(-3),
            module.position_bias.float(),  # ape and the norm weight are float32 operands
            module.kv_norm.weight.float(),
            rope_sin[:rows_out],
            rope_cos[:rows_out],
            rope,
            ratio,
            state_block_table=md.block_table[f"c{ratio}a_cmp_state"].to(torch.int32),
            cu_seqlens=cu,
            start_pos=start,
            coff=module.kv_proj.out_features // module.head_dim,
            norm_eps=module.kv_norm.variance_epsilon,
            rotary_mode=2,
        )
        cache = getattr(self, f"{prefix}_cmp_kv")
        per = cache.shape[1]
        table = md.block_table[f"c{ratio}a_cmp_kv"]
        # a token that closes no window may sit past its request's allocated entries: clamp
        # its (unused) block index into the table
        block = table[owner, (entries // per).clamp(max=table.shape[1] - 1)].long()
        slots = torch.where(done, block * per + entries % per, 0)
        self.write_rows(cache, slots, pooled[rank.clamp(min=0)].to(cache.dtype))

    def select_entries(self, hidden: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor, md) -> torch.Tensor:
        """CSA's top-k compressed entries per token ([T, 1, k], -1 after the candidates).

        npu_lightning_indexer takes no compress ratio; its causal limit is per batch row, so
        each query token is a row of its own, whose keys are the entries it may read,
        (p + 1) // ratio. Both positive scales of the scores go into the weights.
        """
        indexer = self.compressed_modules["li"]
        ratio = indexer.compress_rate
        x = hidden.reshape(-1, hidden.shape[-1])
        pos = positions.reshape(-1)
        tokens = x.shape[0]
        owner, _, _ = self.step_requests(md, tokens)
        cos, sin = indexer.rotary_emb(x[None], position_ids=pos[None], layer_type=indexer.rope_layer_type)
        q = indexer.q_b_proj(q_residual.reshape(tokens, -1)).view(1, tokens, -1, indexer.head_dim).transpose(1, 2)
        q = apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)[0]
        scorer = indexer.scorer
        weights = scorer.weights_proj(x).float() * (scorer.weights_scaling * scorer.softmax_scale)
        table = md.block_table[f"c{ratio}a_cmp_kv"].to(torch.int32)
        indices, _ = torch_npu.npu_lightning_indexer(
            q.contiguous(),
            self.li_cmp_kv,
            weights,
            actual_seq_lengths_query=torch.arange(1, tokens + 1, dtype=torch.int32, device=x.device),
            actual_seq_lengths_key=((pos + 1) // ratio).to(torch.int32),
            block_table=table[owner].contiguous(),
            layout_query="TND",
            layout_key="PA_BSND",
            sparse_count=indexer.index_topk,
            sparse_mode=3,
        )
        return indices

    def compressed_inputs(self, hidden: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor, md) -> dict:
        """The compressed half of the attention's inputs (none on a sliding-only layer): this
        step's entries pooled into their rows first, then CSA's selection."""
        if not self.compressed_modules:
            return {}
        for prefix in self.compressed_modules:
            self.compress(prefix, hidden, positions, md)
        ratio = self.compress_ratio
        return {
            "cmp_kv": self.sfa_cmp_kv,
            "cmp_block_table": md.block_table[f"c{ratio}a_cmp_kv"].to(torch.int32),
            "cmp_sparse_indices": (
                self.select_entries(hidden, q_residual, positions, md)
                if "li" in self.compressed_modules
                else None
            ),
            "cmp_ratio": ratio,
        }

    def sharedkv_metadata(self, query: torch.Tensor, cu: torch.Tensor, used: torch.Tensor, compressed: dict) -> torch.Tensor:
        """npu_sparse_attn_sharedkv_metadata: the per-core plan the attention requires.

        max_seqlen_q / max_seqlen_kv stay at their defaults, as the framework's own model leaves
        them (calc_sas_metadata); reading them from the lengths would put host reads of this
        step's values into a captured decode step.
        """
        indices = compressed.get("cmp_sparse_indices")
        return torch.ops.custom.npu_sparse_attn_sharedkv_metadata(
            query.shape[1],
            1,
            query.shape[2],
            cu_seqlens_q=cu,
            seqused_kv=used,
            batch_size=used.numel(),
            cmp_topk=indices.shape[-1] if indices is not None else 0,
            cmp_ratio=compressed.get("cmp_ratio", -1),
            layout_q="TND",
            has_ori_kv=True,
            has_cmp_kv="cmp_kv" in compressed,
            device=str(query.device),
        )


class MiniDecoderLayer(nn.Module):
    def __init__(self, config: MiniConfig, layer_idx: int):
        super().__init__()
        self.self_attn = MiniAttention(config, layer_idx)

    def forward(self, hidden_states, **kwargs):
        attn, _ = self.self_attn(hidden_states, **kwargs)
        return hidden_states + attn


class MiniModel(nn.Module):
    def __init__(self, config: MiniConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(MiniDecoderLayer(config, i) for i in range(config.num_hidden_layers))

    def forward(self, inputs_embeds, position_embeddings, position_ids, cache=None):
        mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=inputs_embeds, cache=cache)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, position_embeddings=position_embeddings, position_ids=position_ids,
                attention_mask=mask, cache=cache,
            )
        return hidden_states


class MiniForCausalLM(nn.Module):
    def __init__(self, config: MiniConfig):
        super().__init__()
        self.model = MiniModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, inputs_embeds, position_embeddings, position_ids):
        return self.lm_head(self.model(inputs_embeds, position_embeddings, position_ids))

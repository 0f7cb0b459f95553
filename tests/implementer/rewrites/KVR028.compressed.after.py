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
        # Paged caches of compressed attention, as cann-recipes-infer's DeepSeek-V4 declares them
        # (models/deepseek_v4/models/modeling_deepseek.py:879-1010): every layer keeps its window of
        # K = V rows ("win_kv"); a compressed layer adds, for its compressor and its CSA indexer, the
        # entries they emit ("*_cmp_kv": compress_ratio tokens per row, a block table and no slot
        # mapping) and the per-token state of the windows not closed yet ("*_kv_state": float32
        # [kv | score] rows, coff * compress_ratio of them).
        self.attn_type = "SlidingWindow"
        self.attn_tp_size = 1  # attention tensor-parallel size the heads are split over
        self.num_heads_per_rank = config.num_attention_heads // self.attn_tp_size
        self.num_key_value_heads_per_rank = 1  # one K = V head
        self.win_kv = torch.Tensor([])
        self.cache_entries = [
            CacheEntry(
                cache_name="win_kv",
                attn_type="SlidingWindow",
                dim=self.head_dim,
                num_head=1,
                # NOTE: get_cache_info() updates this to the layer's dtype after any cast.
                dtype=torch.get_default_dtype(),
                needs_block=True,
                manager_key="win_kv",
                tensor_setter=self.set_win_kv,
                sliding_window=config.sliding_window,
            ),
        ]
        self.pinned_cache_dtypes = {}
        self.compressed_modules = {}
        if self.compressor is not None:
            self.compress_ratio = self.compressor.compress_rate
            self.compressed_modules["sfa"] = self.compressor
            if getattr(self.compressor, "indexer", None) is not None:
                self.compressed_modules["li"] = self.compressor.indexer
            for prefix, module in self.compressed_modules.items():
                self.cache_entries.extend(self.compressed_cache_entries(prefix, module))
        self.custom_operators()  # torch.ops.custom, resolved here rather than in the traced step

    def forward(self, hidden_states, position_embeddings, position_ids, attention_mask, cache=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        cos, sin = position_embeddings
        q_residual = self.q_a_proj(hidden_states)
        q = apply_rotary_pos_emb(self.q_b_proj(q_residual).view(hidden_shape).transpose(1, 2), cos, sin)
        kv = apply_rotary_pos_emb(self.kv_proj(hidden_states).view(hidden_shape).transpose(1, 2), cos, sin)

        if cache is not None:  # one cache row: the key is the value
            kv = cache.update(kv, kv, self.layer_idx)[0]

        if self.compressor is not None:
            compressed, _ = self.compressor(hidden_states, q_residual, position_ids, cache, self.layer_idx)
            kv = torch.cat([kv, compressed], dim=2)

        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        attn_output, attn_weights = attention_interface(
            self, q, kv, kv, attention_mask, scaling=self.scaling, s_aux=self.sinks
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def set_win_kv(self, tensor: torch.Tensor) -> None:
        """tensor_setter of the win_kv entry: [num_blocks, block_size, 1, head_dim]."""
        self.win_kv = tensor

    def compressed_cache_entries(self, prefix: str, module) -> list:
        """The entries a compressor (MODULE) writes: its pooled rows and its state rows.

        CSA's projections are coff = 2 series wide (the overlapping windows), so its state
        keeps 2 * compress_rate tokens; HCA's keeps compress_rate.
        """
        ratio = module.compress_rate
        coff = module.kv_proj.out_features // module.head_dim
        pooled, state = f"{prefix}_cmp_kv", f"{prefix}_kv_state"
        setattr(self, pooled, torch.Tensor([]))
        setattr(self, state, torch.Tensor([]))
        self.pinned_cache_dtypes[state] = torch.float32  # the compressor keeps it in float32
        return [
            CacheEntry(
                cache_name=pooled,
                attn_type="FullAttention",
                dim=module.head_dim,
                num_head=1,
                # NOTE: get_cache_info() updates this to the layer's dtype after any cast.
                dtype=torch.get_default_dtype(),
                needs_block=True,
                manager_key=f"c{ratio}a_cmp_kv",
                tensor_setter=lambda tensor, name=pooled: setattr(self, name, tensor),
                compress_ratio=ratio,
            ),
            CacheEntry(
                cache_name=state,
                attn_type="SlidingWindow",
                dim=[coff, module.head_dim],
                num_head=2,  # kv and score
                dtype=torch.float32,
                needs_block=True,
                manager_key=f"c{ratio}a_cmp_state",
                tensor_setter=lambda tensor, name=state: setattr(self, name, tensor),
                sliding_window=coff * ratio,
            ),
        ]

    @staticmethod
    def custom_operators():
        """torch.ops.custom: the framework's operator extension where it is installed (the
        device), else kvskill's reference operators under the same names and schemas.

        NOTE: __init__ resolves it once; the forward calls torch.ops.custom.<name> directly,
        as an import inside a captured decode step would break its graph.
        """
        try:
            import custom_ops  # noqa: F401
        except ImportError:
            from kvskill.runtime.ops.reference.custom import register_custom_operators

            register_custom_operators()
        return torch.ops.custom


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

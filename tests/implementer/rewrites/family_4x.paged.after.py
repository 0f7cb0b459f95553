"""A transformers-4.46-style attention family written for the rewrite tests: an eager class
with hand-written matmul attention, an SDPA variant that overrides only forward, a flash
variant with its own __init__ calling super, chosen through a dict. Never run; only rewritten."""

import math

import torch
from torch import nn

from transformers.modeling_flash_attention_utils import _flash_attention_forward
from kvskill.runtime import CacheEntry, LayerCacheInfo, ModelCacheInfo, get_forward_metadata
from kvskill.runtime.ops import torch_npu


def repeat_kv(x, n_rep):
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


class MiniAttention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.groups = config.num_attention_heads // config.num_key_value_heads
        self.dropout = config.attention_dropout
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)
        # Paged KV cache: the runtime groups layers by attn_type, allocates one
        # [num_blocks, block_size, num_head, dim] tensor per cache entry and injects it through
        # the entry's tensor_setter; until then the caches are empty placeholders.
        self.attn_type = "FullAttention"
        self.attn_tp_size = 1  # attention tensor-parallel size the heads are split over
        self.num_heads_per_rank = config.num_attention_heads // self.attn_tp_size
        self.num_key_value_heads_per_rank = max(config.num_key_value_heads // self.attn_tp_size, 1)
        self.k_cache = torch.Tensor([])
        self.v_cache = torch.Tensor([])
        self.cache_entries = [
            CacheEntry(
                cache_name="k_cache",
                attn_type=self.attn_type,
                dim=self.head_dim,
                num_head=self.num_key_value_heads_per_rank,
                # NOTE: get_cache_info() updates this to the layer's dtype after any cast.
                dtype=torch.get_default_dtype(),
                needs_block=True,
                tensor_setter=self.set_k_cache,
            ),
            CacheEntry(
                cache_name="v_cache",
                attn_type=self.attn_type,
                dim=self.head_dim,
                num_head=self.num_key_value_heads_per_rank,
                # NOTE: get_cache_info() updates this to the layer's dtype after any cast.
                dtype=torch.get_default_dtype(),
                needs_block=True,
                tensor_setter=self.set_v_cache,
            ),
        ]

    def split(self, hidden_states):
        bsz, q_len, _ = hidden_states.size()
        q, k, v = self.qkv(hidden_states).view(bsz, q_len, 3, -1, self.head_dim).unbind(2)
        return bsz, q_len, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None, output_attentions=False, **kwargs):
        bsz, q_len, query_states, key_states, value_states = self.split(hidden_states)

        # Paged KV: flatten to TND ([T, N, D]), write this step's keys and values at
        # slot_mapping[attn_type], then attend over this attn_type's block table.
        md = get_forward_metadata()
        query_tnd = query_states.transpose(1, 2).reshape(-1, self.num_heads_per_rank, query_states.shape[-1])
        key_tnd = key_states.transpose(1, 2).reshape(-1, self.num_key_value_heads_per_rank, key_states.shape[-1])
        value_tnd = value_states.transpose(1, 2).reshape(-1, self.num_key_value_heads_per_rank, value_states.shape[-1])
        self.update_cache(md.slot_mapping[self.attn_type], key_tnd, value_tnd)
        num_blocks, block_size = self.k_cache.shape[:2]
        attn_output, _ = torch_npu.npu_fused_infer_attention_score(
            query_tnd,
            self.k_cache.view(num_blocks, block_size, -1),
            self.v_cache.view(num_blocks, block_size, -1),
            num_heads=self.num_heads_per_rank,
            num_key_value_heads=self.num_key_value_heads_per_rank,
            input_layout="TND",
            scale=1 / math.sqrt(self.head_dim),
            atten_mask=md.attention_mask,
            sparse_mode=3,
            block_table=md.block_table[self.attn_type],
            block_size=block_size,
            actual_seq_lengths=(md.actual_seq_lengths_cu_list_q or md.actual_seq_lengths_cu_q.tolist()),
            actual_seq_lengths_kv=(md.actual_seq_lengths_list_kv or md.actual_seq_lengths_kv.tolist()),
        )
        attn_output = attn_output.unsqueeze(0).transpose(1, 2)  # [1, N, T, D], as the source kernel returns
        attn_weights = None

        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        if not output_attentions:
            attn_weights = None
        return self.out(attn_output), attn_weights, past_key_value

    def set_k_cache(self, tensor: torch.Tensor) -> None:
        """tensor_setter of the k_cache entry: [num_blocks, block_size, num_head, dim]."""
        self.k_cache = tensor

    def set_v_cache(self, tensor: torch.Tensor) -> None:
        """tensor_setter of the v_cache entry: [num_blocks, block_size, num_head, dim]."""
        self.v_cache = tensor

    def update_cache(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write this step's keys and values ([T, num_kv_heads, head_dim]) at their slots.

        slot = block_id * block_size + offset. A contiguous cache is addressed as flat slots
        [num_blocks * block_size, heads, dim]. A page-pool view cannot be flattened (its block
        stride is the page, not block_size * heads * dim), so it is written through its own
        [num_blocks, block_size, heads, dim] form with (block_id, offset) pairs.
        """
        if self.k_cache.is_contiguous() and self.v_cache.is_contiguous():
            heads = self.num_key_value_heads_per_rank
            torch_npu.npu_scatter_nd_update_(self.k_cache.view(-1, heads, key.shape[-1]), slots.view(-1, 1), key)
            torch_npu.npu_scatter_nd_update_(self.v_cache.view(-1, heads, value.shape[-1]), slots.view(-1, 1), value)
            return
        # NOTE: whether ScatterNdUpdate accepts a strided page view on device is unconfirmed
        # (references/npu_ops.md); the contiguous layout is the safe default.
        block_size = self.k_cache.shape[1]
        where = torch.stack((slots // block_size, slots % block_size), dim=-1)
        torch_npu.npu_scatter_nd_update_(self.k_cache, where, key)
        torch_npu.npu_scatter_nd_update_(self.v_cache, where, value)


class MiniSdpaAttention(MiniAttention):
    def forward(self, hidden_states, attention_mask=None, past_key_value=None, output_attentions=False, **kwargs):
        if output_attentions:
            return super().forward(hidden_states, attention_mask, past_key_value, output_attentions)
        bsz, q_len, query_states, key_states, value_states = self.split(hidden_states)

        # Paged KV: flatten to TND ([T, N, D]), write this step's keys and values at
        # slot_mapping[attn_type], then attend over this attn_type's block table.
        md = get_forward_metadata()
        query_tnd = query_states.transpose(1, 2).reshape(-1, self.num_heads_per_rank, query_states.shape[-1])
        key_tnd = key_states.transpose(1, 2).reshape(-1, self.num_key_value_heads_per_rank, key_states.shape[-1])
        value_tnd = value_states.transpose(1, 2).reshape(-1, self.num_key_value_heads_per_rank, value_states.shape[-1])
        self.update_cache(md.slot_mapping[self.attn_type], key_tnd, value_tnd)
        num_blocks, block_size = self.k_cache.shape[:2]
        attn_output, _ = torch_npu.npu_fused_infer_attention_score(
            query_tnd,
            self.k_cache.view(num_blocks, block_size, -1),
            self.v_cache.view(num_blocks, block_size, -1),
            num_heads=self.num_heads_per_rank,
            num_key_value_heads=self.num_key_value_heads_per_rank,
            input_layout="TND",
            scale=query_states.shape[-1] ** -0.5,
            atten_mask=md.attention_mask,
            sparse_mode=3,
            block_table=md.block_table[self.attn_type],
            block_size=block_size,
            actual_seq_lengths=(md.actual_seq_lengths_cu_list_q or md.actual_seq_lengths_cu_q.tolist()),
            actual_seq_lengths_kv=(md.actual_seq_lengths_list_kv or md.actual_seq_lengths_kv.tolist()),
        )
        attn_output = attn_output.unsqueeze(0).transpose(1, 2)  # [1, N, T, D], as the source kernel returns
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.out(attn_output), None, past_key_value

    def update_cache(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write this step's keys and values ([T, num_kv_heads, head_dim]) at their slots.

        slot = block_id * block_size + offset. A contiguous cache is addressed as flat slots
        [num_blocks * block_size, heads, dim]. A page-pool view cannot be flattened (its block
        stride is the page, not block_size * heads * dim), so it is written through its own
        [num_blocks, block_size, heads, dim] form with (block_id, offset) pairs.
        """
        if self.k_cache.is_contiguous() and self.v_cache.is_contiguous():
            heads = self.num_key_value_heads_per_rank
            torch_npu.npu_scatter_nd_update_(self.k_cache.view(-1, heads, key.shape[-1]), slots.view(-1, 1), key)
            torch_npu.npu_scatter_nd_update_(self.v_cache.view(-1, heads, value.shape[-1]), slots.view(-1, 1), value)
            return
        # NOTE: whether ScatterNdUpdate accepts a strided page view on device is unconfirmed
        # (references/npu_ops.md); the contiguous layout is the safe default.
        block_size = self.k_cache.shape[1]
        where = torch.stack((slots // block_size, slots % block_size), dim=-1)
        torch_npu.npu_scatter_nd_update_(self.k_cache, where, key)
        torch_npu.npu_scatter_nd_update_(self.v_cache, where, value)


class MiniFlashAttention2(MiniAttention):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.top_left = False

    def forward(self, hidden_states, attention_mask=None, past_key_value=None, output_attentions=False, **kwargs):
        bsz, q_len, query_states, key_states, value_states = self.split(hidden_states)

        # Paged KV: flatten to TND ([T, N, D]), write this step's keys and values at
        # slot_mapping[attn_type], then attend over this attn_type's block table.
        md = get_forward_metadata()
        query_tnd = query_states.transpose(1, 2).reshape(-1, self.num_heads_per_rank, query_states.shape[-1])
        key_tnd = key_states.transpose(1, 2).reshape(-1, self.num_key_value_heads_per_rank, key_states.shape[-1])
        value_tnd = value_states.transpose(1, 2).reshape(-1, self.num_key_value_heads_per_rank, value_states.shape[-1])
        self.update_cache(md.slot_mapping[self.attn_type], key_tnd, value_tnd)
        num_blocks, block_size = self.k_cache.shape[:2]
        attn_output, _ = torch_npu.npu_fused_infer_attention_score(
            query_tnd,
            self.k_cache.view(num_blocks, block_size, -1),
            self.v_cache.view(num_blocks, block_size, -1),
            num_heads=self.num_heads_per_rank,
            num_key_value_heads=self.num_key_value_heads_per_rank,
            input_layout="TND",
            scale=query_states.shape[-1] ** -0.5,
            atten_mask=md.attention_mask,
            sparse_mode=3,
            block_table=md.block_table[self.attn_type],
            block_size=block_size,
            actual_seq_lengths=(md.actual_seq_lengths_cu_list_q or md.actual_seq_lengths_cu_q.tolist()),
            actual_seq_lengths_kv=(md.actual_seq_lengths_list_kv or md.actual_seq_lengths_kv.tolist()),
        )
        attn_output = attn_output.unsqueeze(0)  # [1, T, N, D], as the source kernel returns
        attn_output = attn_output.reshape(bsz, q_len, -1)
        return self.out(attn_output), None, past_key_value

    def update_cache(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write this step's keys and values ([T, num_kv_heads, head_dim]) at their slots.

        slot = block_id * block_size + offset. A contiguous cache is addressed as flat slots
        [num_blocks * block_size, heads, dim]. A page-pool view cannot be flattened (its block
        stride is the page, not block_size * heads * dim), so it is written through its own
        [num_blocks, block_size, heads, dim] form with (block_id, offset) pairs.
        """
        if self.k_cache.is_contiguous() and self.v_cache.is_contiguous():
            heads = self.num_key_value_heads_per_rank
            torch_npu.npu_scatter_nd_update_(self.k_cache.view(-1, heads, key.shape[-1]), slots.view(-1, 1), key)
            torch_npu.npu_scatter_nd_update_(self.v_cache.view(-1, heads, value.shape[-1]), slots.view(-1, 1), value)
            return
        # NOTE: whether ScatterNdUpdate accepts a strided page view on device is unconfirmed
        # (references/npu_ops.md); the contiguous layout is the safe default.
        block_size = self.k_cache.shape[1]
        where = torch.stack((slots // block_size, slots % block_size), dim=-1)
        torch_npu.npu_scatter_nd_update_(self.k_cache, where, key)
        torch_npu.npu_scatter_nd_update_(self.v_cache, where, value)


MINI_ATTENTION_CLASSES = {
    "eager": MiniAttention,
    "sdpa": MiniSdpaAttention,
    "flash_attention_2": MiniFlashAttention2,
}


class MiniForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [MINI_ATTENTION_CLASSES[config._attn_implementation](config, i) for i in range(config.num_hidden_layers)]
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.block_size = 128  # tokens per KV block; the runtime may change it

    def get_cache_info(self) -> ModelCacheInfo:
        """Every attention layer's cache entries, in layer order, for the paged runtime.

        Walks all submodules, so layers held in a ModuleList, a ModuleDict or as sublayers are
        all reported; layer_idx is the position in that walk. A block several decoder layers
        share (zamba's attention) is reported once per layer with its own caches: the layer's
        index is the first number in the path it is found under, the index its forward is
        called with.
        """
        found = [
            (name, module)
            for name, module in self.named_modules(remove_duplicate=False)
            if hasattr(module, "cache_entries")
        ]
        uses = {}
        for _, module in found:
            uses[id(module)] = uses.get(id(module), 0) + 1
        for module in {id(module): module for _, module in found}.values():
            # Loaders may cast the model after __init__: the caches hold what the layer computes.
            # A layer may pin a cache's dtype (a float32 recurrent state in a bfloat16 model).
            param = next(module.parameters(), None)
            pinned = getattr(module, "pinned_cache_dtypes", {})
            for entry in module.cache_entries:
                entry.dtype = pinned.get(entry.cache_name, param.dtype if param is not None else entry.dtype)
                if entry.attn_type in ("FullAttention", "SlidingWindow"):
                    # The run's tokens per block (the runtime may set self.block_size).
                    entry.block_size = self.block_size
        layer_caches, reported = [], set()
        for name, module in found:
            if uses[id(module)] > 1 and hasattr(module, "site_cache_entries"):
                site = next(int(part) for part in name.split(".") if part.isdigit())
                layer_caches.append(module.site_cache_entries(site))
            elif id(module) not in reported:
                layer_caches.append(list(module.cache_entries))
            reported.add(id(module))
        layer_infos = [
            LayerCacheInfo(layer_idx=index, caches=caches) for index, caches in enumerate(layer_caches)
        ]
        return ModelCacheInfo(num_layers=len(layer_infos), layer_infos=layer_infos)

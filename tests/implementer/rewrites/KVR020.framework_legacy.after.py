"""A dense GQA decoder in the shape of the Ascend framework's Legacy attention (test fixture).

Written for kvskill's tests after reading the attention of cann-recipes-infer's Qwen3.5 model
(fbc225d); no code of it. What it keeps of that shape: the executor's model-class contract
(built from ``(config, infer_config, comm_manager)``, fed the packed step as ``input_ids[T]`` /
``position_ids[T]`` with ``forward_metadata``, returning fp32 logits ``[B, 1, V]``), the Legacy
cache (``cache_unit`` rows allocated by ``init_cache`` as ``[batch, max_len, cache_unit]``,
written with ``torch_npu.scatter_update_`` at ``kv_len``) and the BSH fused attention after
packing the TND tokens into one row per request. What it leaves out: tensor parallelism
(plain ``nn.Linear``), gated-delta and MoE layers, quantization and graph capture.
"""

import math

import torch
import torch.nn.functional as F
import torch_npu
import torchair
from executor.utils.forward_metadata import get_forward_metadata, ForwardMetaData
from torch import nn

from .configuration_legacy_gqa import LegacyGqaConfig
from executor.core.kv_cache import CacheEntry


class LegacyGqaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual=None):
        if residual is None:
            return torch_npu.npu_rms_norm(x, self.weight, self.eps)[0], x
        y, _, summed = torch_npu.npu_add_rms_norm(residual, x, self.weight, self.eps)
        return y, summed


class LegacyGqaRotaryEmbedding(nn.Module):
    """cos / sin [T, rotary_dim] of each token's position (halves layout)."""

    def __init__(self, config):
        super().__init__()
        head_dim = config.head_dim
        self.rotary_dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim
        self.register_buffer("inv_freq", 1.0 / (config.rope_theta**exponents), persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class LegacyGqaAttention(nn.Module):
    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_tp_size = infer_config.parallel_config.attn_tp_size
        self.enable_gegraph = infer_config.model_config.exe_mode == "ge_graph"
        self.head_dim = config.head_dim
        self.num_heads_per_rank = config.num_attention_heads // self.attn_tp_size
        self.num_key_value_heads_per_rank = max(config.num_key_value_heads // self.attn_tp_size, 1)
        self.scale_fa = 1.0 / math.sqrt(self.head_dim)
        self.attn_size_per_rank = self.num_heads_per_rank * self.head_dim
        # one projection for q (with its output gate), k and v, as the framework merges them
        self.qkv_proj = nn.Linear(
            config.hidden_size,
            (2 * self.num_heads_per_rank + 2 * self.num_key_value_heads_per_rank) * self.head_dim,
            bias=False,
        )
        self.o_proj = nn.Linear(self.attn_size_per_rank, config.hidden_size, bias=False)
        self.q_norm = LegacyGqaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = LegacyGqaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

        self.k_cache = self.v_cache = torch.Tensor([])
        # Paged KV (the executor's contract): the KV manager allocates one
        # [num_blocks, block_size, num_head, dim] tensor per entry and hands it to tensor_setter;
        # get_cache_info() stamps the scheduler's block size and the layer's dtype on each entry.
        self.attn_type = "FullAttention"
        self.cache_entries = [
            CacheEntry(
                cache_name="k_cache",
                attn_type=self.attn_type,
                dim=(self.head_dim * self.num_key_value_heads_per_rank) // self.num_key_value_heads_per_rank,
                num_head=self.num_key_value_heads_per_rank,
                dtype=torch.get_default_dtype(),
                needs_block=True,
                tensor_setter=self.set_k_cache,
            ),
            CacheEntry(
                cache_name="v_cache",
                attn_type=self.attn_type,
                dim=(self.head_dim * self.num_key_value_heads_per_rank) // self.num_key_value_heads_per_rank,
                num_head=self.num_key_value_heads_per_rank,
                dtype=torch.get_default_dtype(),
                needs_block=True,
                tensor_setter=self.set_v_cache,
            ),
        ]

    def forward(self, hidden_states, position_embeddings, kv_len=None, forward_metadata=None):
        total_tokens = hidden_states.size(0)
        actual_seq_lens = forward_metadata.actual_seq_lengths_q
        bsz = actual_seq_lens.numel()
        qkv_states = self.qkv_proj(hidden_states)

        cos, sin = position_embeddings
        # Paged: the step stays packed. All T tokens form one BSH row, so the per-token code below
        # runs unchanged and the fused attention reads them as TND (no TND -> BSH packing).
        bsz, q_len = 1, total_tokens
        qkv_states = qkv_states.view(bsz, q_len, -1)
        cos = cos.view(bsz, q_len, -1)
        sin = sin.view(bsz, q_len, -1)

        query_states, key_states, value_states = torch.split(
            qkv_states,
            [
                self.num_heads_per_rank * self.head_dim * 2,
                self.num_key_value_heads_per_rank * self.head_dim,
                self.num_key_value_heads_per_rank * self.head_dim,
            ],
            dim=-1,
        )
        query_states, gate = torch.chunk(
            query_states.view(bsz, q_len, -1, self.head_dim * 2), 2, dim=-1
        )
        gate = gate.reshape(bsz, q_len, -1)
        query_states, _ = self.q_norm(query_states)
        key_states, _ = self.k_norm(key_states.view(bsz, q_len, -1, self.head_dim))
        value_states = value_states.view(bsz, q_len, -1, self.head_dim)

        # rotary on the first rotary_dim channels of each head
        rotary_dim = cos.shape[-1]
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        q_rot = torch_npu.npu_rotary_mul(
            query_states[..., :rotary_dim], cos, sin, rotary_mode="half"
        )
        k_rot = torch_npu.npu_rotary_mul(key_states[..., :rotary_dim], cos, sin, rotary_mode="half")
        query_states = torch.cat([q_rot, query_states[..., rotary_dim:]], dim=-1)
        key_states = torch.cat([k_rot, key_states[..., rotary_dim:]], dim=-1)
        query_states = query_states.view(bsz, q_len, -1).contiguous()
        key_states = key_states.view(bsz, q_len, -1).contiguous()
        value_states = value_states.view(bsz, q_len, -1).contiguous()

        k_cache, v_cache = self.k_cache, self.v_cache
        if not k_cache.numel() or not v_cache.numel():
            raise RuntimeError("k_cache / v_cache were never allocated (init_cache)")
        # Paged KV: write this step's keys and values (TND) at slot_mapping[attn_type], then attend
        # over this attn_type's block table; the caches are [num_blocks, block_size, heads, dim].
        md = get_forward_metadata()
        slots = md.slot_mapping[self.attn_type].view(-1, 1)
        query_tnd = query_states.reshape(query_states.shape[0] * query_states.shape[1], self.num_heads_per_rank, -1)
        key_tnd = key_states.reshape(query_tnd.shape[0], self.num_key_value_heads_per_rank, -1)
        value_tnd = value_states.reshape(query_tnd.shape[0], self.num_key_value_heads_per_rank, -1)
        num_blocks, block_size = self.k_cache.shape[:2]
        torch_npu.npu_scatter_nd_update_(self.k_cache.view(-1, self.num_key_value_heads_per_rank, key_tnd.shape[-1]), slots, key_tnd)
        torch_npu.npu_scatter_nd_update_(self.v_cache.view(-1, self.num_key_value_heads_per_rank, value_tnd.shape[-1]), slots, value_tnd)
        attn_output, _ = torch_npu.npu_fused_infer_attention_score(
            query_tnd,
            self.k_cache.view(num_blocks, block_size, -1),
            self.v_cache.view(num_blocks, block_size, -1),
            num_heads=self.num_heads_per_rank,
            num_key_value_heads=self.num_key_value_heads_per_rank,
            input_layout="TND",
            scale=self.scale_fa,
            atten_mask=md.attention_mask,
            sparse_mode=3,
            block_table=md.block_table[self.attn_type],
            block_size=block_size,
            actual_seq_lengths=(md.actual_seq_lengths_cu_list_q or md.actual_seq_lengths_cu_q.tolist()),
            actual_seq_lengths_kv=(md.actual_seq_lengths_list_kv or md.actual_seq_lengths_kv.tolist()),
        )
        attn_output = attn_output.view(bsz, q_len, -1)  # [1, T, N * D], the BSH row it replaced

        attn_output = attn_output.reshape(bsz, q_len, self.attn_size_per_rank)
        attn_output = attn_output * torch.sigmoid(gate)
        # BSH -> TND: drop the padding of the shorter requests again
        attn_output = attn_output.view(total_tokens, -1)
        return self.o_proj(attn_output)

    def set_k_cache(self, tensor: torch.Tensor) -> None:
        """tensor_setter of the k_cache entry: [num_blocks, block_size, num_head, dim]."""
        self.k_cache = tensor

    def set_v_cache(self, tensor: torch.Tensor) -> None:
        """tensor_setter of the v_cache entry: [num_blocks, block_size, num_head, dim]."""
        self.v_cache = tensor


class LegacyGqaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(torch_npu.npu_swiglu(self.gate_up_proj(x), dim=-1))


class LegacyGqaDecoderLayer(nn.Module):
    def __init__(self, config, infer_config, comm_manager, layer_idx):
        super().__init__()
        self.self_attn = LegacyGqaAttention(
            config,
            infer_config,
            comm_manager,
            layer_idx,
            prefix=f"model.layers.{layer_idx}.self_attn",
        )
        self.mlp = LegacyGqaMLP(config)
        self.input_layernorm = LegacyGqaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LegacyGqaRMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )

    def forward(
        self, hidden_states, position_embeddings, kv_len, forward_metadata, past_residual=None
    ):
        hidden_states, residual = self.input_layernorm(hidden_states, past_residual)
        hidden_states = self.self_attn(
            hidden_states,
            position_embeddings=position_embeddings,
            kv_len=kv_len,
            forward_metadata=forward_metadata,
        )
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return residual, self.mlp(hidden_states)


class LegacyGqaTextModel(nn.Module):
    def __init__(self, config, infer_config, comm_manager):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [
                LegacyGqaDecoderLayer(config, infer_config, comm_manager, layer_idx)
                for layer_idx in range(config.num_hidden_layers)
            ]
        )
        self.norm = LegacyGqaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LegacyGqaRotaryEmbedding(config)

    def forward(self, input_ids, position_ids, forward_metadata: ForwardMetaData):
        hidden_states = self.embed_tokens(input_ids)
        position_embeddings = self.rotary_emb(hidden_states, position_ids.view(-1).long())
        kv_len = forward_metadata.kv_len
        residual = None
        for decoder_layer in self.layers:
            residual, hidden_states = decoder_layer(
                hidden_states,
                position_embeddings=position_embeddings,
                kv_len=kv_len,
                forward_metadata=forward_metadata,
                past_residual=residual,
            )
        hidden_states, _ = self.norm(hidden_states, residual)
        # the last token of each request (every token of a decode step)
        if forward_metadata.is_prefill:
            hidden_states = hidden_states[forward_metadata.actual_seq_lengths_cu_q - 1]
        return hidden_states.unsqueeze(1)


class LegacyGqaForCausalLM(nn.Module):
    def __init__(self, config: LegacyGqaConfig, infer_config, comm_manager, prefix=""):
        super().__init__()
        self.config = config
        self.infer_config = infer_config
        self.comm_manager = comm_manager
        self.model = LegacyGqaTextModel(config, infer_config, comm_manager)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, position_ids=None, forward_metadata=None, **kwargs):
        hidden_states = self.model(input_ids, position_ids, forward_metadata)
        return self.lm_head(hidden_states).float()

    def init_cache(self, device):
        """Contiguous Legacy caches: one [max_len, cache_unit] row per batch slot and layer."""
        batch_size = self.infer_config.scheduler_config.batch_size_per_dp_rank
        cache_seq_len = (
            self.infer_config.data_config.input_truncated_len
            + self.infer_config.scheduler_config.max_new_tokens
        )
        dtype = self.lm_head.weight.dtype
        for layer in self.model.layers:
            shape = (batch_size, cache_seq_len, layer.self_attn.cache_unit)
            layer.self_attn.k_cache = torch.empty(shape, dtype=dtype, device=device)
            layer.self_attn.v_cache = torch.empty(shape, dtype=dtype, device=device)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        return loaded

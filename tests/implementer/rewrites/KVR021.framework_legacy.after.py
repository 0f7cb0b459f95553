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
from executor.utils.forward_metadata import ForwardMetaData
from torch import nn

from .configuration_legacy_gqa import LegacyGqaConfig
from executor.core.kv_cache import LayerCacheInfo, ModelCacheInfo


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
        self.cache_unit = self.head_dim * self.num_key_value_heads_per_rank

    def forward(self, hidden_states, position_embeddings, kv_len=None, forward_metadata=None):
        total_tokens = hidden_states.size(0)
        actual_seq_lens = forward_metadata.actual_seq_lengths_q
        is_prefill = forward_metadata.is_prefill
        bsz = actual_seq_lens.numel()
        qkv_states = self.qkv_proj(hidden_states)

        cos, sin = position_embeddings
        if is_prefill:
            # TND -> BSH: request b's token s goes to row b, column s (right-padded)
            cu_seq_lens = F.pad(forward_metadata.actual_seq_lengths_cu_q, (1, 0))
            q_len = int(actual_seq_lens.max().item())
            token_idx = torch.arange(total_tokens, device=qkv_states.device)
            batch_idx = torch.bucketize(token_idx, cu_seq_lens[1:], right=True)
            flat_idx = batch_idx * q_len + token_idx - cu_seq_lens[batch_idx]

            def pack_tnd_to_bsh(tensor):
                packed = tensor.new_zeros(bsz * q_len, tensor.shape[-1])
                packed.index_copy_(0, flat_idx, tensor.reshape(total_tokens, -1))
                return packed.view(bsz, q_len, -1)

            qkv_states = pack_tnd_to_bsh(qkv_states)
            cos = pack_tnd_to_bsh(cos)
            sin = pack_tnd_to_bsh(sin)
        else:
            q_len = total_tokens // bsz
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

        active_k_cache = k_cache[:bsz]
        active_v_cache = v_cache[:bsz]
        # a prefill writes each row from its start; a decode step appends at kv_len
        scatter_kv_len = kv_len.new_zeros((bsz,)) if is_prefill else kv_len[:bsz]
        torch_npu.scatter_update_(active_k_cache, scatter_kv_len, key_states, -2)
        torch_npu.scatter_update_(active_v_cache, scatter_kv_len, value_states, -2)

        if is_prefill:
            attn_output, _ = torch.ops.npu.npu_fused_infer_attention_score(
                query_states,
                key_states,
                value_states,
                num_heads=self.num_heads_per_rank,
                num_key_value_heads=self.num_key_value_heads_per_rank,
                input_layout="BSH",
                scale=self.scale_fa,
                sparse_mode=3,
                atten_mask=forward_metadata.attention_mask,
                next_tokens=0,
            )
        else:
            fa_ops = torchair.ops if self.enable_gegraph else torch.ops.npu
            attn_output, _ = fa_ops.npu_fused_infer_attention_score(
                query_states,
                active_k_cache,
                active_v_cache,
                num_heads=self.num_heads_per_rank,
                num_key_value_heads=self.num_key_value_heads_per_rank,
                input_layout="BSH",
                scale=self.scale_fa,
                actual_seq_lengths_kv=forward_metadata.actual_seq_lengths_kv,
                atten_mask=None,
            )

        attn_output = attn_output.reshape(bsz, q_len, self.attn_size_per_rank)
        attn_output = attn_output * torch.sigmoid(gate)
        # BSH -> TND: drop the padding of the shorter requests again
        if is_prefill:
            attn_output = attn_output.view(bsz * q_len, -1)[flat_idx]
        else:
            attn_output = attn_output.view(total_tokens, -1)
        return self.o_proj(attn_output)


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
        # the caches' tokens per block: get_cache_info() stamps it on every entry
        self.block_size = infer_config.scheduler_config.block_size

    def forward(self, input_ids, position_ids=None, forward_metadata=None, **kwargs):
        hidden_states = self.model(input_ids, position_ids, forward_metadata)
        return self.lm_head(hidden_states).float()

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        return loaded

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

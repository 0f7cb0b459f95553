"""An absorbed-MLA decoder in the shape of the Ascend framework's standalone Legacy MLA model
(test fixture).

Written for kvskill's tests after reading cann-recipes-infer's GLM-5.2 model (``models/glm_5_2``
at fbc225d: ``GlmMoeDsaAttention``, ``GlmMoeDsaForCausalLM.init_cache`` / ``create_cache``,
``prepare_inputs_for_generation``, ``runner_glm.py``); no code of it. What it keeps of that
shape: the model is built from ``(config, runner_settings)``; ``init_cache`` allocates per
layer a latent (nope) cache and a rope cache, each ``[batch * blocks_per_row, block_size, 1,
dim]`` with ``pa_max_length`` / ``pa_block_size`` from the runner settings; the attention holds
the "pseudo-paged" block table ``arange(batch * blocks_per_row).reshape(batch, -1)``, so row b
owns blocks ``b * blocks_per_row ...`` and the caches can be addressed as rows ``[batch,
pa_max_length, dim]``; the latent and rope keys are written into those rows with
``torch_npu.scatter_update_`` (GLM-5.2's context-parallel prefill form, ``axis=1``); the query
is absorbed into the latent space (``kv_b_proj`` split into ``w_k`` / ``w_v``, as
``kv_b_proj_w_k`` / ``kv_b_proj_w_v`` there) and attends over the latent cache with its rope
part passed as ``query_rope`` / ``key_rope`` in TND over the block table.

What it leaves out: the lightning indexer and the sparse attention over its top-k
(GLM-5.2 attends only through ``npu_sparse_flash_attention``; here one dense fused attention
over the same caches stands in for it), ``npu_mla_prolog_v3`` (written out as the math it
fuses: q_a_proj, RMSNorm, q_b_proj, the absorb of the query's nope part, kv_a_proj_with_mqa,
RMSNorm of the latent, rotary of both rope parts), quantization, tensor / context / data
parallelism, MoE, MTP, offload. The runner protocol is the framework's standalone one
(``kv_len`` is where each row's tokens of this step start: 0 in prefill).
"""

import torch
import torch_npu
from torch import nn

from .configuration_legacy_mla import LegacyMlaConfig
from executor.utils.forward_metadata import get_forward_metadata


class LegacyMlaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        return torch_npu.npu_rms_norm(hidden_states, self.weight, self.variance_epsilon)[0]


class LegacyMlaRotaryEmbedding(nn.Module):
    """cos / sin of every position for the 64-wide rope parts; a step reads them by position."""

    def __init__(self, dim, max_position_embeddings, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        positions = torch.arange(max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, position_ids):
        # [B, S, D] by each token's position
        return self.cos_cached[position_ids].to(x.dtype), self.sin_cached[position_ids].to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    return x * cos + rotate_half(x) * sin


class LegacyMlaAttention(nn.Module):
    def __init__(self, config, runner_settings, layer_idx, prefix=""):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_tp_size = runner_settings.get("parallel_config").get("attn_tp_size", 1)
        self.batch_size_per_rank = runner_settings.get("data_config").get("batch_size_per_rank", 1)
        self.num_heads_per_rank = config.num_attention_heads // self.attn_tp_size
        # one latent head shared by every query head
        self.num_key_value_heads_per_rank = 1
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.q_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim

        self.q_a_proj = nn.Linear(config.hidden_size, self.q_lora_rank, bias=False)
        self.q_a_layernorm = LegacyMlaRMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)
        self.q_b_proj = nn.Linear(
            self.q_lora_rank, self.num_heads_per_rank * self.q_head_dim, bias=False
        )
        self.kv_a_proj_with_mqa = nn.Linear(
            config.hidden_size,
            self.kv_lora_rank + self.qk_rope_head_dim,
            bias=config.attention_bias,
        )
        self.kv_a_layernorm = LegacyMlaRMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank,
            self.num_heads_per_rank * (self.qk_nope_head_dim + self.v_head_dim),
            bias=False,
        )
        self.o_proj = nn.Linear(
            self.num_heads_per_rank * self.v_head_dim, config.hidden_size, bias=False
        )
        self.softmax_scale = self.q_head_dim ** (-0.5)

        max_length = runner_settings.get("model_config").get("pa_max_length", 2048)
        self.block_size = runner_settings.get("model_config").get("pa_block_size", 128)
        cache_len = max_length // self.block_size

    def absorbed_kv_b_weights(self):
        """(w_k [N, qk_nope, kv_lora_rank], w_v [N, kv_lora_rank, v_head_dim]) of kv_b_proj."""
        weight = self.kv_b_proj.weight.T.view(
            self.kv_lora_rank, self.num_heads_per_rank, self.qk_nope_head_dim + self.v_head_dim
        )
        w_k, w_v = weight.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        return w_k.permute(1, 2, 0), w_v.transpose(0, 1)

    def forward(
        self,
        hidden_states,
        kv_len=None,
        actual_seq_lengths_q=None,
        actual_seq_lengths_kv=None,
        cos_sin=None,
        attention_mask=None,
        past_key_value=None,
    ):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(bsz, q_len, self.num_heads_per_rank, self.q_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        w_k, w_v = self.absorbed_kv_b_weights()
        # absorb: the query's nope part in the latent space, [B, S, N, kv_lora_rank]
        q_nope = torch.einsum("bsnd,ndr->bsnr", q_nope, w_k)

        latent_cache = self.kv_a_proj_with_mqa(hidden_states)
        k_nope, k_pe = torch.split(latent_cache, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_nope = self.kv_a_layernorm(k_nope)
        cos, sin = cos_sin
        q_pe = apply_rotary(q_pe, cos.unsqueeze(2), sin.unsqueeze(2))
        k_pe = apply_rotary(k_pe, cos, sin)

        nope_cache = past_key_value[self.layer_idx][0]
        rope_cache = past_key_value[self.layer_idx][1]
        # each row's latent and rope keys go to its rows from kv_len on (0 in prefill): the
        # caches [B * cache_len, block_size, 1, D] viewed as rows [B, max_length, D]
        torch_npu.npu_scatter_nd_update_(nope_cache.view(-1, k_nope.shape[-1]), get_forward_metadata().slot_mapping["FullAttention"].view(-1, 1), k_nope.reshape(-1, k_nope.shape[-1]))
        torch_npu.npu_scatter_nd_update_(rope_cache.view(-1, k_pe.shape[-1]), get_forward_metadata().slot_mapping["FullAttention"].view(-1, 1), k_pe.reshape(-1, k_pe.shape[-1]))

        # Paged KV (standalone mode 3, MLA over mode 2): the latent and rope caches read
        # through the step's block table instead of the model's own arange table; the step
        # metadata the model set holds the lengths, the mask and the table.
        md = get_forward_metadata()
        attn_output, _ = torch.ops.npu.npu_fused_infer_attention_score(
            q_nope.reshape(bsz * q_len, self.num_heads_per_rank, self.kv_lora_rank),
            nope_cache.flatten(2),
            nope_cache.flatten(2),
            query_rope=q_pe.reshape(bsz * q_len, self.num_heads_per_rank, self.qk_rope_head_dim),
            key_rope=rope_cache.flatten(2),
            num_heads=self.num_heads_per_rank,
            num_key_value_heads=self.num_key_value_heads_per_rank,
            input_layout="TND",
            scale=self.softmax_scale,
            atten_mask=md.attention_mask,
            sparse_mode=3,
            block_table=md.block_table["FullAttention"],
            block_size=nope_cache.shape[1],
            actual_seq_lengths=(md.actual_seq_lengths_cu_list_q or md.actual_seq_lengths_cu_q.tolist()),
            actual_seq_lengths_kv=(md.actual_seq_lengths_list_kv or md.actual_seq_lengths_kv.tolist()),
        )
        # [T, N, kv_lora_rank] -> [T, N, v_head_dim]
        attn_output = torch.einsum("tnr,nrv->tnv", attn_output, w_v)
        return self.o_proj(attn_output.reshape(bsz, q_len, -1))


class LegacyMlaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(torch_npu.npu_swiglu(self.gate_up_proj(x), dim=-1))


class LegacyMlaDecoderLayer(nn.Module):
    def __init__(self, config, runner_settings, layer_idx, prefix=""):
        super().__init__()
        self.self_attn = LegacyMlaAttention(
            config, runner_settings, layer_idx, prefix=f"{prefix}.self_attn"
        )
        self.mlp = LegacyMlaMLP(config)
        self.input_layernorm = LegacyMlaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LegacyMlaRMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )

    def forward(
        self,
        hidden_states,
        kv_len,
        actual_seq_lengths_q,
        actual_seq_lengths_kv,
        cos_sin,
        attention_mask=None,
        past_key_value=None,
    ):
        residual = hidden_states
        hidden_states = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            kv_len=kv_len,
            actual_seq_lengths_q=actual_seq_lengths_q,
            actual_seq_lengths_kv=actual_seq_lengths_kv,
            cos_sin=cos_sin,
            attention_mask=attention_mask,
            past_key_value=past_key_value,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LegacyMlaModel(nn.Module):
    def __init__(self, config, runner_settings, prefix=""):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            [
                LegacyMlaDecoderLayer(
                    config, runner_settings, layer_idx, prefix=f"model.layers.{layer_idx}"
                )
                for layer_idx in range(config.num_hidden_layers)
            ]
        )
        self.norm = LegacyMlaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LegacyMlaRotaryEmbedding(
            config.qk_rope_head_dim, config.max_position_embeddings, base=config.rope_theta
        )

    def forward(
        self,
        input_ids,
        kv_len=None,
        actual_seq_lengths_q=None,
        actual_seq_lengths_kv=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        is_prefill=False,
    ):
        hidden_states = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                kv_len,
                actual_seq_lengths_q,
                actual_seq_lengths_kv,
                cos_sin=cos_sin,
                attention_mask=attention_mask,
                past_key_value=past_key_values,
            )
        return self.norm(hidden_states)


class LegacyMlaForCausalLM(nn.Module):
    def __init__(self, config: LegacyMlaConfig, runner_settings, prefix=""):
        super().__init__()
        self.config = config
        self.runner_settings = runner_settings
        self.pa_max_length = runner_settings.get("model_config").get("pa_max_length", 2048)
        self.block_size = runner_settings.get("model_config").get("pa_block_size", 128)
        self.model = LegacyMlaModel(config, runner_settings)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids,
        kv_len=None,
        actual_seq_lengths_q=None,
        actual_seq_lengths_kv=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        is_prefill=False,
    ):
        hidden_states = self.model(
            input_ids=input_ids,
            kv_len=kv_len,
            actual_seq_lengths_q=actual_seq_lengths_q,
            actual_seq_lengths_kv=actual_seq_lengths_kv,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            is_prefill=is_prefill,
        )
        if hidden_states.size(1) > 1:
            # prefill: each row's last real token (right padding repeats position 1)
            gather_index, _ = torch.max(position_ids, dim=-1)
            gather_index = gather_index.view(-1, 1, 1).repeat(1, 1, hidden_states.shape[-1])
            hidden_states = torch.gather(hidden_states, 1, gather_index)
        return self.lm_head(hidden_states).float()

    def prefill(self, **kwargs):
        return self.forward(**kwargs)

    def decode(self, **kwargs):
        return self.forward(**kwargs)

    def prepare_inputs_for_generation(
        self,
        input_ids,
        past_key_values=None,
        attention_mask=None,
        is_prefill=None,
        kv_len=None,
        share_mask_tril=None,
        **kwargs,
    ):
        batch_size, seq_len = input_ids.size()
        if past_key_values is None:
            raise ValueError("past_key_values should be initialized first!")
        if is_prefill:
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            kv_len = torch.zeros((batch_size), dtype=torch.int32, device=input_ids.device)
        else:
            position_ids = kv_len.unsqueeze(1)
        # TND: the query tokens of rows 0..b (cumulative), and each row's keys after this step
        actual_seq_lengths_q = torch.tensor(
            [seq_len + i * seq_len for i in range(batch_size)], dtype=torch.int32
        )
        actual_seq_lengths_kv = (kv_len + seq_len).to(torch.int32)
        return {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "past_key_values": past_key_values,
            "attention_mask": share_mask_tril,
            "kv_len": kv_len,
            "actual_seq_lengths_q": actual_seq_lengths_q,
            "actual_seq_lengths_kv": actual_seq_lengths_kv,
            "is_prefill": is_prefill,
        }

    def init_cache(self, input_ids):
        """Legacy MLA caches: per layer a latent (nope) and a rope cache, each
        [batch * cache_len, block_size, 1, dim], addressed as rows through the attention's
        arange block table."""
        batch_size, seq_len = input_ids.size()
        cache_len = self.pa_max_length // self.block_size
        past_key_values = ()
        nope_shape = (batch_size * cache_len, self.block_size, 1, self.config.kv_lora_rank)
        rope_shape = (batch_size * cache_len, self.block_size, 1, self.config.qk_rope_head_dim)
        dtype = self.lm_head.weight.dtype
        for _ in range(self.config.num_hidden_layers):
            cache_nope = torch.zeros(nope_shape, dtype=dtype, device=input_ids.device)
            cache_rope = torch.zeros(rope_shape, dtype=dtype, device=input_ids.device)
            past_key_values += ((cache_nope, cache_rope),)
        return past_key_values

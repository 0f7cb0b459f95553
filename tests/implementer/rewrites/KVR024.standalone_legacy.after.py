"""A dense GQA decoder in the shape of the Ascend framework's standalone Legacy models (test
fixture).

Written for kvskill's tests after reading cann-recipes-infer's openPangu dense model and its
runner (fbc225d); no code of it. What it keeps of that shape: the model is built from
``(config, runner_settings)`` and driven by a runner of its own (``runner_legacy_dense.py``)
that right-pads the prompts into ``input_ids [B, S]``, asks the model for its caches
(``init_cache(input_ids)``: one ``[B, max_len, kv_heads * head_dim]`` BSH tensor per key and
value and layer, returned as ``past_key_values``) and for each step's inputs
(``prepare_inputs_for_generation``: ``kv_len`` 0 in prefill and the row's length in decode,
``actual_seq_lengths_kv`` in decode); the attention writes with ``torch_npu.scatter_update_``
at ``kv_len`` and attends in BSH (prefill over this step's states with ``sparse_mode=2``,
decode over the cache rows). What it leaves out: tensor and data parallelism (plain
``nn.Linear``), quantization, graph capture, the rotary scaling variants, the MoE branch.
"""

import torch
import torch_npu
from torch import nn

from .configuration_legacy_dense import LegacyDenseConfig
from executor.utils.forward_metadata import get_forward_metadata


class LegacyDenseRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states, residual=None):
        if residual is None:
            return torch_npu.npu_rms_norm(hidden_states, self.weight, self.variance_epsilon)[
                0
            ], hidden_states
        normed, _, summed = torch_npu.npu_add_rms_norm(
            residual, hidden_states, self.weight, self.variance_epsilon
        )
        return normed, summed


class LegacyDenseRotaryEmbedding(nn.Module):
    """cos / sin tables of every position; a step reads rows by physical cache position."""

    def __init__(self, dim, max_position_embeddings, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        positions = torch.arange(max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, seq_len, kv_len):
        batch_size = x.size(0)
        if seq_len == 1:
            # decode: the row's next position, [B, 1, 1, D]
            cos = torch.index_select(self.cos_cached, 0, kv_len).unsqueeze(1).unsqueeze(1)
            sin = torch.index_select(self.sin_cached, 0, kv_len).unsqueeze(1).unsqueeze(1)
        else:
            # prefill: positions 0 .. seq_len - 1 of every (right-padded) row, [B, S, 1, D]
            cos = self.cos_cached[:seq_len].unsqueeze(0).unsqueeze(2).repeat(batch_size, 1, 1, 1)
            sin = self.sin_cached[:seq_len].unsqueeze(0).unsqueeze(2).repeat(batch_size, 1, 1, 1)
        return cos.to(x.dtype), sin.to(x.dtype)


class LegacyDenseAttention(nn.Module):
    def __init__(self, config, runner_settings, layer_idx, prefix=""):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_tp_size = runner_settings.get("parallel_config").get("attn_tp_size", 1)
        self.num_heads_per_rank = config.num_attention_heads // self.attn_tp_size
        self.num_key_value_heads_per_rank = max(config.num_key_value_heads // self.attn_tp_size, 1)
        self.head_dim = config.head_dim
        self.attn_intermediate_size_per_rank = self.num_heads_per_rank * self.head_dim
        # q, k and v in one projection, as the framework merges them
        self.merged_qkv_proj = nn.Linear(
            config.hidden_size,
            (self.num_heads_per_rank + 2 * self.num_key_value_heads_per_rank) * self.head_dim,
            bias=config.bias,
        )
        self.o_proj = nn.Linear(
            self.attn_intermediate_size_per_rank, config.hidden_size, bias=config.bias
        )
        self.scale_fa = 1 / (self.head_dim**0.5)

    def exec_qkv(
        self,
        qkv,
        kv_len=None,
        actual_seq_lengths_kv=None,
        cos_sin=None,
        attention_mask=None,
        past_key_value=None,
    ):
        bsz, q_len, _ = qkv.size()
        query_states, key_states, value_states = qkv.split(
            (
                self.num_heads_per_rank * self.head_dim,
                self.num_key_value_heads_per_rank * self.head_dim,
                self.num_key_value_heads_per_rank * self.head_dim,
            ),
            dim=2,
        )
        query_states = query_states.view(
            bsz, q_len, self.num_heads_per_rank, self.head_dim
        ).contiguous()
        key_states = key_states.view(
            bsz, q_len, self.num_key_value_heads_per_rank, self.head_dim
        ).contiguous()

        cos, sin = cos_sin
        query_states, key_states = torch_npu.npu_apply_rotary_pos_emb(
            query_states, key_states, cos, sin, layout="BSH"
        )
        query_states = query_states.view(bsz, q_len, -1)
        key_states = key_states.view(bsz, q_len, -1)

        past_key, past_value = None, None
        if past_key_value is not None:
            past_key = past_key_value[self.layer_idx][0]
            past_value = past_key_value[self.layer_idx][1]
            # each row's tokens go to its cache from kv_len on (0 in prefill)
            torch_npu.npu_scatter_nd_update_(past_key.view(-1, key_states.shape[-1]), get_forward_metadata().slot_mapping["FullAttention"].view(-1, 1), key_states.reshape(-1, key_states.shape[-1]))
            torch_npu.npu_scatter_nd_update_(past_value.view(-1, value_states.shape[-1]), get_forward_metadata().slot_mapping["FullAttention"].view(-1, 1), value_states.reshape(-1, value_states.shape[-1]))

        # Paged KV (standalone mode 2): one TND fused attention over the static block table, for
        # prefill and decode alike; the step metadata the model set for this step holds the lengths
        # and tables, and the caches are [total_blocks, block_size, kv_heads * head_dim].
        md = get_forward_metadata()
        attn_output, _ = torch_npu.npu_fused_infer_attention_score(
            query_states.reshape(-1, self.num_heads_per_rank, query_states.shape[-1] // self.num_heads_per_rank),
            past_key,
            past_value,
            num_heads=self.num_heads_per_rank,
            num_key_value_heads=self.num_key_value_heads_per_rank,
            input_layout="TND",
            scale=self.scale_fa,
            atten_mask=md.attention_mask,
            sparse_mode=3,
            block_table=md.block_table["FullAttention"],
            block_size=past_key.shape[1],
            actual_seq_lengths=(md.actual_seq_lengths_cu_list_q or md.actual_seq_lengths_cu_q.tolist()),
            actual_seq_lengths_kv=(md.actual_seq_lengths_list_kv or md.actual_seq_lengths_kv.tolist()),
        )
        attn_output = attn_output.view(*query_states.shape[:-1], -1)  # [T, N, D] -> the BSH shape it replaced
        attn_output = attn_output.reshape(bsz, q_len, self.attn_intermediate_size_per_rank)
        return self.o_proj(attn_output)

    def forward(
        self,
        hidden_states,
        kv_len=None,
        actual_seq_lengths_kv=None,
        cos_sin=None,
        attention_mask=None,
        past_key_value=None,
    ):
        qkv = self.merged_qkv_proj(hidden_states)
        return self.exec_qkv(
            qkv=qkv,
            kv_len=kv_len,
            actual_seq_lengths_kv=actual_seq_lengths_kv,
            cos_sin=cos_sin,
            attention_mask=attention_mask,
            past_key_value=past_key_value,
        )


class LegacyDenseMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(torch_npu.npu_swiglu(self.gate_up_proj(x), dim=-1))


class LegacyDenseDecoderLayer(nn.Module):
    def __init__(self, config, runner_settings, layer_idx, prefix=""):
        super().__init__()
        self.self_attn = LegacyDenseAttention(
            config, runner_settings, layer_idx, prefix=f"{prefix}.self_attn"
        )
        self.mlp = LegacyDenseMLP(config)
        self.input_layernorm = LegacyDenseRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LegacyDenseRMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )

    def forward(
        self,
        hidden_states,
        kv_len,
        actual_seq_lengths_kv,
        cos_sin,
        attention_mask=None,
        past_key_value=None,
        past_residual=None,
    ):
        hidden_states, residual = self.input_layernorm(hidden_states, past_residual)
        hidden_states = self.self_attn(
            hidden_states=hidden_states,
            kv_len=kv_len,
            actual_seq_lengths_kv=actual_seq_lengths_kv,
            cos_sin=cos_sin,
            attention_mask=attention_mask,
            past_key_value=past_key_value,
        )
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return residual, self.mlp(hidden_states)


class LegacyDenseModel(nn.Module):
    def __init__(self, config, runner_settings, prefix=""):
        super().__init__()
        self.config = config
        self.max_position_embeddings = runner_settings.get("data_config").get(
            "max_position_embeddings", config.max_position_embeddings
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            [
                LegacyDenseDecoderLayer(
                    config, runner_settings, layer_idx, prefix=f"model.layers.{layer_idx}"
                )
                for layer_idx in range(config.num_hidden_layers)
            ]
        )
        self.norm = LegacyDenseRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LegacyDenseRotaryEmbedding(
            config.head_dim, self.max_position_embeddings, base=config.rope_theta
        )

    def forward(
        self,
        input_ids,
        kv_len=None,
        actual_seq_lengths_kv=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        is_prefill=False,
    ):
        batch_size, seq_length = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb(hidden_states, seq_length, kv_len)
        residual = None
        for decoder_layer in self.layers:
            residual, hidden_states = decoder_layer(
                hidden_states,
                kv_len,
                actual_seq_lengths_kv,
                cos_sin=cos_sin,
                attention_mask=attention_mask,
                past_key_value=past_key_values,
                past_residual=residual,
            )
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LegacyDenseForCausalLM(nn.Module):
    def __init__(self, config: LegacyDenseConfig, runner_settings, prefix=""):
        super().__init__()
        self.config = config
        self.runner_settings = runner_settings
        self.attn_tp_size = runner_settings.get("parallel_config").get("attn_tp_size", 1)
        self.model = LegacyDenseModel(config, runner_settings)
        self.max_position_embeddings = self.model.max_position_embeddings
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids,
        kv_len=None,
        actual_seq_lengths_kv=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        is_prefill=False,
    ):
        hidden_states = self.model(
            input_ids=input_ids,
            kv_len=kv_len,
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
            attention_mask = share_mask_tril
            kv_len = torch.zeros((batch_size), dtype=torch.int32, device=input_ids.device)
            actual_seq_lengths_kv = None
        else:
            attention_mask = None
            position_ids = kv_len.unsqueeze(1)
            actual_seq_lengths_kv = (kv_len + 1).detach().cpu().numpy().tolist()
        return {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "past_key_values": past_key_values,
            "attention_mask": attention_mask,
            "kv_len": kv_len,
            "actual_seq_lengths_kv": actual_seq_lengths_kv,
            "is_prefill": is_prefill,
        }

    def init_cache(self, input_ids):
        """Legacy caches: per layer one key and one value row tensor
        [batch, max_position_embeddings, kv_heads * head_dim] (BSH)."""
        batch_size, seq_len = input_ids.size()
        cache_seq_len = self.max_position_embeddings
        past_key_values = ()
        cache_shape = (
            batch_size,
            cache_seq_len,
            self.config.head_dim * max(self.config.num_key_value_heads // self.attn_tp_size, 1),
        )
        dtype = self.lm_head.weight.dtype
        for _ in range(self.config.num_hidden_layers):
            key_cache = torch.zeros(cache_shape, dtype=dtype, device=input_ids.device)
            value_cache = torch.zeros(cache_shape, dtype=dtype, device=input_ids.device)
            past_key_values += ((key_cache, value_cache),)
        return past_key_values

"""GQA attention and gated-delta layers in the shape of the Ascend framework's Legacy Qwen3.5
(test fixture).

Written for kvskill's tests after reading cann-recipes-infer's Qwen3.5-MoE model (fbc225d); no
code of it. What it keeps of that shape: the executor's model-class contract (built from
``(config, infer_config, comm_manager)``, fed the packed step as ``input_ids[T]`` /
``position_ids[T]`` with ``forward_metadata``, returning fp32 logits ``[B, 1, V]``), the
``layer_types`` pattern of three gated-delta layers and one full-attention layer, the Legacy
attention (``cache_unit`` rows written with ``torch_npu.scatter_update_`` at ``kv_len``, BSH
fused attention after packing the TND tokens) and the Legacy gated-delta states: ``init_cache``
allocates ``conv_state`` ``[batch, conv_dim, kernel]`` and ``recurrent_state`` ``[batch, Nv,
Dv, Dk]`` on every gated-delta layer, row b belonging to request b of the static batch; the
prefill helper overwrites them (``copy_``), the decode helper shifts the conv state in place and
runs ``torch_npu.npu_recurrent_gated_delta_rule`` over the rows ``arange(batch)``. What it
leaves out: tensor parallelism (plain ``nn.Linear``), MoE, quantization, graph capture, the
decode scratch buffer and the prefill fallback without the fused chunk kernel.
"""

import math

import torch
import torch.nn.functional as F
import torch_npu
import torchair
from executor.utils.forward_metadata import get_forward_metadata, ForwardMetaData
from torch import nn

from .configuration_legacy_gated_delta import LegacyGatedDeltaConfig
from executor.core.kv_cache import MambaCacheEntry


def causal_conv1d_update(hidden_states, conv_state, weight, bias=None):
    """Depthwise causal conv of the new tokens [B, C, S] after the window conv_state [B, C, K];
    the window is shifted in place."""
    channels, seq_len = hidden_states.shape[1], hidden_states.shape[2]
    window = torch.cat([conv_state, hidden_states], dim=-1)
    conv_state.copy_(window[:, :, -conv_state.shape[-1] :])
    out = F.conv1d(window, weight.unsqueeze(1), bias, groups=channels)
    return F.silu(out[:, :, -seq_len:])


class LegacyGatedDeltaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual=None):
        if residual is None:
            return torch_npu.npu_rms_norm(x, self.weight, self.eps)[0], x
        y, _, summed = torch_npu.npu_add_rms_norm(residual, x, self.weight, self.eps)
        return y, summed


class LegacyGatedDeltaRotaryEmbedding(nn.Module):
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


class LegacyGatedDeltaAttention(nn.Module):
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
        self.q_norm = LegacyGatedDeltaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = LegacyGatedDeltaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

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


class LegacyGatedDeltaRMSNormGated(nn.Module):
    """RMS norm of the rule's output, gated by silu(z)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, gate):
        normed = torch_npu.npu_rms_norm(x, self.weight, self.eps)[0]
        return normed * F.silu(gate)


class LegacyGatedDeltaNet(nn.Module):
    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_tp_size = infer_config.parallel_config.attn_tp_size
        self.num_v_heads = config.linear_num_value_heads // self.attn_tp_size
        self.num_k_heads = config.linear_num_key_heads // self.attn_tp_size
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.conv_dim = self.key_dim * 2 + self.value_dim
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=self.conv_kernel_size,
            groups=self.conv_dim,
            padding=self.conv_kernel_size - 1,
            bias=False,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 8.0, self.num_v_heads)))
        # q, k, v, the output gate z, then b (beta) and a (decay) per value head
        self.in_proj_qkvz = nn.Linear(
            config.hidden_size, self.conv_dim + self.value_dim, bias=False
        )
        self.in_proj_ba = nn.Linear(config.hidden_size, 2 * self.num_v_heads, bias=False)
        self.norm = LegacyGatedDeltaRMSNormGated(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, config.hidden_size, bias=False)

        # the decode kernel's per-row lengths and state rows: row b is request b
        self.decode_batch_size = infer_config.scheduler_config.batch_size_per_dp_rank
        self.gdn_actual_seq_lengths = torch.ones(self.decode_batch_size, dtype=torch.int32)
        self.gdn_ssm_state_indices = torch.arange(self.decode_batch_size, dtype=torch.int32)

        self.attn_type = "Mamba"
        # States whose dtype the source model fixes whatever the weights' dtype; get_cache_info()
        # leaves these entries' dtypes alone and gives the others the layer's dtype.
        self.pinned_cache_dtypes = {}
        self.conv_state = torch.Tensor([])
        self.recurrent_state = torch.Tensor([])
        self.cache_entries = [
            MambaCacheEntry(
                needs_block=True,
                cache_name="conv_state",
                # one request's row of the Legacy conv_state (init_cache line 469)
                shape=[self.conv_dim, self.conv_kernel_size],
                dtype=torch.get_default_dtype(),
                tensor_setter=self.set_conv_state,
            ),
            MambaCacheEntry(
                needs_block=True,
                cache_name="recurrent_state",
                # one request's row of the Legacy recurrent_state (init_cache line 474)
                shape=[self.num_v_heads, self.head_v_dim, self.head_k_dim],
                dtype=torch.get_default_dtype(),
                tensor_setter=self.set_recurrent_state,
            ),
        ]

    def _split(self, fused_proj):
        return torch.split(
            fused_proj,
            [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads],
            dim=-1,
        )

    def _rule_inputs(self, mixed_qkv, b, a):
        """L2-normed query / key [T, Nk, Dk], value [T, Nv, Dv], beta and log decay [T, Nv]."""
        query, key, value = torch.split(
            mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1
        )
        query = F.normalize(query.reshape(-1, self.num_k_heads, self.head_k_dim), p=2, dim=-1)
        key = F.normalize(key.reshape(-1, self.num_k_heads, self.head_k_dim), p=2, dim=-1)
        value = value.reshape(-1, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return query, key, value, beta, g

    def _forward_prefill(self, fused_proj, forward_metadata):
        # Paged states: request b of this step keeps each state of this layer in block
        # block_table["Mamba"][b, 0] of its [num_blocks, ...] cache (the Legacy rows were row b).
        md = get_forward_metadata()
        state_index = md.block_table[self.attn_type][:, 0].long()
        # This path overwrites the states as the Legacy prefill did: it starts each request from a
        # fresh state, so a request with tokens already cached (a chunked prefill, a prefix hit)
        # would lose them.
        if bool((md.actual_seq_lengths_kv > md.actual_seq_lengths_q).any()):
            raise RuntimeError(
                "LegacyGatedDeltaNet._forward_prefill: "
                "the converted Legacy prefill starts every request from a fresh state; a step with "
                "tokens already cached (chunked prefill, prefix caching) is not supported"
            )
        conv_state = self.conv_state
        recurrent_state = self.recurrent_state

        actual_seq_lens = forward_metadata.actual_seq_lengths_q
        cu_seq_lens = F.pad(forward_metadata.actual_seq_lengths_cu_q, (1, 0))
        num_requests = actual_seq_lens.numel()
        max_seq_len = int(actual_seq_lens.max().item())
        mixed_qkv, z, b, a = self._split(fused_proj)

        # TND -> one right-padded row per request for the conv: [B, C, S]
        token_idx = torch.arange(fused_proj.shape[0], device=fused_proj.device)
        batch_idx = torch.bucketize(token_idx, cu_seq_lens[1:], right=True)
        flat_idx = batch_idx * max_seq_len + token_idx - cu_seq_lens[batch_idx]
        rows = mixed_qkv.new_zeros(num_requests * max_seq_len, self.conv_dim)
        rows.index_copy_(0, flat_idx, mixed_qkv)
        rows = rows.view(num_requests, max_seq_len, self.conv_dim).transpose(1, 2)

        # each row's conv window: its last kernel inputs, zero-padded on the left
        padded = F.pad(rows, (self.conv_kernel_size, 0))
        window_idx = actual_seq_lens.view(-1, 1) + torch.arange(self.conv_kernel_size)
        window = torch.gather(padded, 2, window_idx[:, None, :].expand(-1, self.conv_dim, -1))
        conv_state[state_index] = window.to(conv_state.dtype)

        mixed_qkv = F.silu(self.conv1d(rows)[:, :, :max_seq_len])
        mixed_qkv = mixed_qkv.transpose(1, 2).reshape(-1, self.conv_dim)[flat_idx]

        query, key, value, beta, g = self._rule_inputs(mixed_qkv, b, a)
        initial_state = query.new_zeros(
            num_requests, self.num_v_heads, self.head_v_dim, self.head_k_dim
        )
        core_attn_out, last_recurrent_state = torch_npu.npu_chunk_gated_delta_rule(
            query,
            key,
            value,
            beta=beta,
            initial_state=initial_state,
            actual_seq_lengths=actual_seq_lens.to(torch.int32),
            scale=1.0 / math.sqrt(self.head_k_dim),
            g=g,
        )
        recurrent_state[state_index] = last_recurrent_state.to(recurrent_state.dtype)
        return core_attn_out, z

    def _forward_decode(self, fused_proj):
        # Paged states: request b of this step keeps each state of this layer in block
        # block_table["Mamba"][b, 0] of its [num_blocks, ...] cache (the Legacy rows were row b).
        md = get_forward_metadata()
        state_index = md.block_table[self.attn_type][:, 0].long()
        conv_state = self.conv_state
        recurrent_state = self.recurrent_state

        batch_size = fused_proj.shape[0]
        mixed_qkv, z, b, a = self._split(fused_proj)
        conv_state_step = conv_state[state_index]  # this step's requests' states, in step order
        mixed_qkv = causal_conv1d_update(
            mixed_qkv.view(batch_size, self.conv_dim, 1),
            conv_state_step,
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
        )
        conv_state[state_index] = conv_state_step
        mixed_qkv = mixed_qkv.view(batch_size, self.conv_dim)
        query, key, value, beta, g = self._rule_inputs(mixed_qkv, b, a)
        core_attn_out = torch_npu.npu_recurrent_gated_delta_rule(
            query,
            key,
            value,
            recurrent_state,
            beta=beta,
            scale=1.0 / math.sqrt(self.head_k_dim),
            actual_seq_lengths=md.actual_seq_lengths_q.to(torch.int32),
            ssm_state_indices=state_index.to(torch.int32),
            g=g,
        )
        return core_attn_out, z

    def forward(self, hidden_states, forward_metadata=None):
        fused_proj = torch.cat(
            [self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)], dim=-1
        )
        if forward_metadata.is_prefill:
            core_attn_out, z = self._forward_prefill(fused_proj, forward_metadata)
        else:
            core_attn_out, z = self._forward_decode(fused_proj)
        core_attn_out = self.norm(
            core_attn_out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim)
        )
        return self.out_proj(core_attn_out.view(-1, self.value_dim))

    def set_conv_state(self, tensor: torch.Tensor) -> None:
        """tensor_setter of the conv_state entry: [num_blocks, *[self.conv_dim, self.conv_kernel_size]]."""
        self.conv_state = tensor

    def set_recurrent_state(self, tensor: torch.Tensor) -> None:
        """tensor_setter of the recurrent_state entry: [num_blocks, *[self.num_v_heads, self.head_v_dim, self.head_k_dim]]."""
        self.recurrent_state = tensor


class LegacyGatedDeltaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(torch_npu.npu_swiglu(self.gate_up_proj(x), dim=-1))


class LegacyGatedDeltaDecoderLayer(nn.Module):
    def __init__(self, config, infer_config, comm_manager, layer_idx):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = LegacyGatedDeltaNet(
                config,
                infer_config,
                comm_manager,
                layer_idx,
                prefix=f"model.layers.{layer_idx}.linear_attn",
            )
        else:
            self.self_attn = LegacyGatedDeltaAttention(
                config,
                infer_config,
                comm_manager,
                layer_idx,
                prefix=f"model.layers.{layer_idx}.self_attn",
            )
        self.mlp = LegacyGatedDeltaMLP(config)
        self.input_layernorm = LegacyGatedDeltaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LegacyGatedDeltaRMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )

    def forward(
        self, hidden_states, position_embeddings, kv_len, forward_metadata, past_residual=None
    ):
        hidden_states, residual = self.input_layernorm(hidden_states, past_residual)
        if self.layer_type == "linear_attention":
            hidden_states = self.linear_attn(hidden_states, forward_metadata=forward_metadata)
        else:
            hidden_states = self.self_attn(
                hidden_states,
                position_embeddings=position_embeddings,
                kv_len=kv_len,
                forward_metadata=forward_metadata,
            )
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return residual, self.mlp(hidden_states)


class LegacyGatedDeltaTextModel(nn.Module):
    def __init__(self, config, infer_config, comm_manager):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [
                LegacyGatedDeltaDecoderLayer(config, infer_config, comm_manager, layer_idx)
                for layer_idx in range(config.num_hidden_layers)
            ]
        )
        self.norm = LegacyGatedDeltaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LegacyGatedDeltaRotaryEmbedding(config)

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


class LegacyGatedDeltaForCausalLM(nn.Module):
    def __init__(self, config: LegacyGatedDeltaConfig, infer_config, comm_manager, prefix=""):
        super().__init__()
        self.config = config
        self.infer_config = infer_config
        self.comm_manager = comm_manager
        self.model = LegacyGatedDeltaTextModel(config, infer_config, comm_manager)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, position_ids=None, forward_metadata=None, **kwargs):
        hidden_states = self.model(input_ids, position_ids, forward_metadata)
        return self.lm_head(hidden_states).float()

    def init_cache(self, device):
        """Legacy caches, one row per batch slot: the gated-delta layers' conv / recurrent
        states, the attention layers' [max_len, cache_unit] K / V rows."""
        batch_size = self.infer_config.scheduler_config.batch_size_per_dp_rank
        cache_seq_len = (
            self.infer_config.data_config.input_truncated_len
            + self.infer_config.scheduler_config.max_new_tokens
        )
        dtype = self.lm_head.weight.dtype
        for layer in self.model.layers:
            if layer.layer_type == "linear_attention":
                layer.linear_attn.conv_state = torch.zeros(
                    (batch_size, layer.linear_attn.conv_dim, layer.linear_attn.conv_kernel_size),
                    dtype=dtype,
                    device=device,
                )
                layer.linear_attn.recurrent_state = torch.zeros(
                    (
                        batch_size,
                        layer.linear_attn.num_v_heads,
                        layer.linear_attn.head_v_dim,
                        layer.linear_attn.head_k_dim,
                    ),
                    dtype=dtype,
                    device=device,
                )
            else:
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

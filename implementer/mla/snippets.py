"""The code the MLA codemods insert, as jinja2 templates rendered strictly and parsed by libcst.

Templates are written at column 0 (libcst re-indents them where they are inserted); methods
live in a ``class _Snippet:`` so their docstrings carry their final indentation.
"""

from __future__ import annotations

import jinja2
from kvskill.implementer.snippets import Snippets

INIT = """\
# Paged MLA KV cache (absorbed): each token caches one latent head, shared by every query
# head: the normalised latent (kv_lora_rank) in nope_cache and the rotated shared key
# (qk_rope_head_dim) in rope_cache. The runtime allocates each as
# [num_blocks, block_size, 1, dim] and injects it through tensor_setter; writes and the
# fused attention address that memory in the NZ layout [num_blocks, dim // C0, block_size, C0].
self.attn_type = "{{ attn_type }}"
self.attn_tp_size = {{ attn_tp_size }}  # attention tensor-parallel size the query heads are split over
self.num_heads_per_rank = {{ config }}.num_attention_heads // self.attn_tp_size
# The latent is not split across attention tensor-parallel ranks: one head on every rank.
self.num_key_value_heads_per_rank = 1
self.mla_nope_head_dim = {{ config }}.qk_nope_head_dim
self.mla_v_head_dim = {{ config }}.v_head_dim
self.nope_cache = torch.Tensor([])
self.rope_cache = torch.Tensor([])
# (weights key, W_uk, W_uv) split from {{ kv_b_proj }} by absorbed_kv_b_proj() once the weights
# are loaded; never here, where the weights are still uninitialised.
self.mla_absorbed = None
self.cache_entries = [
{% for name, dim in entries %}
    CacheEntry(
        cache_name="{{ name }}",
        attn_type=self.attn_type,
        dim={{ dim }},
        num_head=self.num_key_value_heads_per_rank,
        # NOTE: models are built under their compute dtype (torch.set_default_dtype).
        dtype=torch.get_default_dtype(),
        tensor_setter=self.set_{{ name }},
    ),
{% endfor %}
]
"""

METHODS = '''\
class _Snippet:  # methods for an existing class; only the body is inserted
    def set_nope_cache(self, tensor: torch.Tensor) -> None:
        """tensor_setter of nope_cache: [num_blocks, block_size, 1, kv_lora_rank]."""
        self.nope_cache = tensor


    def set_rope_cache(self, tensor: torch.Tensor) -> None:
        """tensor_setter of rope_cache: [num_blocks, block_size, 1, qk_rope_head_dim]."""
        self.rope_cache = tensor


    def absorbed_kv_b_proj(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk [N, nope, rank] and W_uv [N, v, rank], split from {{ kv_b_proj }}.weight.

        The weight is [N * (nope + v), rank]: per head, nope rows that turn the latent into
        the key and v rows that turn it into the value. The split is made on the first
        forward and again only when the weight is replaced or written in place (its storage,
        version counter, dtype or device changes), i.e. once after the weights are loaded.
        """
        weight = self.{{ kv_b_proj }}.weight
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        if self.mla_absorbed is None or self.mla_absorbed[0] != key:
            per_head = weight.detach().view(-1, self.mla_nope_head_dim + self.mla_v_head_dim, weight.shape[-1])
            w_uk = per_head[:, : self.mla_nope_head_dim].contiguous()
            w_uv = per_head[:, self.mla_nope_head_dim :].contiguous()
            self.mla_absorbed = (key, w_uk, w_uv)
        return self.mla_absorbed[1], self.mla_absorbed[2]


    @staticmethod
    def nz_view(cache: torch.Tensor) -> torch.Tensor:
        """[num_blocks, block_size, 1, dim] -> the fused attention's 5-D NZ view.

        Element (block, t, d) of an NZ cache lives at [block, 0, d // C0, t, d % C0] with
        C0 = 16 for fp16/bf16 (32 for int8): a plain view of the same memory, no copy.
        unconfirmed: C0 for fp32 caches on the device (16 is used, as for fp16).
        """
        num_blocks, block_size, _, dim = cache.shape
        c0 = 32 if cache.dtype == torch.int8 else 16
        return cache.view(num_blocks, 1, dim // c0, block_size, c0)
{% if scatter %}


    def update_latent_cache(self, slots: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor) -> None:
        """Write this step's latent [T, rank] and rotated key [T, rope] at their slots, NZ.

        A token's dim channels sit in dim // C0 rows of C0 elements, block_size rows apart:
        slot = block * block_size + t  ->  row block * (dim // C0) * block_size + c * block_size + t
        for chunk c, in the cache viewed as [rows, C0]. Example: block_size 16, dim 64, slot 35
        (block 2, t 3): rows 131, 147, 163, 179.
        """
        for cache, value in ((self.nope_cache, latent), (self.rope_cache, rope_key)):
            num_blocks, block_size, _, dim = cache.shape
            c0 = 32 if cache.dtype == torch.int8 else 16
            chunks = torch.arange(dim // c0, device=slots.device).view(1, -1)
            block, offset = (slots // block_size).view(-1, 1), (slots % block_size).view(-1, 1)
            rows = block * (dim // c0 * block_size) + chunks * block_size + offset  # [T, dim // C0]
            torch_npu.npu_scatter_nd_update_(
                cache.view(-1, c0), rows.view(-1, 1), value.reshape(-1, c0).to(cache.dtype)
            )
{% endif %}
'''

SEAM = """\
# Paged MLA, absorbed: attention runs on the latent cache (key = value = nope_cache, the rope
# key passed apart). q_nope . k_nope = (q_nope W_uk) . latent, so the query absorbs W_uk; the
# output is the latent mix, projected per head by W_uv.
md = get_forward_metadata()
w_uk, w_uv = self.absorbed_kv_b_proj()
{% if query_parts %}
q_nope_tnd = {{ q_nope }}.transpose(1, 2).reshape(-1, self.num_heads_per_rank, {{ q_nope }}.shape[-1])  # [T, N, nope]
q_rope_tnd = {{ q_rope }}.transpose(1, 2).reshape(-1, self.num_heads_per_rank, {{ q_rope }}.shape[-1])  # [T, N, rope]
{% else %}
query_tnd = {{ query }}.transpose(1, 2).reshape(-1, self.num_heads_per_rank, {{ query }}.shape[-1])
rope_dim = self.rope_cache.shape[-1]
q_nope_tnd, q_rope_tnd = query_tnd[..., :-rope_dim], query_tnd[..., -rope_dim:]
{% endif %}
query_latent = torch.bmm(q_nope_tnd.transpose(0, 1), w_uk).transpose(0, 1)  # [T, N, rank]
slots = md.slot_mapping[self.attn_type]
{% if scatter %}
self.update_latent_cache(slots, {{ latent }}.reshape(-1, {{ latent }}.shape[-1]), {{ rope_key }}.reshape(-1, {{ rope_key }}.shape[-1]))
{% else %}
# RMSNorm of the latent, rope of the shared key and the paged NZ write in one operator.
torch_npu.npu_kv_rmsnorm_rope_cache(
    {{ raw }}.reshape(-1, 1, 1, {{ raw }}.shape[-1]),
    self.{{ norm }}.{{ norm_weight }},
    {{ cos }}.reshape(-1, 1, 1, {{ cos }}.shape[-1]),
    {{ sin }}.reshape(-1, 1, 1, {{ sin }}.shape[-1]),
    slots,
    self.rope_cache,
    self.nope_cache,
    epsilon=self.{{ norm }}.{{ norm_eps }},
    cache_mode="PA_NZ",
)
{% endif %}
nope_nz = self.nz_view(self.nope_cache)
# Prefill: causal (sparse_mode 3, 2048 tile); decode: one query per request, dense (0, no mask).
# unconfirmed: the operator docs list per-request query lengths 1..16 for query D 512 in TND;
# if the device enforces that for prefill too, long prompts need chunks of at most 16 tokens.
attn_latent, _ = torch_npu.{{ op }}(
    query_latent,
    nope_nz,
    nope_nz,
{% for key, value in kwargs %}
    {{ key }}={{ value }},
{% endfor %}
)
{% if bnsd %}
{{ output }} = torch.bmm(attn_latent, w_uv.transpose(1, 2)).unsqueeze(0)  # [1, N, T, v], as the source kernel returns
{% else %}
{{ output }} = torch.bmm(attn_latent, w_uv.transpose(1, 2)).transpose(0, 1).unsqueeze(0)  # [1, T, N, v], as the source kernel returns
{% endif %}
{% for name in extra_outputs %}
{{ name }} = None
{% endfor %}
"""

CACHE_INFO = '''\
class _Snippet:  # methods for an existing class; only the body is inserted
    def get_cache_info(self) -> ModelCacheInfo:
        """Every attention layer's latent caches (nope + rope), in layer order.

        is_mla_backend=True: each rank holds the whole latent, so e.g. a KV transfer moves it
        from a single rank.
        """
        attentions = [module for module in self.modules() if hasattr(module, "cache_entries")]
        for module in attentions:
            # Loaders may cast the model after __init__: the latent caches hold what the layer
            # computes (the fused attention takes the query's dtype for key and value).
            param = next(module.parameters(), None)
            for entry in module.cache_entries:
                entry.dtype = param.dtype if param is not None else entry.dtype
        layer_infos = [
            LayerCacheInfo(layer_idx=index, caches=list(module.cache_entries))
            for index, module in enumerate(attentions)
        ]
        return ModelCacheInfo(
            num_layers=len(layer_infos),
            block_size=self.block_size,
            layer_infos=layer_infos,
            is_mla_backend=True,
        )
'''

TEMPLATES = {"init": INIT, "methods": METHODS, "seam": SEAM, "cache_info": CACHE_INFO}


_SNIPPETS = Snippets(jinja2.DictLoader(TEMPLATES))
statements = _SNIPPETS.statements
methods = _SNIPPETS.methods

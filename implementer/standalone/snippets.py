"""The code the contiguous (mode 1) codemods insert: jinja2 templates, rendered strictly and
parsed by libcst before insertion.

Templates are written at column 0 (libcst re-indents them where they are inserted); methods
live in a ``class _Snippet:`` so their docstrings carry their final indentation.
"""

from __future__ import annotations

import jinja2
from kvskill.implementer.snippets import Snippets

INIT = """\
# Contiguous KV cache (standalone mode 1, BSH): the runner allocates one
# [batch, max_seq_len, num_key_value_heads_per_rank * head_dim] tensor per cache entry and
# binds it through the entry's tensor_setter; until then the caches are empty placeholders.
self.attn_type = {{ attn_type_expr }}
self.attn_tp_size = {{ attn_tp_size }}  # attention tensor-parallel size the heads are split over
self.num_heads_per_rank = {{ heads_expr }} // self.attn_tp_size
self.num_key_value_heads_per_rank = max({{ kv_heads_expr }} // self.attn_tp_size, 1)
self.k_cache = torch.Tensor([])
self.v_cache = torch.Tensor([])
self.cache_entries = [
{% for name in ["k_cache", "v_cache"] %}
    CacheEntry(
        cache_name="{{ name }}",
        attn_type=self.attn_type,
        dim={{ dim_exprs[name] }},
        num_head=self.num_key_value_heads_per_rank,
        # NOTE: get_cache_info() updates this to the layer's dtype after any cast.
        dtype=torch.get_default_dtype(),
        tensor_setter=self.set_{{ name }},
    ),
{% endfor %}
]
"""

METHODS = '''\
class _Snippet:  # methods for an existing class; only the body is inserted
    def set_k_cache(self, tensor: torch.Tensor) -> None:
        """tensor_setter of k_cache: [batch, max_seq_len, num_head * dim], owned by the runner."""
        self.k_cache = tensor


    def set_v_cache(self, tensor: torch.Tensor) -> None:
        """tensor_setter of v_cache: [batch, max_seq_len, num_head * dim], owned by the runner."""
        self.v_cache = tensor


    def update_cache(self, write_start: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write this step's keys and values ([B, S, num_kv_heads * head_dim]) into each row.

        Row b receives its S new tokens at cache positions write_start[b] .. write_start[b] + S - 1
        (axis 1 of the [batch, max_seq_len, H] cache).
        """
        torch_npu.scatter_update_(self.k_cache, write_start, key, 1)
        torch_npu.scatter_update_(self.v_cache, write_start, value, 1)
'''

SEAM = """\
# Contiguous KV (BSH): write this step's keys and values into each row's cache, then attend
# over the row's whole cache; actual_seq_lengths_kv says how much of each row is valid.
md = get_forward_metadata()
batch, q_len = {{ query }}.shape[0], {{ query }}.shape[2]
query_bsh = {{ query }}.transpose(1, 2).reshape(batch, q_len, -1)  # [B, S, N * D]
key_bsh = {{ key }}.transpose(1, 2).reshape(batch, q_len, -1)  # [B, S, N_kv * D]
value_bsh = {{ value }}.transpose(1, 2).reshape(batch, q_len, -1)  # [B, S, N_kv * D]
# kv_len belongs to the runner (tokens per row after this step); layers only read it.
# A prefill writes every row from position 0, a decode step its one token at kv_len - 1.
write_start = torch.zeros_like(md.kv_len) if md.is_prefill else md.kv_len - 1
self.update_cache(write_start, key_bsh, value_bsh)
# Prefill: causal over the 2048 tile (sparse_mode 3). Decode: one query per row, which the
# operator runs in its decode branch, masked by actual_seq_lengths_kv alone (sparse_mode 0).
{{ output }}, _ = torch_npu.{{ op }}(
    query_bsh,
    self.k_cache,
    self.v_cache,
{% for key, value in kwargs %}
    {{ key }}={{ value }},
{% endfor %}
)
{% if bnsd %}
{{ output }} = {{ output }}.view(batch, q_len, self.num_heads_per_rank, -1).transpose(1, 2)  # [B, N, S, D], as the source kernel returns
{% else %}
{{ output }} = {{ output }}.view(batch, q_len, self.num_heads_per_rank, -1)  # [B, S, N, D], as the source kernel returns
{% endif %}
{% for name in extra_outputs %}
{{ name }} = None
{% endfor %}
"""

TEMPLATES = {"init": INIT, "methods": METHODS, "seam": SEAM}


_SNIPPETS = Snippets(jinja2.DictLoader(TEMPLATES))
statements = _SNIPPETS.statements
methods = _SNIPPETS.methods

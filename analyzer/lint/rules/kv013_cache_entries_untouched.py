"""KV013: cache_entries declared, but the forward never writes them or never reads them."""

from __future__ import annotations

from collections.abc import Iterator

from kvskill.analyzer.cache_access import (
    attribute_methods,
    cache_entry_names,
    helper_may_reads,
    helper_may_writes,
    may_touch,
    reader_methods,
)
from kvskill.analyzer.delegated_caches import calls_submodule, delegated_entries
from kvskill.analyzer.gather import declares_token_caches, resolve_method
from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._examples import example

_DECLARE = """\
class Attn(nn.Module):
    def __init__(self, config, infer_config):
        super().__init__()
        self.attn_type = "FullAttention"
        self.block_size = infer_config.scheduler_config.block_size
        self.num_key_value_heads_per_rank = max(config.num_key_value_heads // 1, 1)
        self.k_cache = torch.Tensor([])
        self.v_cache = torch.Tensor([])
        self.cache_entries = [
            CacheEntry(cache_name=name, attn_type=self.attn_type, dim=64,
                       num_head=self.num_key_value_heads_per_rank, dtype=torch.float16,
                       needs_block=True, block_size=self.block_size,
                       tensor_setter=getattr(self, "set_" + name))
            for name in ("k_cache", "v_cache")
        ]
"""
_DECLARE_NAMED = _DECLARE.replace(
    """            CacheEntry(cache_name=name, attn_type=self.attn_type, dim=64,
                       num_head=self.num_key_value_heads_per_rank, dtype=torch.float16,
                       needs_block=True, block_size=self.block_size,
                       tensor_setter=getattr(self, "set_" + name))
            for name in ("k_cache", "v_cache")
""",
    """            CacheEntry(cache_name="k_cache", attn_type=self.attn_type, dim=64,
                       num_head=self.num_key_value_heads_per_rank, dtype=torch.float16,
                       needs_block=True, block_size=self.block_size,
                       tensor_setter=self.set_k_cache),
            CacheEntry(cache_name="v_cache", attn_type=self.attn_type, dim=64,
                       num_head=self.num_key_value_heads_per_rank, dtype=torch.float16,
                       needs_block=True, block_size=self.block_size,
                       tensor_setter=self.set_v_cache),
""",
)
_WRITE = """
    def update_cache(self, slots, key, value):
        torch_npu.npu_scatter_nd_update_(self.k_cache.view(-1, 2, 64), slots.view(-1, 1), key)
        torch_npu.npu_scatter_nd_update_(self.v_cache.view(-1, 2, 64), slots.view(-1, 1), value)
"""
_FORWARD = """
    def forward(self, q, k, v):
        md = get_forward_metadata()
        self.update_cache(md.slot_mapping[self.attn_type], k, v)
        num_blocks, block_size = self.k_cache.shape[:2]
        out, _ = torch_npu.npu_fused_infer_attention_score(
            q, self.k_cache.view(num_blocks, block_size, -1),
            self.v_cache.view(num_blocks, block_size, -1),
            num_heads=8, num_key_value_heads=self.num_key_value_heads_per_rank,
            input_layout="TND", scale=0.125, atten_mask=md.attention_mask, sparse_mode=3,
            block_table=md.block_table[self.attn_type], block_size=block_size,
            actual_seq_lengths=md.actual_seq_lengths_cu_q,
            actual_seq_lengths_kv=md.actual_seq_lengths_kv)
        return out
"""


def _may_write_and_read(func, attr: str) -> bool:
    """Whether FUNC writes ``self.<attr>`` with a cache-write operator and reads it."""
    touched = may_touch(func, frozenset({attr}), {}, {}, {}, {})
    return attr in touched.writes and attr in touched.reads


#: a DSA-style layer: its third entry goes to the indexer module, which writes and reads it
_INDEXER = """
class Indexer(nn.Module):
    def __init__(self):
        super().__init__()
        self.key_cache = torch.Tensor([])

    def forward(self, q, k, weights):
        md = get_forward_metadata()
        torch_npu.npu_scatter_nd_update_(self.key_cache.view(-1, 128), md.slot_mapping["FullAttention"].view(-1, 1), k)
        return torch_npu.npu_lightning_indexer(
            q, self.key_cache, weights, actual_seq_lengths_query=md.actual_seq_lengths_cu_q,
            actual_seq_lengths_key=md.actual_seq_lengths_kv,
            block_table=md.block_table["FullAttention"], layout_query="TND",
            layout_key="PA_BSND", sparse_count=8, sparse_mode=3)[0]


"""
_INDEXED = (
    _INDEXER
    + _DECLARE_NAMED.replace(
        "        self.cache_entries = [",
        "        self.indexer = Indexer()\n        self.cache_entries = [",
    ).replace(
        "                       tensor_setter=self.set_v_cache),\n",
        "                       tensor_setter=self.set_v_cache),\n"
        '            CacheEntry(cache_name="indexer_key_cache", attn_type=self.attn_type, dim=128,\n'
        "                       num_head=1, dtype=torch.float16, needs_block=True,\n"
        "                       block_size=self.block_size, tensor_setter=self.set_indexer_key_cache),\n",
    )
    + """
    def set_indexer_key_cache(self, tensor):
        self.indexer.key_cache = tensor
"""
    + _WRITE
    + _FORWARD.replace(
        "        self.update_cache(md.slot_mapping[self.attn_type], k, v)\n",
        "        self.update_cache(md.slot_mapping[self.attn_type], k, v)\n"
        "        self.indexer(q, k, v)\n",
    )
)


class CacheEntriesUntouched(Rule):
    """A class declares cache_entries that its forward never writes or never reads.

    The runtime allocates a tensor for every declared entry and injects it through the
    entry's setter; a forward that never writes it (``npu_scatter_nd_update_``,
    ``scatter_update_`` or ``npu_kv_rmsnorm_rope_cache``, directly or through a helper such as
    ``update_cache``) or never passes it to the fused attention runs on without the cache: a
    half-converted attention that fails no check until its outputs are compared.
    """

    id = "KV013"
    name = "cache-entries-untouched"
    VALID = [
        example(_DECLARE_NAMED + _WRITE + _FORWARD),
        # names built in a loop: any write and any fused-attention read count for all
        example(_DECLARE + _WRITE + _FORWARD),
        # an entry handed to a submodule that writes and reads it, called by the forward
        example(_INDEXED),
    ]
    INVALID = [
        # the submodule never writes the entry it is handed
        example(
            _INDEXED.replace(
                "        torch_npu.npu_scatter_nd_update_(self.key_cache", "        (self.key_cache"
            )
        ),
        # the forward still runs its own attention: the declared caches stay empty
        example(
            _DECLARE_NAMED
            + """
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
"""
        ),
        # written but never read: the fused attention runs on this step's keys only
        example(
            _DECLARE_NAMED
            + _WRITE
            + _FORWARD.replace(
                """            q, self.k_cache.view(num_blocks, block_size, -1),
            self.v_cache.view(num_blocks, block_size, -1),""",
                "            q, k, v,",
            )
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        classes = {c.name.value: c for c in ctx.classes}
        for cls in ctx.classes:
            if not declares_token_caches(cls):
                continue
            forward = resolve_method(cls, "forward", classes)
            if forward is None:
                continue  # nothing runs the caches here; another class's forward may
            entries = cache_entry_names(cls, classes)
            writes = helper_may_writes(cls, entries, classes)
            readers = reader_methods(cls, entries, classes)
            reads = helper_may_reads(cls, entries, classes, readers)
            attrs = attribute_methods(cls, classes)
            touched = may_touch(forward, entries, writes, reads, readers, attrs)
            # entries a submodule the forward calls writes and reads (the DSA indexer's keys)
            delegated = frozenset().union(
                *(
                    found
                    for sub, found in delegated_entries(cls, classes, _may_write_and_read).items()
                    if calls_submodule(forward, sub)
                )
            )
            owner = f"{cls.name.value}.forward"
            unwritten = sorted(entries - touched.writes - delegated)
            unread = sorted(entries - touched.reads - delegated)
            if unwritten:
                yield self.finding(
                    ctx,
                    forward.name,
                    f"{owner} never writes the declared cache entries {', '.join(unwritten)}",
                    "write this step's keys and values with torch_npu.npu_scatter_nd_update_ "
                    "at md.slot_mapping[self.attn_type] (e.g. self.update_cache(...)) before "
                    "the fused attention",
                )
            if unread:
                yield self.finding(
                    ctx,
                    forward.name,
                    f"{owner} never reads the declared cache entries {', '.join(unread)} with "
                    "the fused attention",
                    "pass the caches to npu_fused_infer_attention_score (e.g. "
                    "self.k_cache.view(num_blocks, block_size, -1)) with "
                    "block_table=md.block_table[self.attn_type]",
                )

"""MLA (multi-head latent attention) conversion: absorbed paged attention over latent caches.

DeepSeek-style attention caches one latent head per token: the normalised latent
(``kv_lora_rank`` channels, ``nope_cache``) and the rotated shared key
(``qk_rope_head_dim`` channels, ``rope_cache``). The converted attention absorbs the key
up-projection into the query and the value up-projection into the output, so the fused
attention runs with key = value = the latent cache (npu_ops §1.8). The rewrites are the
registry's MLA entries (``kvskill.implementer.registry``); the pipeline is the shared one.
"""

from kvskill.implementer.mla.spec import CacheWrite, MlaSpec

__all__ = ["CacheWrite", "MlaSpec"]

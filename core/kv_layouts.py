"""The KV-cache layouts by name, as the CLI, reports and the runtime spell them.

Kept in the floor, away from the runtime that allocates them, so the CLI can offer the
choice without importing torch: "contiguous" is one dense tensor per cache entry,
"page_pool" is ``use_hybrid_blocks`` (one page-aligned pool with strided views).
"""

from __future__ import annotations

KV_LAYOUTS = ("contiguous", "page_pool")

"""Runtime: paged KV-cache management, layouts, operators and the generation engine."""

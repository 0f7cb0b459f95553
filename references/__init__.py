"""Reference pages of the model-infer-kvcache skill (package data)."""

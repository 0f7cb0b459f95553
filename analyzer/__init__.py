"""Analyzer: read a model config and modeling code, decide its KV-cache design (the Plan)."""

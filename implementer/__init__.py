"""Implementer: libcst codemods that convert a model to paged KV, and verification."""

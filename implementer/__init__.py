"""Implementer: libcst codemods that convert a model to paged KV; verify lives in kvskill.verify."""

"""Shared pytest setup: deterministic, single-threaded torch so the suite is reproducible."""

import os

os.environ.setdefault("KVSKILL_OPS", "reference")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

"""Shared pytest setup: deterministic, single-threaded torch so the suite is reproducible."""

import os

os.environ.setdefault("KVSKILL_OPS", "reference")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# kvskill's per-user state (the key that signs the code apply writes, kvskill.core.trust)
# lives in a scratch folder of this test session, never in the user's home.
if "KVSKILL_STATE_DIR" not in os.environ:
    import tempfile

    os.environ["KVSKILL_STATE_DIR"] = tempfile.mkdtemp(prefix="kvskill-test-state-")

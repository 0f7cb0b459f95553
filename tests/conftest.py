"""Shared pytest setup: deterministic, single-threaded torch so the suite is reproducible."""

import os

import pytest

os.environ.setdefault("KVSKILL_OPS", "reference")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The suite runs tiny CPU-only shapes (blocks of 4 tokens, fp32): the one opt-out of the
# default NPU profile of verify / run / LLM (kvskill.runtime.ops.reference.npu_profile).
# Tests of the default itself delete it (the ``npu_profile_default`` fixture below).
os.environ.setdefault("KVSKILL_CPU_ONLY_SHAPES", "1")

# kvskill's per-user state (the key that signs the code apply writes, kvskill.core.trust)
# lives in a scratch folder of this test session, never in the user's home.
# The folder is removed when the session ends (pytest_sessionfinish below), so runs do not
# pile up key folders in the temp directory.
_OWN_STATE_DIR: str | None = None
if "KVSKILL_STATE_DIR" not in os.environ:
    import tempfile

    _OWN_STATE_DIR = tempfile.mkdtemp(prefix="kvskill-test-state-")
    os.environ["KVSKILL_STATE_DIR"] = _OWN_STATE_DIR


def pytest_sessionfinish(session, exitstatus):
    if _OWN_STATE_DIR is not None:
        import shutil

        shutil.rmtree(_OWN_STATE_DIR, ignore_errors=True)


def _checked_to_dict():
    """Every Plan the suite turns into JSON (printed, written to kvskill_plan.json, compared)
    must match the published schema (references/plan_schema.md)."""
    from kvskill.analyzer.plan import Plan
    from kvskill.analyzer.plan_schema import schema_errors

    plain_to_dict = Plan.to_dict

    def to_dict(self):
        data = plain_to_dict(self)
        errors = schema_errors(data)
        assert not errors, f"a Plan of {self.model_type} does not match its schema: {errors}"
        return data

    Plan.to_dict = to_dict


_checked_to_dict()


@pytest.fixture
def npu_profile_default(monkeypatch):
    """verify / run / LLM with their default NPU profile (the suite's opt-out removed)."""
    monkeypatch.delenv("KVSKILL_CPU_ONLY_SHAPES", raising=False)
    monkeypatch.delenv("KVSKILL_NPU_LIMITS", raising=False)


@pytest.fixture(autouse=True)
def _no_ctrl_c_carried_over(monkeypatch):
    """Each test starts as a fresh process would: no Ctrl-C recorded by the entry point.

    A test that delivers SIGINT to this process leaves ``kvskill.interrupts``' record set, and the
    CLI then reports any later failure as an interrupt (exit 130)."""
    monkeypatch.setattr("kvskill.interrupts._sigint", False, raising=False)

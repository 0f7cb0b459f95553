"""The compatibility suite's one step, shared by its test files: apply -> verify, token-exact.

Every fixture of the suite (the installed transformers' own families, the project's
remote-code test model, the vendor-shape files) goes through the same round trip:
:func:`round_trip` converts MODEL into a fresh directory and verifies it on a shrunk
random-weight twin; :func:`assert_token_exact` says what "passes" means.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvskill.implementer.writer import ApplyOptions, apply_model
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions
from kvskill.verify.report import VerifyReport

#: how each deploy mode is asked of apply (standalone mode 1 keeps per-row BSH caches)
MODES = {
    "framework": ApplyOptions(),
    "standalone": ApplyOptions(deploy_mode="standalone", kv_mode="contiguous"),
}


def family_exists(model_type: str) -> bool:
    """Whether the installed transformers ships MODEL_TYPE's modeling code."""
    return importlib.util.find_spec(f"transformers.models.{model_type}") is not None


def round_trip(
    model: str, out: Path, mode: str = "framework", *, trust_remote_code: bool = False
) -> VerifyReport:
    """Apply MODEL (a model type or a model directory) in MODE into OUT, then verify OUT."""
    apply_model(model, out, MODES[mode])
    return verify_directory(out, VerifyOptions(trust_remote_code=trust_remote_code))


def assert_token_exact(report: VerifyReport) -> None:
    """Tokens identical, logits within verify's tolerance, the runtime's chains held."""
    assert report.error is None, report.error
    assert report.tokens_identical, report.failures()
    assert report.logits_within, report.failures()
    assert all(c["passed"] for c in report.chains), report.failures()
    assert report.passed, report.failures()

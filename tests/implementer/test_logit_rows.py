"""A model whose forward takes no ``logits_to_keep`` (transformers 4.46's ``num_logits_to_keep:
int``, many vendor files): the runtime and the standalone runner compute every position's
logits and pick the requests' rows themselves, token-exact."""

from __future__ import annotations

import pytest
from remote_model import MODELING, write_remote_model

pytestmark = pytest.mark.slow

#: the remote model's head, as transformers 4.46 writes it: an int count, no index tensor
OLD_HEAD = MODELING.replace(
    "use_cache=None, logits_to_keep=0, **kwargs):",
    "use_cache=None, num_logits_to_keep=0, **kwargs):",
).replace(
    """        if isinstance(logits_to_keep, int):
            hidden_states = hidden_states[:, -logits_to_keep:, :] if logits_to_keep else hidden_states
        else:
            hidden_states = hidden_states[:, logits_to_keep, :]
""",
    """        if num_logits_to_keep:
            hidden_states = hidden_states[:, -num_logits_to_keep:, :]
""",
)


def test_the_variant_really_takes_no_logits_to_keep():
    assert "logits_to_keep=0" not in OLD_HEAD.replace("num_logits_to_keep=0", "")
    assert "isinstance(logits_to_keep" not in OLD_HEAD


@pytest.mark.parametrize(
    "options",
    [{}, {"deploy_mode": "standalone", "kv_mode": "contiguous"}, {"deploy_mode": "standalone", "kv_mode": "paged"}],
    ids=["framework", "standalone-contiguous", "standalone-paged"],
)  # fmt: skip
def test_a_forward_without_logits_to_keep_verifies_token_exact(options, tmp_path):
    from kvskill.implementer.writer import ApplyOptions, apply_model
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    source = write_remote_model(tmp_path / "src", OLD_HEAD)
    out = tmp_path / "out"
    apply_model(str(source), out, ApplyOptions(**options))
    runners = list(out.glob("runner_*.py"))
    for runner in runners:
        assert "output.logits[:, step.logits_indices]" in runner.read_text()
    assert len(runners) == (1 if options else 0)
    report = verify_directory(out, VerifyOptions(trust_remote_code=True))
    assert report.error is None, report.error
    assert report.passed, report.failures()

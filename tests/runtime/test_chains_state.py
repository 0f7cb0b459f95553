"""The runtime chain's state-group checks: one stable, unshared state block per request."""

from __future__ import annotations

import torch
from kvskill.runtime.chains import RuntimeChainRecorder, _StepFacts


def _step(request_ids, blocks, preempted=()):
    batch = len(request_ids)
    return _StepFacts(
        is_prefill=True,
        batch=batch,
        num_tokens=batch,
        request_ids=list(request_ids),
        prompt_tokens=[1] * batch,
        num_output_tokens=[0] * batch,
        seq_lengths_kv=[1] * batch,
        seq_lengths_q=[1] * batch,
        groups={"Mamba": ((batch, 1), torch.int32, -1)},
        preempted_ids=list(preempted),
        first_blocks={"Mamba": list(blocks)},
    )


def _failures(*steps):
    recorder = RuntimeChainRecorder(steps=list(steps))
    return list(recorder.check(["Mamba"], ["Mamba"]).failures)


def test_a_request_keeps_its_state_block_until_it_is_preempted():
    assert _failures(_step("ab", [3, 4]), _step("ab", [3, 4])) == []
    (moved,) = _failures(_step("ab", [3, 4]), _step("ab", [3, 5]))
    assert "request b's state block" in moved and "from 4 to 5" in moved
    # preempted at the second step, it may come back on another block
    assert _failures(_step("ab", [3, 4]), _step("a", [3], preempted="b"), _step("b", [7])) == []


def test_two_requests_of_a_step_never_share_a_state_block():
    (shared,) = _failures(_step("ab", [3, 3]))
    assert "share a state block" in shared

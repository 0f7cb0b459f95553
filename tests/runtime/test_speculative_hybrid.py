"""Speculative decoding on a hybrid model: Qwen3-Next (gated-delta and full-attention
layers) with its MTP layer in the ``mtp.*`` layout, converted by apply (framework mode).

A verify step writes the recurrent states after every fed token into the request's
``1 + k`` state blocks and the request keeps the block of its last accepted token. With
random weights the MTP layer's drafts are almost never accepted, so the drafts are also
replaced by the tokens one-token-per-step decoding produces, one in three spoiled: every
accepted count from 0 to k occurs, and the tokens must still equal the reference's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kvskill.runtime import LLM, SamplingParams
from kvskill.runtime.managers import MambaManager
from kvskill.runtime.speculative import Speculator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from mtp_checkpoints import convert_checkpoint, qwen3_next_mtp_state  # noqa: E402

# one apply of the gated-delta codemods over qwen3_next's modeling file
pytestmark = pytest.mark.slow

SETTINGS = dict(exact=True, block_size=4, num_blocks=200, cpu_only_shapes=True)
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 9, 33, 7, 100, 3, 41, 8, 77], list(range(20, 43)), [200, 4, 17] * 5]


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    config, state = qwen3_next_mtp_state()
    return convert_checkpoint(tmp_path_factory.mktemp("qwen3_next_mtp"), config, state)


def _tokens(directory, **settings):
    llm = LLM(directory, **{**SETTINGS, **settings})
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], llm


def _oracle_drafts(monkeypatch, expected: dict[tuple, list[int]]) -> None:
    """After the MTP layer drafted, its drafts become the reference's next tokens; the last
    one is spoiled every third step of each request."""
    draft = Speculator._draft

    def oracle(self, engine, scheduled, hidden, kept, ends):
        draft(self, engine, scheduled, hidden, kept, ends)
        for s in scheduled:
            r = s.request
            if not r.draft_token_ids:
                continue
            done = len(r.output_token_ids)
            want = list(expected[tuple(r.prompt_token_ids)][done : done + len(r.draft_token_ids)])
            want += [0] * (len(r.draft_token_ids) - len(want))
            if (done + r.index) % 3 == 0:
                want[(done // 3) % len(want)] ^= 1
            r.draft_token_ids[:] = want

    monkeypatch.setattr(Speculator, "_draft", oracle)


def test_gated_delta_states_follow_the_accepted_tokens(qwen3_next, monkeypatch):
    expected, _ = _tokens(qwen3_next)
    # the MTP layer's own drafts (random weights: nearly all rejected)
    got, llm = _tokens(qwen3_next, speculative_tokens=2)
    assert got == expected and llm.stats.speculation.num_draft_tokens > 0
    assert llm.engine.speculator.last_draft_logits is not None
    _oracle_drafts(monkeypatch, {tuple(p): e for p, e in zip(PROMPTS, expected, strict=True)})
    for k in (1, 2):
        got, llm = _tokens(qwen3_next, speculative_tokens=k)
        assert got == expected, k
        spec = llm.stats.speculation
        assert 0 < spec.num_accepted_draft_tokens < spec.num_draft_tokens
        assert llm.kv_manager.num_free_blocks == llm.kv_manager.initial_free_blocks
    # preemption: 14 blocks of 4 tokens cannot hold the three requests grown by 8 tokens
    got, llm = _tokens(qwen3_next, speculative_tokens=2, num_blocks=14, max_model_len=40)
    assert got == expected and llm.stats.num_preemptions > 0
    # the state of the last accepted token is what makes them equal: keeping block 0 (the
    # state after the verify step's first token) changes the tokens
    monkeypatch.setattr(MambaManager, "keep_state_after", lambda self, rid, t: None)
    got, _ = _tokens(qwen3_next, speculative_tokens=2)
    assert got != expected

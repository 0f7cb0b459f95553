"""No step reads a KV pool row before a step has wrote it, except the null block.

Attention groups: a pool filled with NaN before the first step (every block but the null block)
gives the same greedy tokens as a zeroed one. The null block is read: a sliding-window request
keeps table entries for the blocks that left its window pointing at it, and attention reads
those positions and masks them afterwards, so it must hold finite values (the pools are
zero-filled). The other kinds of group (MLA, Mamba-1 and gated-delta states) are checked beside
their conversions (test_mla_apply_verify, test_mamba_mixer, test_gated_delta).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from kvskill.runtime import LLM, SamplingParams  # noqa: E402
from toy_factory import write_toy_dir  # noqa: E402
from unwritten_rows import clean_and_poisoned_tokens  # noqa: E402

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
#: the longest (11 tokens) outgrows the sliding layer's window of 8
PROMPTS = [[5, 9, 14], [3, 8, 22, 41, 7, 60, 11, 90, 4, 33, 12], [17, 2, 70, 28, 6, 101]]


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    # one full-attention layer and one sliding-window layer (window 8), blocks of 4 tokens
    return write_toy_dir(tmp_path_factory.mktemp("toy") / "model", seed=2, weights=False)


def make_toy_llm(toy_dir: Path):
    return lambda: LLM(
        toy_dir,
        exact=True,
        trust_remote_code=True,
        random_weights=True,
        block_size=4,
        num_blocks=32,
        free_block_order_seed=3,
        cpu_only_shapes=True,
    )


def test_full_attention_and_window_rows_are_written_before_read(toy_dir):
    clean, poisoned = clean_and_poisoned_tokens(make_toy_llm(toy_dir), PROMPTS, PARAMS)
    assert poisoned == clean


def test_the_null_block_is_read_by_the_window_and_must_be_finite(toy_dir):
    # NaN in the null block too: the request that outgrew its window reads it
    clean, poisoned = clean_and_poisoned_tokens(
        make_toy_llm(toy_dir), PROMPTS, PARAMS, null_block=True
    )
    assert poisoned[1] != clean[1]
    assert (poisoned[0], poisoned[2]) == (clean[0], clean[2])

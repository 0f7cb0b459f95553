"""Prefix caching end to end on the toy model: same greedy tokens with the cache on and
off (mixed and shared-prefix workloads, chunked prefill, preemption), the three
chains, and the switch and metrics of ``LLM`` and ``kvskill run``."""

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from kvskill.cli import main  # noqa: E402
from kvskill.runtime import LLM, SamplingParams  # noqa: E402
from kvskill.runtime.chains import run_three_chains  # noqa: E402
from toy_factory import toy_prompts, write_toy_dir  # noqa: E402


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return write_toy_dir(tmp_path_factory.mktemp("toy") / "model", seed=7)


def _shared_prefix_prompts(rng: random.Random, count: int, prefix_len: int) -> list[list[int]]:
    prefix = [rng.randrange(128) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(128) for _ in range(rng.randint(1, 9))] for _ in range(count)]


def _generate(toy_dir, prompts, params, **options):
    # exact: runs with the cache on and off are compared bit for bit
    llm = LLM(toy_dir, trust_remote_code=True, block_size=4, exact=True, **options)
    return [o.token_ids for o in llm.generate(prompts, params)], llm


@pytest.mark.parametrize(
    "options",
    [
        dict(num_blocks=200, max_num_batched_tokens=2048),
        # chunked prefill over several steps, and a pool small enough to preempt
        dict(num_blocks=40, max_num_batched_tokens=24, free_block_order_seed=3),
    ],
    ids=["roomy", "chunked-preempting"],
)
def test_shared_prefix_tokens_are_the_same_with_and_without_the_cache(toy_dir, options):
    rng = random.Random(1)
    prompts = _shared_prefix_prompts(rng, 10, 37) + _shared_prefix_prompts(rng, 4, 18)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected, off = _generate(toy_dir, prompts, params, enable_prefix_caching=False, **options)
    got, on = _generate(toy_dir, prompts, params, **options)
    assert got == expected
    assert on.prefix_caching and not off.prefix_caching
    stats = on.stats
    assert stats.num_prefix_hit_tokens > 0 and stats.num_cached_blocks > 0
    assert 0 < stats.prefix_cache_hit_rate < 1
    # Every admission computes what it did not hit (preemptions make both runs recompute
    # different amounts, so compare with the run's own lookups).
    assert stats.num_prompt_tokens == stats.num_prefix_query_tokens - stats.num_prefix_hit_tokens
    if not off.stats.num_preemptions and not stats.num_preemptions:
        assert stats.num_prompt_tokens == off.stats.num_prompt_tokens - stats.num_prefix_hit_tokens
    assert off.stats.num_prefix_query_tokens == 0 and off.stats.num_cached_blocks == 0
    assert on.kv_manager.num_free_blocks == on.kv_manager.initial_free_blocks
    if options["num_blocks"] == 40:
        assert stats.num_preemptions > 0


def test_requests_sharing_cached_blocks_attend_to_them_in_one_pass(toy_dir, monkeypatch):
    from kvskill.runtime.ops.reference import packed_prefill

    monkeypatch.setattr(packed_prefill, "MIN_SHARED_TOKENS", 8)
    shared: list[int] = []
    original = packed_prefill.shared_blocks

    def spy(*args, **kwargs):
        shared.append(original(*args, **kwargs))
        return shared[-1]

    monkeypatch.setattr(packed_prefill, "shared_blocks", spy)
    # one request first, so the others find its blocks cached and come in one step
    prompts = _shared_prefix_prompts(random.Random(4), 9, 37)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected, _ = _generate(toy_dir, prompts, params, enable_prefix_caching=False, num_blocks=200)
    assert not any(shared)
    llm = LLM(toy_dir, trust_remote_code=True, block_size=4, num_blocks=200)
    first = llm.generate(prompts[:1], params)[0].token_ids
    rest = [o.token_ids for o in llm.generate(prompts[1:], params)]
    assert [first, *rest] == expected
    assert any(shared)


def test_mixed_workload_tokens_are_the_same_and_a_second_round_hits(toy_dir):
    rng = random.Random(4)
    prompts = toy_prompts(rng, 16, min_len=1, max_len=60)
    params = [SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True) for _ in prompts]
    options = dict(num_blocks=48, max_num_batched_tokens=32, exact=True)
    off = LLM(toy_dir, trust_remote_code=True, block_size=4, enable_prefix_caching=False, **options)
    on = LLM(toy_dir, trust_remote_code=True, block_size=4, **options)
    for round_ in range(2):
        expected = [o.token_ids for o in off.generate(prompts, params)]
        assert [o.token_ids for o in on.generate(prompts, params)] == expected, round_
    # The second round found the first round's blocks (those not evicted meanwhile).
    assert on.stats.num_prefix_hit_tokens > 0


def test_a_fully_cached_prompt_still_computes_its_last_token(toy_dir):
    prompt = list(range(1, 17))  # four full blocks of 4
    llm = LLM(toy_dir, trust_remote_code=True, block_size=4, num_blocks=32)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    computed = llm.stats.num_prompt_tokens
    again = llm.generate([prompt], params)[0]
    assert again.token_ids == first.token_ids
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 12)
    assert again.to_dict()["num_cached_tokens"] == 12
    # 12 tokens hit (three blocks); the last block's 4 tokens are computed again.
    assert llm.stats.num_prefix_hit_tokens == 12
    assert llm.stats.num_prompt_tokens - computed == 4


def test_three_chains_pass_with_the_cache_and_the_release_chain_reruns_from_it(toy_dir):
    llm = LLM(toy_dir, trust_remote_code=True, num_blocks=40, max_num_batched_tokens=16)
    prompts = [list(range(1, 1 + n)) for n in (3, 11, 25, 7, 30, 2)]
    report = run_three_chains(llm, prompts, SamplingParams(max_tokens=10))
    assert report.passed, report.to_dict()
    release = report.results[2]
    assert "from the prefix cache" in release.summary and "after a reset" in release.summary
    assert "(0 tokens hit)" not in release.summary


def _run(capsys, *args):
    with pytest.raises(SystemExit) as exc:
        main(["run", *args])
    out, _ = capsys.readouterr()
    return exc.value.code, out


def test_run_reports_the_prefix_cache_and_the_switch(capsys, toy_dir):
    prompts = "1,2,3,4,5,6,7,8,9;1,2,3,4,5,6,7,8,10;1,2,3,4,5,6,7,8,11"
    common = [str(toy_dir), "--trust-remote-code", "--prompt-ids", prompts]
    common += ["--max-num-batched-tokens", "9", "--block-size", "4", "--num-blocks", "32"]
    code, out = _run(capsys, *common, "--format", "json")
    assert code == 0, out
    prefix = json.loads(out)["prefix_cache"]
    # The first prompt runs alone (9-token budget); the next two hit its two full blocks.
    assert prefix["enabled"] and prefix["disabled_reason"] is None
    assert prefix["hit_tokens"] == 16 and prefix["query_tokens"] == 27
    assert prefix["hit_rate"] == pytest.approx(16 / 27)
    assert prefix["cached_blocks"] > 0
    code, out = _run(capsys, *common, "--no-prefix-caching", "--format", "json")
    off = json.loads(out)
    assert off["prefix_cache"]["enabled"] is False and off["prefix_cache"]["hit_tokens"] == 0
    code, out = _run(capsys, *common)
    assert "prefix cache" in out and "hit rate 59.3% (16/27 tokens)" in out
    code, out = _run(capsys, *common, "--no-prefix-caching")
    assert "off (--no-prefix-caching)" in out

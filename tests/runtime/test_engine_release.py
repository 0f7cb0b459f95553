"""Three-chain checks: init, runtime, release; and no block leak over a long random run."""

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from kvskill.runtime import LLM, SamplingParams  # noqa: E402
from kvskill.runtime.chains import (  # noqa: E402
    RuntimeChainRecorder,
    check_init_chain,
    check_pools_released,
    run_three_chains,
)
from toy_factory import toy_prompts, write_toy_dir  # noqa: E402


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return write_toy_dir(tmp_path_factory.mktemp("toy") / "model", seed=3)


def test_three_chains_pass_with_shuffled_blocks_and_preemption(toy_dir):
    llm = LLM(
        toy_dir,
        trust_remote_code=True,
        num_blocks=16,
        free_block_order_seed=11,
        max_num_batched_tokens=16,
    )
    prompts = [list(range(1, 1 + n)) for n in (3, 11, 25, 7, 30, 2)]
    report = run_three_chains(llm, prompts, SamplingParams(max_tokens=10))
    assert [r.name for r in report.results] == ["init", "runtime", "release"]
    assert report.passed, report.to_dict()
    # The pool was small enough to force recomputation: the release chain saw dirty reuse.
    assert llm.stats.num_preemptions > 0
    assert "checked for" in report.results[1].summary


def test_init_chain_reports_a_placeholder_left(toy_dir):
    llm = LLM(toy_dir, trust_remote_code=True, num_blocks=8)
    assert check_init_chain(llm.model, llm.cache_info, llm.kv_manager).passed
    # A layer that dropped its injected cache is caught by name.
    llm.model.model.layers[1].self_attn.v_cache = torch.Tensor([])
    result = check_init_chain(llm.model, llm.cache_info, llm.kv_manager)
    assert not result.passed
    assert any("layers.1.self_attn.v_cache" in f for f in result.failures)
    # A tensor of the wrong dtype is caught too.
    entry = llm.cache_info.layer_infos[0].caches[0]
    entry.tensor = entry.tensor.to(torch.float16)
    result = check_init_chain(llm.model, llm.cache_info, llm.kv_manager)
    assert any("layer 0 cache 'k_cache'" in f for f in result.failures)


def test_runtime_chain_catches_wrong_kv_length_and_missing_group(toy_dir):
    llm = LLM(toy_dir, trust_remote_code=True, num_blocks=32)
    recorder = RuntimeChainRecorder()
    with llm.step_hook(recorder):
        llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3))
    assert recorder.check(llm.kv_manager.group_keys).passed
    # Corrupt the first decode step as a model that double-counts the new token would.
    first_decode = next(s for s in recorder.steps if not s.is_prefill)
    first_decode.seq_lengths_kv[0] += 1
    del first_decode.groups["SlidingWindow"]
    result = recorder.check(llm.kv_manager.group_keys)
    assert not result.passed
    assert any("expected prompt_len + 1 = 6" in f for f in result.failures)
    assert any("no entry for group 'SlidingWindow'" in f for f in result.failures)


def test_no_leak_after_500_random_requests(toy_dir):
    # Random lengths, limits, stop ids and sampling through a pool small enough to preempt.
    rng = random.Random(2024)
    llm = LLM(
        toy_dir,
        trust_remote_code=True,
        num_blocks=40,
        free_block_order_seed=5,
        max_num_batched_tokens=160,
        max_num_seqs=64,
        max_model_len=48,
    )
    prompts = toy_prompts(rng, 500, max_len=16)
    params = [
        SamplingParams(
            max_tokens=rng.randint(1, 6),
            temperature=rng.choice([0.0, 0.8]),
            stop_token_ids=[rng.randrange(128)],
            seed=rng.randrange(1000),
        )
        for _ in prompts
    ]
    outputs = llm.generate(prompts, params)
    assert len(outputs) == 500 and all(o.finished for o in outputs)
    assert all(1 <= len(o.token_ids) <= p.max_tokens for o, p in zip(outputs, params, strict=True))
    assert check_pools_released(llm.kv_manager) == []
    assert llm.stats.num_preemptions > 0
    assert llm.engine._requests == {}  # finished requests are not kept


def test_finished_request_frees_blocks_while_others_run(toy_dir):
    llm = LLM(toy_dir, trust_remote_code=True, num_blocks=32)
    engine = llm.engine
    short = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    engine.add_request(list(range(10, 28)), SamplingParams(max_tokens=20))
    free_before = None
    while engine.get_output(short).finish_reason is None:
        free_before = dict(llm.kv_manager.num_free_blocks)
        engine.step()
    # The short request's blocks went back to the pool the step it finished.
    free_after = llm.kv_manager.num_free_blocks
    assert free_after["FullAttention"] == free_before["FullAttention"] + 1
    while engine.has_unfinished_requests():
        engine.step()
    assert check_pools_released(llm.kv_manager) == []


@pytest.mark.parametrize("freeze", [True, False])
def test_first_llm_freezes_the_startup_heap_but_not_its_own_model(toy_dir, freeze):
    # A fresh process: gc.freeze() is process-wide. The heap found at the first LLM is frozen
    # (full collections skip it); the model and engine built after it stay collectable.
    import subprocess
    import textwrap

    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    code = textwrap.dedent(
        f"""
        import gc, weakref
        from kvskill.runtime import LLM
        before = gc.get_freeze_count()
        llm = LLM({str(toy_dir)!r}, trust_remote_code=True, num_blocks=16,
                  freeze_startup_heap={freeze})
        frozen = gc.get_freeze_count()
        LLM({str(toy_dir)!r}, trust_remote_code=True, num_blocks=16)
        model = weakref.ref(llm.model)
        del llm
        gc.collect()
        print(before, frozen > before, gc.get_freeze_count() <= frozen, model() is None)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=fixtures,
    )
    assert done.returncode == 0, done.stderr
    before, froze, frozen_once, model_freed = done.stdout.split()
    assert before == "0"
    assert froze == str(freeze)
    # only the first LLM of a process freezes (the second one does when the first opted out;
    # frozen objects freed by their reference count leave the count)
    assert frozen_once == str(freeze)
    assert model_freed == "True"

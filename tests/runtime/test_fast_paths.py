"""Fast by default, exact on request: which fast paths an LLM switches on, and why any is off."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from kvskill.core.errors import BadInputError  # noqa: E402
from kvskill.runtime import (  # noqa: E402
    LLM,
    EngineConfig,
    SamplingParams,
    fused_layers,
    prepacked_linear,
    screened_head,
)
from kvskill.runtime.fast_paths import switch_on_fast_paths  # noqa: E402
from kvskill.runtime.loader import load_model  # noqa: E402
from toy_factory import write_toy_dir  # noqa: E402

NAMES = ("prepack_linear", "fuse_layers", "screen_output_head")


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return write_toy_dir(tmp_path_factory.mktemp("toy") / "model", seed=7)


@pytest.fixture
def a_capable_machine(monkeypatch):
    """oneDNN, the fused kernels and native bf16, whatever this machine has (the tests that
    take a path away say so)."""
    for module in (prepacked_linear, fused_layers, screened_head):
        monkeypatch.setattr(module, "unavailable_reason", lambda: None)


def toy_model(toy_dir: Path, dtype: str = "float32") -> nn.Module:
    return load_model(
        toy_dir, dtype=dtype, seed=7, random_weights=True, trust_remote_code=True
    ).model


def states(paths) -> dict[str, tuple[bool, str | None]]:
    return {p.name: (p.on, p.reason) for p in paths.paths}


def test_every_path_is_on_by_default_where_it_can_run(toy_dir):
    if any(m.unavailable_reason() for m in (prepacked_linear, fused_layers, screened_head)):
        pytest.skip("this machine lacks a fast path; the off cases are tested below")
    llm = LLM(toy_dir, trust_remote_code=True, cpu_only_shapes=True)
    assert [(p.name, p.on) for p in llm.fast_paths.paths] == [(n, True) for n in NAMES]
    assert llm.num_prepacked_linears > 0 and llm.num_fused_layers > 0
    assert llm.output_head_screen is not None


def test_an_exact_run_turns_every_path_off_and_says_why(toy_dir):
    llm = LLM(toy_dir, trust_remote_code=True, cpu_only_shapes=True, exact=True)
    for path in llm.fast_paths.paths:
        assert not path.on and path.reason.startswith("exact run (--exact)")
    assert (llm.num_prepacked_linears, llm.num_fused_layers) == (0, 0)
    assert llm.output_head_screen is None


@pytest.mark.parametrize("name", NAMES)
def test_an_exact_run_refuses_a_path_asked_for(name):
    with pytest.raises(BadInputError, match=f"{name}=True is a fast path"):
        EngineConfig(exact=True, **{name: True})


def test_a_cpu_without_bf16_leaves_the_screen_off_with_the_reason(
    toy_dir, a_capable_machine, monkeypatch
):
    no_bf16 = "this CPU has no native bf16 support for oneDNN (AVX512-BF16 or AMX)"
    monkeypatch.setattr(screened_head, "unavailable_reason", lambda: no_bf16)
    paths = switch_on_fast_paths(toy_model(toy_dir), EngineConfig())
    assert states(paths) == {
        "prepack_linear": (True, None),
        "fuse_layers": (True, None),
        "screen_output_head": (False, no_bf16),
    }
    # asked for, the same reason is an error instead
    with pytest.raises(BadInputError, match="screen_output_head=True cannot run: this CPU"):
        switch_on_fast_paths(toy_model(toy_dir), EngineConfig(screen_output_head=True))


def test_tensor_parallel_leaves_every_path_off(toy_dir, a_capable_machine):
    paths = switch_on_fast_paths(toy_model(toy_dir), EngineConfig(tensor_parallel_size=2))
    assert {name: on for name, (on, _) in states(paths).items()} == dict.fromkeys(NAMES, False)
    assert all("tensor parallel (2 ranks)" in p.reason for p in paths.paths)


def test_a_bf16_model_keeps_its_own_code(toy_dir, a_capable_machine):
    paths = switch_on_fast_paths(toy_model(toy_dir, "bfloat16"), EngineConfig())
    for path in paths.paths:
        assert not path.on
        assert path.reason == "the model runs bfloat16 on cpu; the fast paths cover float32 on cpu"


def test_a_model_with_nothing_to_fuse_or_screen_says_so(a_capable_machine):
    # a lone biased linear layer: packable, but no RMSNorm, gated MLP or bias-free head
    model = nn.Sequential(nn.Linear(16, 16))
    paths = switch_on_fast_paths(model, EngineConfig())
    (packed, fused, screened) = paths.paths
    assert packed.on and packed.count == 1
    assert not fused.on and "passed the kernels' probe" in fused.reason
    assert not screened.on and screened.reason == "the model exposes none"
    # turned off by hand: the flag is the reason
    paths = switch_on_fast_paths(
        nn.Sequential(nn.Linear(16, 16)), EngineConfig(prepack_linear=False)
    )
    assert paths.get("prepack_linear").reason == "prepack_linear=False (--no-prepack-linear)"


def test_an_exact_llm_runs_a_module_a_fast_llm_switched_bit_for_bit(toy_dir):
    # a fast LLM switches the module's linears, norms and rope; an exact LLM of the same module
    # must compute what an exact LLM of an untouched copy computes, to the last bit
    prompts, params = [[1, 2, 3, 4, 5], [6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True)

    def logits_of(llm) -> list[torch.Tensor]:
        seen: list[torch.Tensor] = []
        with llm.step_hook(lambda record: seen.append(record.logits.clone())):
            llm.generate(prompts, params)
        return seen

    settings = {"block_size": 4, "num_blocks": 16, "cpu_only_shapes": True}
    switched = toy_model(toy_dir)
    LLM(switched, **settings).generate(prompts, params)
    untouched = logits_of(LLM(toy_model(toy_dir), exact=True, **settings))
    again = logits_of(LLM(switched, exact=True, **settings))
    assert len(again) == len(untouched)
    assert all(torch.equal(a, b) for a, b in zip(again, untouched, strict=True))

"""The framework's own Qwen3.5 (models/qwen3_5 of a cann-recipes-infer checkout) converted to
the Paged contract and verified end to end against its Legacy original, on a CPU.

Opt-in: set KVSKILL_CANN_RECIPES to a checkout of fbc225d (``make test-cann-recipes``), with
the framework's requirements its executor imports (datasets, loguru) installed. The model's
``executor`` / ``module`` imports come from that checkout; kvskill supplies the CPU stand-ins
only (torch_npu, a one-rank gloo group, the expert-parallel groups the model registers only
above one rank). The run is bfloat16, the dtype the file is written for: its gated-delta path
casts to bfloat16 for the kernels, and the MoE dispatch takes float16 / bfloat16 only.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from kvskill.core.errors import UnsupportedModelError

ROOT = os.environ.get("KVSKILL_CANN_RECIPES")
MODELING = "modeling_qwen3_5_moe.py"

#: the real Qwen3.5-MoE shrunk: one gated-delta layer, one full-attention layer, 4 experts
SHRUNK = {
    "model_type": "qwen3_5_moe_text",
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_qwen3_5_moe.Qwen3_5MoeTextConfig"},
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}


def _model_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "qwen3_5_model"
    folder.mkdir()
    real = Path(ROOT) / "models" / "qwen3_5" / "models"
    for name in (MODELING, "configuration_qwen3_5_moe.py"):
        shutil.copy(real / name, folder / name)
    (folder / "config.json").write_text(json.dumps(SHRUNK))
    return folder


def _apply(tmp_path: Path) -> Path:
    from kvskill.implementer.convert import ApplyOptions
    from kvskill.implementer.writer import apply_model

    out = tmp_path / "qwen3_5_paged"
    apply_model(str(_model_folder(tmp_path)), out, ApplyOptions())
    return out


def _verify(out: Path, **options):
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    settings = {"trust_remote_code": True, "dtype": "bfloat16", "max_new_tokens": 8, **options}
    return verify_directory(out, VerifyOptions(**settings))


needs_checkout = pytest.mark.skipif(not ROOT, reason="KVSKILL_CANN_RECIPES is not set")


@pytest.fixture(scope="module")
def framework_requirements():
    for name in ("datasets", "loguru"):
        pytest.importorskip(name, reason=f"the framework's requirement {name} is not installed")


@needs_checkout
@pytest.mark.slow
@pytest.mark.parametrize(
    ("num_prompts", "max_new_tokens", "block_size", "rows"),
    # the second: 37 prompt tokens, more than the engine's usual step budget of 32, still
    # prefilled in one step (the static decode batch needs every prompt in every decode
    # step); blocks of 4 tokens, 17 steps
    [(4, 8, None, [4, 19, 32]), (6, 16, 4, [6, 27, 32])],
)
def test_the_real_qwen3_5_is_token_exact_against_its_legacy_original(
    tmp_path, framework_requirements, num_prompts, max_new_tokens, block_size, rows
):
    report = _verify(
        _apply(tmp_path),
        num_prompts=num_prompts,
        max_new_tokens=max_new_tokens,
        block_size=block_size,
    )
    assert report.error is None
    assert report.tokens_identical and report.logits_within
    assert report.max_logit_diff <= report.atol
    assert [c["passed"] for c in report.chains] == [True, True, True]
    runtime_chain = next(c for c in report.chains if c["name"] == "runtime")
    assert "Mamba" in str(runtime_chain) and "FullAttention" in str(runtime_chain)
    notes = "\n".join(report.notes)
    # the Legacy rows its init_cache allocated: a row per prompt, longest prompt + new tokens,
    # 2 kv heads x 16
    assert f"Legacy rows allocated by init_cache: {rows}" in notes
    # at one rank the MoE still takes the expert-parallel path, through groups the model
    # registers only above one rank
    assert "['moe_ep_group', 'moe_ep_group_mc2']" in notes
    assert f"the framework imported from {ROOT}" in notes


#: (what the mutation breaks, the line of the converted file, its replacement)
MUTATIONS = [
    (
        "a gated-delta decode reading another request's recurrent state",
        "ssm_state_indices=state_index.to(torch.int32),",
        "ssm_state_indices=state_index.flip(0).to(torch.int32),",
    ),
    (
        "keys and values written at the wrong slots",
        "slots = md.slot_mapping[self.attn_type].view(-1, 1)",
        "slots = md.slot_mapping[self.attn_type].flip(0).view(-1, 1)",
    ),
]


@needs_checkout
@pytest.mark.slow
@pytest.mark.parametrize(("broken", "right", "wrong"), MUTATIONS, ids=["state-block", "kv-slot"])
def test_verify_fails_a_wrong_conversion_of_the_real_qwen3_5(
    tmp_path, framework_requirements, broken, right, wrong
):
    out = _apply(tmp_path)
    modeling = out / MODELING
    text = modeling.read_text(encoding="utf-8")
    assert text.count(right) == 1, broken
    modeling.write_text(text.replace(right, wrong))
    report = _verify(out)
    assert report.error is None
    assert not report.tokens_identical, broken


@needs_checkout
@pytest.mark.slow
def test_a_float32_run_of_the_real_qwen3_5_is_refused_in_one_line(
    tmp_path, framework_requirements, capsys
):
    """Its gated-delta kernels return bfloat16 whatever the model dtype, which the next
    operator refuses against float32 weights: exit 3, one line naming it, no traceback."""
    from kvskill.cli import main

    out = _apply(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["verify", str(out), "--trust-remote-code", "--max-new-tokens", "2"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "kvskill:" in line]
    assert exc.value.code == 3
    assert len(errors) == 1 and "Traceback" not in errors[0]
    assert "does not run on the CPU stand-in in float32" in errors[0]
    assert "npu_rms_norm" in errors[0]


def test_without_a_checkout_verify_is_refused_naming_the_framework_imports(tmp_path, monkeypatch):
    """No KVSKILL_CANN_RECIPES and no checkout above the model folder: exit 3, one line."""
    from kvskill.verify.drivers.legacy_checkout import checkout_for

    monkeypatch.delenv("KVSKILL_CANN_RECIPES", raising=False)
    (tmp_path / MODELING).write_text(
        "from executor.core.config import InferenceConfig\nfrom module.linear import X\n"
    )
    with pytest.raises(UnsupportedModelError) as info:
        checkout_for(tmp_path, MODELING)
    assert "imports 'executor.core.config', 'module.linear'" in str(info.value)
    assert "set KVSKILL_CANN_RECIPES" in str(info.value)


def test_a_model_folder_inside_a_checkout_finds_it(tmp_path, monkeypatch):
    from kvskill.verify.drivers.checkout import find_checkout

    monkeypatch.delenv("KVSKILL_CANN_RECIPES", raising=False)
    checkout = tmp_path / "cann-recipes-infer"
    (checkout / "executor" / "core" / "kv_cache").mkdir(parents=True)
    (checkout / "executor" / "core" / "kv_cache" / "cache_info.py").write_text("")
    (checkout / "module").mkdir()
    model = checkout / "models" / "qwen3_5" / "models"
    model.mkdir(parents=True)
    assert find_checkout(model) == checkout.resolve()
    # a folder outside any checkout has none; KVSKILL_CANN_RECIPES wins when set
    assert find_checkout(tmp_path) is None
    monkeypatch.setenv("KVSKILL_CANN_RECIPES", str(tmp_path / "elsewhere"))
    assert find_checkout(model) == tmp_path / "elsewhere"


@needs_checkout
def test_one_rank_comm_answers_the_groups_the_model_skips_and_keeps_its_own(
    framework_requirements,
):
    """The checkout's CommManager at world size 1: registered groups keep its answers; a
    group read without registration is rank 0 alone (the default group, a stand-in name)."""
    import torch.distributed as dist
    from kvskill.runtime.ops.npu_standin import npu_standin
    from kvskill.verify.drivers.checkout import (
        ONE_RANK_COMM_NAME,
        one_rank_comm,
        one_rank_process_group,
    )

    with npu_standin(framework_root=ROOT), one_rank_process_group():
        from executor.core.config import CommManager, InferenceConfig

        settings = {"model_config": {"model_name": "m", "model_path": "p", "exe_mode": "eager"},
                    "data_config": {"dataset": "default", "input_truncated_len": 8},
                    "parallel_config": {"world_size": 1},
                    "scheduler_config": {"batch_size": 2, "max_new_tokens": 2}}  # fmt: skip
        infer = InferenceConfig.from_dict(settings, global_rank=0, local_rank=0)
        comm = one_rank_comm(CommManager, infer.parallel_config)
        comm.register_group(name="attn_tp_group", group_num=1, group_size=1, return_name=True)
        assert comm.get_group("attn_tp_group") is None and comm.get_rank("attn_tp_group") == 0
        assert comm.get_group_name("attn_tp_group") is None  # the checkout's own answer
        assert comm.answered_groups == set()
        assert comm.get_group("moe_ep_group") is None
        assert comm.get_group_name("moe_ep_group_mc2") == ONE_RANK_COMM_NAME
        assert comm.answered_groups == {"moe_ep_group", "moe_ep_group_mc2"}
        assert dist.get_world_size() == 1
    assert not dist.is_initialized(), "the process group the block created is gone"

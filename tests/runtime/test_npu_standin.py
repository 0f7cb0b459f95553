"""The CPU stand-in for torch_npu and torchair: installed for a block, answered honestly,
removed after."""

from __future__ import annotations

import sys

import pytest
import torch
from kvskill.runtime.ops import reference
from kvskill.runtime.ops.npu_standin import StandinConflictError, StandinRefusal, npu_standin
from kvskill.runtime.ops.reference import RefusedOperatorError


def test_the_standin_answers_a_models_imports_and_device_calls_and_leaves_nothing_behind():
    assert "torch_npu" not in sys.modules and not hasattr(torch, "npu")
    ops_npu_before = torch.ops.__dict__.get("npu")
    with npu_standin() as standin:
        # a model's top-level imports
        import torch_npu
        import torchair
        from torchair.configs.compiler_config import CompilerConfig

        assert torch_npu is standin and torch_npu.__version__.startswith("2.13.0+")
        torchair.patch_for_hcom()  # nothing to patch without HCCL
        # operators: the reference ones, by torch_npu.X and torch.ops.npu.X alike
        assert torch_npu.npu_rms_norm is reference.npu_rms_norm
        assert (
            torch.ops.npu.npu_fused_infer_attention_score
            is reference.npu_fused_infer_attention_score
        )
        assert not hasattr(torch_npu, "rms_norm")  # the reference's submodules stay private
        # the device is the CPU, and no NPU is claimed
        assert torch.npu is torch_npu.npu
        assert not torch.npu.is_available() and torch.npu.device_count() == 0
        assert torch.zeros(1, device=torch.npu.current_device()).device.type == "cpu"
        torch.npu.config.allow_internal_format = False
        torch.npu.set_compile_mode(jit_compile=False)
        with torch.npu.stream(torch.npu.Stream()):
            torch.npu.synchronize()
        free, total = torch.npu.mem_get_info()
        assert 0 < free <= total
        # graph mode and quantized operators refuse by name, in one line
        with pytest.raises(StandinRefusal, match="graph mode"):
            CompilerConfig()
        with pytest.raises(StandinRefusal, match="torchair.ops.npu_fused_infer_attention_score"):
            _ = torchair.ops.npu_fused_infer_attention_score
        with pytest.raises(RefusedOperatorError, match="torch_npu.npu_quant_matmul: quantized"):
            torch_npu.npu_quant_matmul(torch.ones(1), torch.ones(1))
    # everything is as before
    assert "torch_npu" not in sys.modules and "torchair.configs" not in sys.modules
    assert not hasattr(torch, "npu")
    assert torch.ops.__dict__.get("npu") is ops_npu_before


def test_the_profiler_is_torchs_over_cpu_activity_and_says_npu_activity_is_missing():
    with npu_standin() as torch_npu:
        prof = torch_npu.profiler
        with pytest.warns(UserWarning, match="CPU activity only"):
            session = prof.profile(
                activities=[prof.ProfilerActivity.NPU, prof.ProfilerActivity.CPU],
                experimental_config=prof._ExperimentalConfig(
                    profiler_level=prof.ProfilerLevel.Level1,
                    aic_metrics=prof.AiCMetrics.PipeUtilization,
                ),
                schedule=prof.schedule(wait=0, warmup=1, active=1),
            )
        # not entered: starting the profiler costs seconds and proves nothing more here
        assert isinstance(session, torch.profiler.profile)
        assert session.activities == {torch.profiler.ProfilerActivity.CPU}


def test_a_loaded_torch_npu_is_never_shadowed_and_framework_modules_are_dropped(tmp_path):
    (tmp_path / "fw_pkg").mkdir()
    (tmp_path / "fw_pkg" / "layer.py").write_text(
        "import torch_npu\nNORM = torch_npu.npu_rms_norm\n"
    )
    with npu_standin(framework_root=tmp_path):
        from fw_pkg import layer

        assert layer.NORM is reference.npu_rms_norm
        with pytest.raises(StandinConflictError, match="already imported"), npu_standin():
            pass
    assert "fw_pkg.layer" not in sys.modules and str(tmp_path) not in sys.path

"""Backend selection for kvskill.runtime.ops.torch_npu."""

from __future__ import annotations

import sys
import types

import pytest
from kvskill.runtime import ops


def test_tests_run_on_the_reference_backend():
    assert ops.torch_npu is ops.reference
    assert ops.backend().name == "reference"
    assert ops.backend().reason


def test_forced_reference(monkeypatch):
    monkeypatch.setenv("KVSKILL_OPS", "reference")
    module, chosen = ops._select()
    assert module is ops.reference and "forces" in chosen.reason


def test_auto_without_torch_npu(monkeypatch):
    monkeypatch.setenv("KVSKILL_OPS", "auto")
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails
    module, chosen = ops._select()
    assert module is ops.reference and chosen.reason == "torch_npu is not installed"


def test_forced_npu_without_torch_npu_fails_loudly(monkeypatch):
    monkeypatch.setenv("KVSKILL_OPS", "npu")
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(ImportError, match="KVSKILL_OPS=npu"):
        ops._select()


def test_auto_with_torch_npu_but_no_device_and_forced_npu(monkeypatch):
    fake = types.ModuleType("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setenv("KVSKILL_OPS", "auto")
    module, chosen = ops._select()
    assert module is ops.reference and "no NPU device" in chosen.reason
    monkeypatch.setenv("KVSKILL_OPS", "npu")
    module, chosen = ops._select()
    assert module is fake and chosen.name == "npu"


def test_unknown_choice(monkeypatch):
    monkeypatch.setenv("KVSKILL_OPS", "gpu")
    with pytest.raises(ValueError, match="'auto', 'npu' or 'reference'"):
        ops._select()


def test_reference_module_exposes_the_operator_names():
    for name in (
        "npu_fused_infer_attention_score",
        "npu_fused_infer_attention_score_v2",
        "npu_scatter_nd_update_",
        "scatter_update_",
        "npu_kv_rmsnorm_rope_cache",
        "npu_format_cast",
        "get_npu_format",
    ):
        assert callable(getattr(ops.torch_npu, name))
    for name in ("causal_conv1d_fn", "causal_conv1d_update", "recurrent_gated_delta_rule"):
        assert callable(getattr(ops.fla, name))


def test_format_cast_keeps_values_and_records_the_format():
    import torch

    x = torch.randn(4, 32)
    y = ops.torch_npu.npu_format_cast(x, 29)
    assert torch.equal(x, y) and y is not x
    assert ops.torch_npu.get_npu_format(y) == 29 and ops.torch_npu.get_npu_format(x) == 2

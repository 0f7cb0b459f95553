"""The registry of verify drivers: each output kind has exactly one way to be verified, and
the kind follows the converted directory's record (Legacy first, then the runner, then the
tensor-parallel size)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from kvskill.verify.drivers import (
    DRIVERS,
    OWN_FLOWS,
    OutputKind,
    driver_for,
    output_kind,
)
from kvskill.verify.drivers.engine import EngineDriver
from kvskill.verify.drivers.runner import RunnerDriver
from kvskill.verify.drivers.tensor_parallel import TensorParallelDriver
from kvskill.verify.options import VerifyOptions


def _converted(code: dict | None = None, standalone: object | None = None):
    """The two fields the registry reads of a ConvertedDir."""
    return SimpleNamespace(
        plan=SimpleNamespace(code=code or {}),
        record=SimpleNamespace(standalone=standalone),
    )


def test_every_output_kind_is_verified_one_way() -> None:
    assert set(DRIVERS) | set(OWN_FLOWS) == set(OutputKind)
    assert not set(DRIVERS) & set(OWN_FLOWS)


@pytest.mark.parametrize(
    ("code", "standalone", "tp", "kind"),
    [
        ({}, None, None, OutputKind.FRAMEWORK),
        ({}, None, 1, OutputKind.FRAMEWORK),
        ({}, None, 2, OutputKind.TENSOR_PARALLEL),
        ({}, "runner", None, OutputKind.STANDALONE),
        ({"legacy_framework": True}, None, 2, OutputKind.FRAMEWORK_LEGACY),
        ({"legacy_standalone": True}, "runner", None, OutputKind.STANDALONE_LEGACY),
    ],
)
def test_output_kind_follows_the_record(code, standalone, tp, kind) -> None:
    assert output_kind(_converted(code, standalone), tp) is kind


def test_driver_for_builds_the_driver_of_the_kind(tmp_path: Path) -> None:
    engine = driver_for(_converted(), tmp_path, VerifyOptions(seed=3, kv_layout="page_pool"))
    assert isinstance(engine, EngineDriver)
    assert engine.seed == 3 and engine.use_hybrid_blocks and not engine.graph
    assert driver_for(_converted(), tmp_path, VerifyOptions(graph=True)).graph
    tp = driver_for(_converted(), tmp_path, VerifyOptions(tensor_parallel_size=2))
    assert isinstance(tp, TensorParallelDriver)
    assert tp.tensor_parallel_size == 2 and tp.code_dir == tmp_path
    record = object()
    runner = driver_for(_converted(standalone=record), tmp_path, VerifyOptions())
    assert isinstance(runner, RunnerDriver)
    assert runner.record is record and runner.converted_dir == tmp_path


def test_a_legacy_output_has_no_driver(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="framework-Legacy outputs are verified by their own"):
        driver_for(_converted({"legacy_framework": True}), tmp_path, VerifyOptions())


def test_verify_graph_is_refused_for_an_output_the_engine_does_not_drive(tmp_path: Path) -> None:
    from kvskill.core.errors import BadInputError
    from kvskill.implementer.writer import ApplyOptions, apply_model
    from kvskill.verify.flow import verify_directory

    out = tmp_path / "llama"
    options = ApplyOptions(
        deploy_mode="standalone", kv_mode="paged", config_overrides={"num_hidden_layers": 1}
    )
    apply_model("llama", out, options)
    with pytest.raises(BadInputError, match="--graph captures the bundled runtime's decode"):
        verify_directory(out, VerifyOptions(graph=True))

"""Vendor-shape model directories (tests/fixtures/vendor/): analyze -> apply -> verify.

Each is converted in framework mode and in both standalone modes and verified token-exact
against its original, driven with its own tuple cache (verify/reference/drive.py) under the installed
transformers. The compatibility suite (tests/compat/) runs the same under the older locks.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from kvskill.implementer.convert import ApplyOptions
from kvskill.implementer.writer import apply_model
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions
from kvskill.verify.reference.drive import tuple_cache_generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from vendor_fixtures import MODES, VENDOR_FIXTURES, VENDOR_ROOT, convert_and_verify  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES, ids=lambda mode: "-".join(mode))
@pytest.mark.parametrize("name", sorted(VENDOR_FIXTURES))
def test_vendor_shape_converts_and_verifies_token_exact(name, mode, tmp_path):
    report = convert_and_verify(name, tmp_path / "out", *mode)
    assert report.passed, report.failures()
    assert report.tokens_identical
    assert report.max_logit_diff < 1e-4


@pytest.mark.slow
def test_a_rotary_table_sized_by_the_step_alone_fails_verify(tmp_path):
    """Mutation: without ``_paged_seq_len`` the decode steps index past the rotary table
    (kv_seq_len is the step's T tokens, the positions run to the request lengths)."""
    out = tmp_path / "out"
    apply_model(str(VENDOR_ROOT / "grouped_wqkv_bhsd"), out, ApplyOptions())
    modeling = out / "modeling_vendor_wqkv.py"
    text = modeling.read_text(encoding="utf-8")
    assert "seq_len=_paged_seq_len(kv_seq_len)" in text
    modeling.write_text(text.replace("_paged_seq_len(kv_seq_len)", "kv_seq_len"), "utf-8")
    report = verify_directory(out, VerifyOptions(trust_remote_code=True))
    assert not report.passed


def _reference(name: str, tmp_path: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = tmp_path / name
    shutil.copytree(VENDOR_ROOT / name, model_dir)
    config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, trust_remote_code=True).eval()


@pytest.mark.parametrize("name", sorted(VENDOR_FIXTURES))
def test_the_original_driven_by_its_tuple_cache_matches_recomputing_every_step(name, tmp_path):
    model = _reference(name, tmp_path)
    prompt = [5, 17, 3, 250, 9, 41]
    tokens, logits = tuple_cache_generate(model, prompt, 5)
    assert logits.shape == (5, model.config.vocab_size)
    sequence = list(prompt)
    with torch.no_grad():
        for step in range(5):
            full = model(input_ids=torch.tensor([sequence]), use_cache=False).logits[0, -1]
            assert torch.allclose(full.float(), logits[step], atol=1e-5)
            sequence.append(int(full.argmax()))
    assert tokens == sequence[len(prompt) :]

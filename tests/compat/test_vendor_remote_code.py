"""The vendor-shape model directories (tests/fixtures/vendor/) under the installed transformers.

They are written in the style of remote code for transformers 4.3x-4.4x (tuple caches grown
with torch.cat, fused projections, heads not named lm_head, no logits_to_keep), so the locks
of that era are where they belong; the main suite runs them under 5.x as well.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kvskill.implementer.writer import ApplyOptions, apply_model
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions
from transformers.cache_utils import DynamicCache

from tests.compat.roundtrip import MODES, assert_token_exact, round_trip

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from vendor_fixtures import (  # noqa: E402
    MLA_HUB_FIXTURES,
    MLA_VENDOR_FIXTURES,
    VENDOR_FIXTURES,
    VENDOR_ROOT,
)

pytestmark = [pytest.mark.compat, pytest.mark.slow]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(VENDOR_FIXTURES))
def test_vendor_shape_is_token_exact(name, mode, tmp_path):
    report = round_trip(str(VENDOR_ROOT / name), tmp_path / mode, mode, trust_remote_code=True)
    assert_token_exact(report)


@pytest.mark.parametrize("name", sorted(MLA_VENDOR_FIXTURES))
def test_mla_vendor_shape_is_token_exact(name, tmp_path):
    # framework mode only: the absorbed MLA path has no standalone mode 1 (refused), and its
    # standalone mode 3 runs the same attention code (checked in the main suite)
    report = round_trip(str(VENDOR_ROOT / name), tmp_path / "framework", trust_remote_code=True)
    assert_token_exact(report)


#: the hub files' cache API; transformers removed it after 4.4x, and their originals with it
HUB_CACHE_API = hasattr(DynamicCache, "get_usable_length")


@pytest.mark.skipif(
    not HUB_CACHE_API, reason="the hub shape's original needs Cache.get_usable_length"
)
@pytest.mark.parametrize(
    ("mode", "variant"),
    [("framework", "eager"), ("standalone", "eager"), ("framework", "flash_attention_2")],
)
@pytest.mark.parametrize("name", sorted(MLA_HUB_FIXTURES))
def test_mla_hub_family_is_token_exact_in_every_variant(name, mode, variant, tmp_path):
    """Each variant of the ATTENTION_CLASSES family, converted, against the original's eager
    attention. verify builds both with eager attention (flash-attn is not installed), so the
    converted file's entry for "eager" is pointed at the converted flash variant: its forward
    is then the one the runtime (or the standalone runner) drives."""
    out = tmp_path / "out"
    apply_model(str(VENDOR_ROOT / name), out, ApplyOptions(deploy_mode=mode, kv_mode="paged"))
    if variant == "flash_attention_2":
        modeling = next(out.glob("modeling_*.py"))
        text = modeling.read_text(encoding="utf-8")
        eager = '"eager": VendorV3Attention,'
        assert text.count(eager) == 1
        modeling.write_text(text.replace(eager, '"eager": VendorV3FlashAttention2,'), "utf-8")
    report = verify_directory(out, VerifyOptions(trust_remote_code=True))
    assert_token_exact(report)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_attention_inherited_from_transformers_is_token_exact(mode, tmp_path):
    # the installed transformers' own modeling_llama.py is converted into the output directory
    # (its 4.46 attention family, its 4.55 / 5.x single class) and the file imports it there
    model = VENDOR_ROOT / "inherited_llama_attention"
    report = round_trip(str(model), tmp_path / mode, mode, trust_remote_code=True)
    assert_token_exact(report)

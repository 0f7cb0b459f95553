"""The DeepSeek-V3 hub shape of latent attention as a class family
(tests/fixtures/vendor/mla_family_bhsd).

``VendorV3FlashAttention2(VendorV3Attention)`` only forwards its ``__init__`` arguments to the
base and is chosen through ``ATTENTION_CLASSES``: the latent caches and their helpers are
declared once, in the base's ``__init__``, and every variant's forward gets its own paged
seam. The flash variant re-lays the query out for its kernel after the cache write; the seam
reads it as it stands at the write. The end-to-end runs (both modes, both variants) are in
tests/compat/test_vendor_remote_code.py: the hub file's cache API is transformers 4's.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from kvskill.analyzer import analyze_model
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.mla import MlaSpec
from kvskill.implementer.pipeline import convert_mla_source

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from vendor_fixtures import VENDOR_ROOT  # noqa: E402

FIXTURE = VENDOR_ROOT / "mla_family_bhsd"
MODELING = "modeling_vendor_v3.py"
#: the flash variant's own __init__: it only forwards to the base's
FLASH_INIT = """\
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # flash-attn before 2.1 aligned its causal mask top-left (wrong for q_len != kv_len)
        self._flash_attn_uses_top_left_mask = False

"""
FLASH_RELAYOUT = "        query_states = query_states.transpose(1, 2)\n"


@pytest.fixture(scope="module")
def plan():
    return analyze_model(str(FIXTURE))


@pytest.fixture(scope="module")
def spec(plan) -> MlaSpec:
    return MlaSpec.from_plan(plan)


@pytest.fixture(scope="module")
def source() -> str:
    return (FIXTURE / MODELING).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def converted(spec, source) -> str:
    return convert_mla_source(source, spec, filename=MODELING)


def _class_text(module: str, name: str) -> str:
    start = module.index(f"class {name}(")
    end = module.find("\nclass ", start + 1)
    return module[start:end]


def test_the_plan_is_absorbed_mla_with_the_yarn_scale_and_interleaved_rope(plan):
    assert plan.attention.value == "mla" and plan.mla_absorb
    assert plan.input_layout.value == "TND_NTD"
    # (16 + 64)^-0.5 * mscale(4, mscale_all_dim=1)^2, as the attention's __init__ computes it
    assert plan.softmax_scale == pytest.approx(80**-0.5 * (0.1 * math.log(4) + 1) ** 2)
    assert plan.rope_style == "interleaved"
    assert plan.mla_cache_write == "scatter"


def test_the_latent_caches_and_helpers_are_declared_once_in_the_base(converted):
    base = _class_text(converted, "VendorV3Attention")
    flash = _class_text(converted, "VendorV3FlashAttention2")
    assert converted.count("self.cache_entries = [") == 1
    assert "self.cache_entries = [" in base
    for helper in ("def set_nope_cache", "def absorbed_kv_b_proj", "def update_latent_cache"):
        assert converted.count(helper) == 1 and helper in base
    # the variant keeps its own __init__ as written, and inherits the caches through it
    assert FLASH_INIT in flash
    assert '"flash_attention_2": VendorV3FlashAttention2,' in converted


def test_every_variant_forward_writes_the_latent_and_attends_paged(converted):
    for name in ("VendorV3Attention", "VendorV3FlashAttention2"):
        forward = _class_text(converted, name).split("    def forward(")[1]
        forward = forward.split("\n    def ")[0]
        assert "mla_latent = self.kv_a_layernorm(compressed_kv)" in forward, name
        assert forward.count("torch_npu.npu_fused_infer_attention_score(") == 2, name
        assert "past_key_value.update(" not in forward, name
        assert "scale=self.softmax_scale," in forward, name
        assert "seq_len=_paged_seq_len(kv_seq_len)" in forward, name
    flash = _class_text(converted, "VendorV3FlashAttention2")
    forward = flash.split("    def forward(")[1].split("\n    def _flash_attention_forward(")[0]
    assert "self._flash_attention_forward(" not in forward
    # the query is flattened as it stands at the cache write ([b, h, s, d]); the variant's own
    # relayout for its kernel ([b, s, h, d]) and its autocast cast are gone with the kernel
    assert FLASH_RELAYOUT not in flash
    assert "input_dtype" not in forward
    assert "query_tnd = query_states.transpose(1, 2).reshape(" in forward


# NOTE: each conversion of this file costs seconds of libcst: the two tests that convert it
# again run in the slow suite
@pytest.mark.slow
def test_converting_the_converted_file_changes_nothing(spec, converted):
    assert convert_mla_source(converted, spec, filename=MODELING) == converted


@pytest.mark.slow
def test_a_variant_without_an_init_of_its_own_converts_the_same(spec, source, converted):
    assert FLASH_INIT in source
    bare = source.replace(FLASH_INIT, "", 1)
    out = convert_mla_source(bare, spec, filename=MODELING)
    assert out == converted.replace(FLASH_INIT, "", 1)


def test_a_query_changed_after_the_cache_write_is_refused_naming_the_statement(spec, source):
    assert source.count(FLASH_RELAYOUT) == 1
    scaled = "        query_states = query_states * 2\n"
    broken = source.replace(FLASH_RELAYOUT, FLASH_RELAYOUT + scaled)
    with pytest.raises(UnsupportedModelError) as refused:
        convert_mla_source(broken, spec, filename=MODELING)
    message = str(refused.value)
    assert "\n" not in message
    assert (
        "VendorV3FlashAttention2.forward rebinds query_states between its cache write and its "
        "attention call (query_states = query_states * 2)" in message
    )
    # the statement it names is the one in the file
    assert scaled.strip() in broken

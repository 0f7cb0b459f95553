"""The self-check after rewriting: every path of every forward that declares caches writes them
with a cache-write operator and then reads them with the fused attention."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.self_check import self_check, self_check_problems

INIT = """\
    def __init__(self, config):
        super().__init__()
        self.k_cache = torch.Tensor([])
        self.v_cache = torch.Tensor([])
        self.cache_entries = [
            CacheEntry(cache_name="k_cache", attn_type="FullAttention", dim=64, num_head=2,
                       dtype=torch.float16, needs_block=True, tensor_setter=self.set_k_cache),
            CacheEntry(cache_name="v_cache", attn_type="FullAttention", dim=64, num_head=2,
                       dtype=torch.float16, needs_block=True, tensor_setter=self.set_v_cache),
        ]
"""
#: the generated helper's shape: both of its paths write both caches
UPDATE_CACHE = """\
    def update_cache(self, slots, key, value):
        if self.k_cache.is_contiguous():
            torch_npu.npu_scatter_nd_update_(self.k_cache.view(-1, 2, 64), slots, key)
            torch_npu.npu_scatter_nd_update_(self.v_cache.view(-1, 2, 64), slots, value)
            return
        torch_npu.npu_scatter_nd_update_(self.k_cache, slots, key)
        torch_npu.npu_scatter_nd_update_(self.v_cache, slots, value)
"""
WRITE = "self.update_cache(md.slot_mapping[self.attn_type], k, v)"
READ = (
    "out, _ = torch_npu.npu_fused_infer_attention_score("
    "q, self.k_cache.view(-1, 16, 128), self.v_cache.view(-1, 16, 128))"
)


def converted(body: str, helper: str = UPDATE_CACHE, init: str = INIT) -> str:
    """A converted attention class whose forward body is BODY (indented by four)."""
    forward = "    def forward(self, q, k, v):\n        md = get_forward_metadata()\n"
    forward += textwrap.indent(textwrap.dedent(body), " " * 8)
    return f"class Attn(nn.Module):\n{init}\n{helper}\n{forward}"


#: the source the converted classes came from: one attention class named Attn
SOURCE = """\
class Attn(nn.Module):
    def __init__(self, config):
        super().__init__()

    def forward(self, q, k, v, cache):
        k, v = cache.update(k, v, self.layer_idx)
        return F.scaled_dot_product_attention(q, k, v)
"""


def problems(code: str, source: str = SOURCE) -> list[str]:
    return self_check_problems(cst.parse_module(source), cst.parse_module(code))


def test_a_write_then_a_read_on_the_only_path_passes():
    assert problems(converted(f"{WRITE}\n{READ}\nreturn out\n")) == []


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # an early exit before the write
        (
            f"if q.shape[0] == 0:\n    return q\n{WRITE}\n{READ}\nreturn out\n",
            "Attn.forward leaves at a return (line 24) without writing k_cache, v_cache",
        ),
        # the write on one branch only
        (
            f"if md.is_prefill:\n    {WRITE}\n{READ}\nreturn out\n",
            "Attn.forward leaves at a return (line 26) without writing k_cache, v_cache",
        ),
        # the read before the write: this step's own keys are not in the cache yet
        (
            f"{READ}\n{WRITE}\nreturn out\n",
            "without reading k_cache, v_cache with the fused attention after the write",
        ),
        # the read on one branch only, ending the forward without a return
        (
            f"{WRITE}\nif md.is_prefill:\n    {READ}\nelse:\n    out = q\nself.out = out\n",
            "Attn.forward leaves at its end (line 21) without reading k_cache, v_cache",
        ),
        # a write that may not run: the right operand of `and`, a conditional expression
        (
            f"ok = md.is_prefill and {WRITE}\n{READ}\nreturn out\n",
            "without writing k_cache, v_cache",
        ),
        (f"x = {WRITE} if md.is_prefill else None\n{READ}\nreturn out\n", "without writing"),
        # a loop body may not run at all
        (f"for _ in range(md.num_steps):\n    {WRITE}\n{READ}\nreturn out\n", "without writing"),
        # the fused attention over this step's keys and values, not the cache
        (
            f"{WRITE}\nout, _ = torch_npu.npu_fused_infer_attention_score(q, k, v)\nreturn out\n",
            "without reading k_cache, v_cache",
        ),
        # ... with the block size taken from the cache: describing a cache is not reading it
        (
            f"{WRITE}\nnum_blocks, block_size = self.k_cache.shape[:2]\n"
            "out, _ = torch_npu.npu_fused_infer_attention_score(q, k, v, block_size=block_size)\n"
            "return out\n",
            "without reading k_cache, v_cache",
        ),
    ],
    ids=[
        "early-return",
        "write-on-one-branch",
        "read-before-write",
        "read-on-one-branch",
        "write-in-and",
        "write-in-ifexp",
        "write-in-loop",
        "read-of-dense-kv",
        "read-of-dense-kv-cache-block-size",
    ],
)
def test_a_path_that_misses_the_cache_is_a_problem(body, expected):
    found = problems(converted(body))
    assert any(expected in p for p in found), found


@pytest.mark.parametrize(
    "body",
    [
        # both branches write
        f"if md.is_prefill:\n    {WRITE}\nelse:\n    {WRITE}\n{READ}\nreturn out\n",
        # a raise ends a path without a result: it needs no cache
        f"if q.dim() != 3:\n    raise ValueError('TND')\n{WRITE}\n{READ}\nreturn out\n",
        # the write under a `with`, the read after it
        f"with torch.no_grad():\n    {WRITE}\n{READ}\nreturn out\n",
    ],
    ids=["both-branches", "raise", "with"],
)
def test_paths_that_all_write_and_read_pass(body):
    assert problems(converted(body)) == []


def test_a_helper_that_writes_on_one_path_only_does_not_count():
    helper = UPDATE_CACHE.replace(
        "            return\n", "            return\n        if self.skip:\n            return\n"
    )
    found = problems(converted(f"{WRITE}\n{READ}\nreturn out\n", helper=helper))
    assert any("without writing k_cache, v_cache" in p for p in found), found


def test_an_entry_the_helper_never_writes_is_named():
    helper = UPDATE_CACHE.replace(
        "            torch_npu.npu_scatter_nd_update_(self.v_cache.view(-1, 2, 64), slots, value)\n",
        "",
    )
    found = problems(converted(f"{WRITE}\n{READ}\nreturn out\n", helper=helper))
    assert found == [
        "Attn.forward leaves at a return (line 24) without writing v_cache with a cache-write "
        "operator"
    ]


def test_a_loop_over_a_literal_tuple_runs_and_its_aliases_reach_the_caches():
    # the shape of the generated MLA scatter helper: one write per (cache, value) pair
    helper = """\
    def update_cache(self, slots, key, value):
        for cache, new in ((self.k_cache, key), (self.v_cache, value)):
            rows = cache.view(-1, 16)
            torch_npu.npu_scatter_nd_update_(rows, slots, new)
"""
    nz = (
        "k_nz = self.nz_view(self.k_cache)\n"
        "out, _ = torch_npu.npu_fused_infer_attention_score(q, k_nz, key_rope=self.v_cache)\n"
    )
    assert problems(converted(f"{WRITE}\n{nz}return out\n", helper=helper)) == []


def test_a_fused_write_operator_called_directly_counts():
    body = (
        "torch_npu.npu_kv_rmsnorm_rope_cache(kv, w, cos, sin, slots, self.v_cache, "
        f"self.k_cache, cache_mode='PA_NZ')\n{READ}\nreturn out\n"
    )
    assert problems(converted(body, helper="")) == []


def test_an_attention_class_of_the_source_left_unconverted_is_named():
    found = problems(SOURCE)
    assert found == [
        "Attn is an attention class of the source but is not converted (its forward does not "
        "write declared cache_entries with a cache-write operator and read them with the fused "
        "attention)"
    ]


def test_a_subclass_converted_through_its_base_passes():
    # an attention family: the subclass keeps the base's __init__ (and its caches)
    base = converted(f"{WRITE}\n{READ}\nreturn out\n")
    sub = textwrap.dedent(
        f"""
        class SdpaAttn(Attn):
            def forward(self, q, k, v):
                md = get_forward_metadata()
                {WRITE}
                {READ}
                return out
        """
    )
    source = SOURCE + SOURCE.replace("class Attn(nn.Module):", "class SdpaAttn(Attn):").replace(
        "    def __init__(self, config):\n        super().__init__()\n\n", ""
    )
    assert problems(base + sub, source) == []
    dropped = sub.replace(f"                {WRITE}\n".replace(" " * 16, " " * 8), "")
    found = problems(base + dropped, source)
    assert found and all("SdpaAttn" in p for p in found), found


def test_recurrent_state_layers_are_not_attention_caches():
    state = """\
class GatedDelta(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.cache_entries = [MambaCacheEntry(cache_name="ssm_state", shape=[2, 4], dtype=None,
                                              needs_block=True, tensor_setter=None)]

    def forward(self, x):
        return fla.recurrent_gated_delta_rule(x)
"""
    assert problems(converted(f"{WRITE}\n{READ}\nreturn out\n") + "\n\n" + state) == []


def test_the_refusal_names_file_path_and_class():
    with pytest.raises(UnsupportedModelError) as exc:
        self_check(
            cst.parse_module(SOURCE),
            cst.parse_module(converted(f"{READ}\nreturn out\n")),
            "modeling_x.py",
            "contiguous",
        )
    message = str(exc.value)
    assert message.startswith("modeling_x.py: cannot convert (contiguous path): ")
    assert "self-check" in message and "Attn.forward" in message
    assert exc.value.exit_code == 3

"""A vendor file whose attention already carries an NPU branch: converted so that every path
goes through the paged cache, or refused (exit 3) naming the class; never half-converted."""

from __future__ import annotations

import json

import libcst as cst
import pytest
from kvskill.analyzer.lint import lint_source
from kvskill.cli import main
from kvskill.implementer.npu_branch import inline_npu_branches
from kvskill.implementer.self_check import self_check_problems
from npu_branch_model import KV_FIRST, MODELING, write_npu_branch_model

NPU_IF = "        if self.use_npu_fa and NPU_AVAILABLE:\n"
MODES = {
    "framework": (),
    "standalone": ("--mode", "standalone"),
    "contiguous": ("--mode", "standalone", "--kv-mode", "contiguous"),
}


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.fixture(scope="module")
def applied(tmp_path_factory):
    """The fixture converted in each mode (and its kv-first variant, framework mode)."""
    root = tmp_path_factory.mktemp("npu_branch")
    model = write_npu_branch_model(root / "src")
    kv_first = write_npu_branch_model(root / "src_kv_first", KV_FIRST)
    out = {}
    for mode, flags in MODES.items():
        out[mode] = root / mode
        with pytest.raises(SystemExit) as exc:
            main(["apply", str(model), "--out", str(out[mode]), *flags])
        assert exc.value.code == 0, mode
    out["kv_first"] = root / "kv_first"
    with pytest.raises(SystemExit) as exc:
        main(["apply", str(kv_first), "--out", str(out["kv_first"])])
    assert exc.value.code == 0
    return out


def _attention(source: str) -> cst.ClassDef:
    module = cst.parse_module(source)
    return next(
        c for c in module.body if isinstance(c, cst.ClassDef) and c.name.value == "TinyNpuAttention"
    )


@pytest.mark.parametrize("mode", [*MODES, "kv_first"])
def test_every_path_of_the_converted_forward_uses_the_cache(applied, mode):
    code = (applied[mode] / "modeling_tiny_npu.py").read_text()
    # the NPU branch is gone with its dense-cache fused attention; one paged seam is left
    assert NPU_IF not in code
    assert "past_key_values.update(" not in code
    assert code.count("torch_npu.npu_fused_infer_attention_score(") == 1
    assert "        self.update_cache(" in code
    # the note says what went, where it went
    assert "# kvskill: `if self.use_npu_fa and NPU_AVAILABLE:` chose the fused attention\n" in code
    # the file's own `torch_npu = None` (no NPU here) no longer shadows the runtime's ops
    own, ours = (
        code.index("    torch_npu = None\n"),
        code.index("\nfrom kvskill.runtime.ops import torch_npu\n"),
    )
    assert own < ours
    original = KV_FIRST if mode == "kv_first" else MODELING
    assert self_check_problems(cst.parse_module(original), cst.parse_module(code)) == []
    assert lint_source(code) == []


def test_the_paged_modes_read_the_block_table_and_contiguous_the_rows(applied):
    for mode in ("framework", "standalone"):
        code = (applied[mode] / "modeling_tiny_npu.py").read_text()
        assert "block_table=md.block_table[self.attn_type]" in code
    contiguous = (applied["contiguous"] / "modeling_tiny_npu.py").read_text()
    assert "torch_npu.scatter_update_(self.k_cache, write_start, key, 1)" in contiguous
    assert 'input_layout="BSH"' in contiguous


def test_applying_to_the_converted_output_changes_nothing(applied, tmp_path, capsys):
    first = applied["framework"]
    code, _, err = run_cli(capsys, "apply", str(first), "--out", str(tmp_path / "again"))
    assert code == 0, err
    again = (tmp_path / "again" / "modeling_tiny_npu.py").read_text()
    assert again == (first / "modeling_tiny_npu.py").read_text()


def test_the_framework_conversion_verifies_token_exact(applied, capsys):
    code, out, err = run_cli(
        capsys,
        "verify",
        str(applied["framework"]),
        "--trust-remote-code",
        "--format",
        "json",
        "--num-prompts",
        "3",
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["passed"] is True and report["tokens_identical"] is True


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["standalone", "contiguous", "kv_first"])
def test_the_other_conversions_verify_token_exact(applied, capsys, mode):
    code, out, err = run_cli(
        capsys, "verify", str(applied[mode]), "--trust-remote-code", "--format", "json"
    )
    assert code == 0, err
    assert json.loads(out)["passed"] is True


# refusals: exit 3, one line naming the class, nothing written ------------------------------

ELIF = MODELING.replace(
    "        else:\n            if past_key_values is not None:",
    "        elif q_len > 0:\n            if past_key_values is not None:",
)
PAGED_NPU = MODELING.replace(
    "                sparse_mode=0,\n",
    "                sparse_mode=0,\n                block_table=self.block_table,\n",
)
UNGUARDED = MODELING.replace(
    "        attn_output = attn_output.reshape(bsz, q_len, -1)\n",
    "        attn_output = attn_output.reshape(bsz, q_len, -1)\n"
    "        _ = torch_npu.npu_fused_infer_attention_score(query_states, key_states, value_states)\n",
)
NO_KERNEL = MODELING.replace(
    """            attn_output = F.scaled_dot_product_attention(
                query_states,
                key_states,
                value_states,
                attn_mask=attention_mask,
                is_causal=attention_mask is None and q_len > 1,
                scale=self.scaling,
                enable_gqa=True,
            )""",
    "            attn_output = query_states",
)
# the shape earlier releases wrote: entries declared, forward untouched (a partial conversion)
HALF = MODELING.replace(
    "        self.use_npu_fa = config.use_npu_fused_attention\n",
    "        self.use_npu_fa = config.use_npu_fused_attention\n"
    "        self.k_cache = torch.Tensor([])\n"
    "        self.cache_entries = [CacheEntry(cache_name='k_cache', attn_type='FullAttention', "
    "dim=32, num_head=2, dtype=torch.float32, tensor_setter=None)]\n",
)


@pytest.mark.parametrize(
    ("modeling", "reason"),
    [
        (ELIF, "without a plain else branch"),
        (PAGED_NPU, "already calls the paged fused attention"),
        (UNGUARDED, "calls the fused attention outside an `if <flag>: ... else: ...`"),
        (NO_KERNEL, "TinyNpuAttention.forward does not write the cache before calling attention"),
        (HALF, "declares cache_entries but its forward does not both write them"),
    ],
    ids=["elif", "paged-npu-branch", "unguarded-fa", "no-kernel", "half-converted"],
)
@pytest.mark.parametrize("mode", ["framework", "contiguous"])
def test_npu_shapes_it_cannot_rewrite_are_refused(tmp_path, capsys, modeling, reason, mode):
    assert modeling != MODELING
    model = write_npu_branch_model(tmp_path / "m", modeling)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "apply", str(model), "--out", str(out), *MODES[mode])
    assert code == 3, err
    assert "modeling_tiny_npu.py" in err and "TinyNpuAttention" in err and reason in err
    assert err.count("\n") == 1
    assert not out.exists()


def test_a_rewrite_that_drops_the_cache_write_is_refused_by_the_self_check(
    tmp_path, capsys, monkeypatch
):
    # A forward rewrite gone wrong (it emits the seam without its cache write) must not
    # produce a file: the self-check reads what was emitted, not what was meant.
    from kvskill.implementer import attn_forward

    emit = attn_forward.statements

    def without_write(*args, **kwargs):
        stmts = emit(*args, **kwargs)
        return [s for s in stmts if "self.update_cache(" not in cst.Module(body=[s]).code]

    monkeypatch.setattr(attn_forward, "statements", without_write)
    from kvskill.implementer import pipeline

    pipeline._CONVERTED.clear()
    model = write_npu_branch_model(tmp_path / "m")
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "apply", str(model), "--out", str(out))
    pipeline._CONVERTED.clear()
    assert code == 3, err
    assert "self-check" in err and "paged path" in err
    assert "TinyNpuAttention.forward leaves at a return (line " in err
    assert "without writing k_cache, v_cache with a cache-write operator" in err
    assert not out.exists()


def test_the_half_conversion_earlier_releases_wrote_is_a_lint_finding(applied):
    # Entries declared and get_cache_info added, but the NPU-branch forward kept as written:
    # what `apply` used to write with exit 0.
    converted = (applied["framework"] / "modeling_tiny_npu.py").read_text()
    module = cst.parse_module(converted)
    original_forward = next(
        f
        for f in _attention(MODELING).body.body
        if isinstance(f, cst.FunctionDef) and f.name.value == "forward"
    )

    class KeepForward(cst.CSTTransformer):
        def leave_FunctionDef(self, original_node, updated_node):
            if (
                updated_node.name.value == "forward"
                and "update_cache(" in cst.Module(body=[updated_node]).code
                and "def update_cache" not in cst.Module(body=[updated_node]).code
            ):
                return original_forward
            return updated_node

    half = module.visit(KeepForward()).code
    assert NPU_IF in half and "self.cache_entries = [" in half
    findings = [f for f in lint_source(half) if f.rule == "KV013"]
    assert sorted(f.message for f in findings) == [
        "TinyNpuAttention.forward never reads the declared cache entries k_cache, v_cache with "
        "the fused attention",
        "TinyNpuAttention.forward never writes the declared cache entries k_cache, v_cache",
    ]
    assert self_check_problems(cst.parse_module(MODELING), cst.parse_module(half))


# the inlining itself ----------------------------------------------------------------------


def _forward(source: str) -> cst.FunctionDef:
    return cst.ensure_type(cst.parse_statement(source), cst.FunctionDef)


def test_the_kernel_branch_takes_the_place_of_the_if_whichever_branch_it_is():
    forward = _forward(
        """\
def forward(self, q, k, v, cache):
    if not self.use_npu:
        k, v = cache.update(k, v, self.layer_idx)
        out = attention_interface(self, q, k, v, None)
    else:
        out = torch_npu.npu_fused_infer_attention_score(q, k, v)[0]
    return out
"""
    )
    inlined = inline_npu_branches("A.forward", forward)
    assert inlined.problems == [] and inlined.conditions == ["not self.use_npu"]
    code = cst.Module(body=[inlined.forward]).code
    assert "npu_fused_infer_attention_score" not in code and "if " not in code
    assert "    k, v = cache.update(k, v, self.layer_idx)\n    out = attention_interface(" in code


def test_a_forward_without_fused_attention_is_left_as_it_is():
    forward = _forward(
        """\
def forward(self, q, k, v, cache):
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx)
    return attention_interface(self, q, k, v, None)
"""
    )
    inlined = inline_npu_branches("A.forward", forward)
    assert inlined.forward is forward and not inlined.problems and not inlined.conditions


def test_fused_attention_in_both_branches_is_a_problem():
    forward = _forward(
        """\
def forward(self, q, k, v):
    if self.decode:
        out = torch_npu.npu_fused_infer_attention_score(q, k, v)[0]
    else:
        out = torch_npu.npu_fused_infer_attention_score(q, k, v, sparse_mode=3)[0]
    return out
"""
    )
    inlined = inline_npu_branches("A.forward", forward)
    assert inlined.problems == [
        "A.forward calls the fused attention in both branches of `if self.decode:`"
    ]

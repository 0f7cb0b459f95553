"""The compiled paged-decode kernel computes what the PyTorch path and the naive math compute."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvskill.runtime.ops import cpu_kernels
from kvskill.runtime.ops import reference as npu
from kvskill.runtime.ops.reference import OpInputError
from ops_golden import (
    CAUSAL_TILE,
    make_mla_paged_case,
    make_paged_case,
    naive_batch,
    naive_request,
    paged_fia_v1,
    rule_for,
    spy_on_decode_kernel,
)

pytestmark = pytest.mark.skipif(
    not cpu_kernels.status().available, reason=cpu_kernels.status().reason
)


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many calls the kernel answered (a None return leaves the call to PyTorch)."""
    return spy_on_decode_kernel(monkeypatch)


def _decode_case(kv_lens, *, heads=4, kv_heads=2, head_dim=64, head_dim_v=None, block_size=16):
    return make_paged_case(
        [1] * len(kv_lens),
        kv_lens,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        block_size=block_size,
        seed=sum(kv_lens),
    )


def _both_paths(call):
    """(kernel result, PyTorch result); the spy records True, then False."""
    got = call()
    with cpu_kernels.disabled():
        want = call()
    return got, want


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,head_dim_v,block_size",
    [
        (4, 2, 64, None, 16),
        (8, 1, 128, None, 4),
        (6, 6, 8, None, 1),
        (16, 2, 20, 12, 3),
    ],
)
def test_decode_matches_naive_and_the_pytorch_path(
    kernel_calls, heads, kv_heads, head_dim, head_dim_v, block_size
):
    kv_lens = [1, 17, 300, 5, 64, 33]
    case = _decode_case(
        kv_lens,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        block_size=block_size,
    )
    got, want = _both_paths(
        lambda: paged_fia_v1(case, num_heads=heads, num_kv_heads=kv_heads, scale=0.125, mode=3)[0]
    )
    assert kernel_calls == [True, False]
    naive, _ = naive_batch(case, 0.125, rule_for(3))
    torch.testing.assert_close(got.double(), naive, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kv_lens=st.lists(st.integers(1, 70), min_size=1, max_size=6),
    kv_heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 3, 8]),
    head_dim=st.sampled_from([4, 16, 17, 64]),
    block_size=st.sampled_from([1, 2, 16]),
)
def test_random_decode_calls_match_naive(kv_lens, kv_heads, group, head_dim, block_size):
    case = _decode_case(
        kv_lens,
        heads=kv_heads * group,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
    )
    out, _ = paged_fia_v1(
        case, num_heads=kv_heads * group, num_kv_heads=kv_heads, scale=0.3, mode=3
    )
    naive, _ = naive_batch(case, 0.3, rule_for(3))
    torch.testing.assert_close(out.double(), naive, atol=2e-5, rtol=2e-5)


def test_request_without_keys_gets_zeros_on_both_paths(kernel_calls):
    case = _decode_case([0, 9, 0])
    got, want = _both_paths(
        lambda: paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.1, mode=0)[0]
    )
    assert kernel_calls == [True, False]
    assert got[0].abs().max() == 0 and got[2].abs().max() == 0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_page_pool_views_and_4d_caches_read_the_same_tokens(kernel_calls):
    """A page view (block stride larger than the block) and the [nb, KVN, bs, D] form."""
    case = _decode_case([40, 3, 129], block_size=8)
    nb, bs, kvn, d = case.key_cache.shape
    page = bs * kvn * d + 24  # each page also holds other data
    pool = torch.randn(2, nb, page)
    for i, cache in enumerate((case.key_cache, case.value_cache)):
        pool[i, :, : bs * kvn * d] = cache.reshape(nb, -1)
    k_view = pool[0].as_strided((nb, bs, kvn * d), (page, kvn * d, 1))
    v_view = pool[1].as_strided((nb, bs, kvn * d), (page, kvn * d, 1))
    k4 = case.key_cache.permute(0, 2, 1, 3).contiguous()
    v4 = case.value_cache.permute(0, 2, 1, 3).contiguous()
    outs = []
    for key, value in ((k_view, v_view), (k4, v4)):
        out, _ = npu.npu_fused_infer_attention_score_v2(
            case.query_tnd,
            key,
            value,
            num_query_heads=4,
            num_key_value_heads=2,
            input_layout="TND",
            softmax_scale=0.2,
            atten_mask=CAUSAL_TILE,
            sparse_mode=3,
            block_table=case.block_table,
            block_size=bs,
            actual_seq_qlen=case.cu_q,
            actual_seq_kvlen=case.kv_lens,
        )
        outs.append(out)
    assert kernel_calls == [True, True]
    naive, _ = naive_batch(case, 0.2, rule_for(3))
    for out in outs:
        torch.testing.assert_close(out.double(), naive, atol=2e-5, rtol=2e-5)


def test_bsh_decode_query(kernel_calls):
    case = _decode_case([12, 50])
    nb, bs = case.key_cache.shape[:2]
    query = torch.stack(case.qs).reshape(2, 1, 4 * 64)
    out, _ = npu.npu_fused_infer_attention_score(
        query,
        case.key_cache.view(nb, bs, -1),
        case.value_cache.view(nb, bs, -1),
        num_heads=4,
        num_key_value_heads=2,
        input_layout="BSH",
        scale=0.1,
        block_table=case.block_table,
        block_size=bs,
        actual_seq_lengths_kv=case.kv_lens,
    )
    assert kernel_calls == [True]
    naive, _ = naive_batch(case, 0.1, rule_for(0))
    torch.testing.assert_close(out.view(2, 4, 64).double(), naive, atol=2e-5, rtol=2e-5)


def test_bfloat16_inputs_are_computed_in_fp32_like_the_pytorch_path(kernel_calls):
    case = make_paged_case(
        [1, 1, 1],
        [5, 70, 33],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.bfloat16,
        seed=3,
    )
    got, want = _both_paths(
        lambda: paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.125, mode=3)[0]
    )
    assert kernel_calls == [True, False]
    assert got.dtype == want.dtype == torch.bfloat16
    # Both round the same fp32 result to bfloat16; summation order may move one ulp.
    torch.testing.assert_close(got, want, atol=0, rtol=2**-7)
    naive, _ = naive_batch(case, 0.125, rule_for(3))
    torch.testing.assert_close(got.double(), naive, atol=2e-2, rtol=2e-2)


def _absorbed_mla_decode(dtype):
    """(call, latent case, rope case): an absorbed MLA decode of 4 requests, 8 heads.

    One latent cache serves as keys and values; the rope keys have their own paged cache
    under the same block table. Scores are scale * (q . latent + q_rope . k_rope).
    """
    kv_lens = [9, 40, 1, 23]
    latent, rope = make_mla_paged_case([1] * 4, kv_lens, num_heads=8, block_size=8, seed=21)
    nb, bs = latent.key_cache.shape[:2]
    key = latent.key_cache.view(nb, bs, -1).to(dtype)

    def call():
        return npu.npu_fused_infer_attention_score(
            latent.query_tnd.to(dtype),
            key,
            key,
            query_rope=rope.query_tnd.to(dtype),
            key_rope=rope.key_cache.view(nb, bs, -1).to(dtype),
            num_heads=8,
            num_key_value_heads=1,
            input_layout="TND",
            scale=0.05,
            atten_mask=CAUSAL_TILE,
            sparse_mode=3,
            block_table=latent.block_table,
            block_size=bs,
            actual_seq_lengths=latent.cu_q,
            actual_seq_lengths_kv=kv_lens,
        )[0]

    return call, latent, rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_mla_decode_reads_latent_and_rope_caches(kernel_calls, dtype):
    call, latent, rope = _absorbed_mla_decode(dtype)
    got, want = _both_paths(call)
    assert kernel_calls == [True, False]
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        for b in range(4):
            naive, _ = naive_request(
                latent.qs[b],
                latent.ks[b],
                latent.ks[b],
                0.05,
                rule_for(3),
                q_rope=rope.qs[b],
                k_rope=rope.ks[b],
            )
            torch.testing.assert_close(got[b : b + 1].double(), naive, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(got, want, atol=0, rtol=2**-7)


def _fia_v1_4d(case, heads, kv_heads, scale):
    """The decode of `case` with its caches in the [nb, KVN, bs, D] form."""
    return npu.npu_fused_infer_attention_score(
        case.query_tnd,
        case.key_cache.permute(0, 2, 1, 3).contiguous(),
        case.value_cache.permute(0, 2, 1, 3).contiguous(),
        num_heads=heads,
        num_key_value_heads=kv_heads,
        input_layout="TND",
        scale=scale,
        atten_mask=CAUSAL_TILE,
        sparse_mode=3,
        block_table=case.block_table,
        block_size=case.key_cache.shape[1],
        actual_seq_lengths=case.cu_q,
        actual_seq_lengths_kv=case.kv_lens,
    )[0]


def test_the_portable_c_loops_compute_what_the_simd_ones_do(monkeypatch, tmp_path, kernel_calls):
    # The same source built with -DKVSKILL_PORTABLE takes the plain loops that machines without
    # AVX2 + FMA run; both must agree with each other (and, for fp32, with the naive math).
    # Blocks of 8 or more rows with head dims that are multiples of 8 take the SIMD build's
    # eight-row scores and register-held value sums (3-D and 4-D caches, bf16, MLA's latent
    # and rope); head dim 20 and blocks of 4 rows take its plain loops.
    from kvskill.runtime.ops.cpu_kernels import build

    kv_lens = [1, 17, 300, 5, 64, 33, 8]
    gqa = _decode_case(kv_lens)
    bf16 = make_paged_case(
        [1] * 3, [5, 70, 33], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.bfloat16, seed=3,
    )  # fmt: skip
    fp32_cases = [
        (gqa, 4, 2),
        (_decode_case(kv_lens, heads=8, kv_heads=1, head_dim=128, block_size=16), 8, 1),
        (_decode_case(kv_lens, heads=6, kv_heads=3, head_dim=20, block_size=8), 6, 3),
        (_decode_case(kv_lens, heads=8, kv_heads=1, head_dim=128, block_size=4), 8, 1),
    ]

    def v1(case, heads, kv_heads):
        return paged_fia_v1(case, num_heads=heads, num_kv_heads=kv_heads, scale=0.125, mode=3)[0]

    calls = [
        *(functools.partial(v1, *c) for c in fp32_cases),
        functools.partial(v1, bf16, 4, 2),
        functools.partial(_fia_v1_4d, gqa, 4, 2, 0.125),
        _absorbed_mla_decode(torch.float32)[0],
        _absorbed_mla_decode(torch.bfloat16)[0],
    ]

    simd = [call() for call in calls]
    compiler = os.environ.get("CC") or "cc"
    monkeypatch.setenv("CC", f"{compiler} -DKVSKILL_PORTABLE")
    monkeypatch.setenv("KVSKILL_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_reasons", {})
    assert "-DKVSKILL_PORTABLE" in cpu_kernels.status().reason
    portable = [call() for call in calls]
    assert kernel_calls == [True] * (2 * len(calls))
    for a, b in zip(simd, portable, strict=True):
        if a.dtype == torch.bfloat16:  # both round one fp32 result; sums may differ by an ulp
            torch.testing.assert_close(a, b, atol=0, rtol=2**-7)
        else:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for (case, _, _), out in zip(fp32_cases, portable, strict=False):
        naive, _ = naive_batch(case, 0.125, rule_for(3))
        torch.testing.assert_close(out.double(), naive, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("path", ["kernel", "pytorch"])
@pytest.mark.parametrize("bad_id", [-1, "past the end"])
def test_a_needed_block_outside_the_cache_is_the_same_operator_error(path, bad_id):
    case = _decode_case([20, 40])
    num_blocks = case.key_cache.shape[0]
    case.block_table[1, 2] = num_blocks + 5 if bad_id == "past the end" else bad_id
    off = cpu_kernels.disabled() if path == "pytorch" else contextlib.nullcontext()
    with off, pytest.raises(OpInputError) as err:
        paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.1, mode=3)
    assert str(err.value) == (
        f"npu_fused_infer_attention_score: block_table row 1 names a block outside the "
        f"cache's {num_blocks} blocks within its first kv length tokens"
    )


def test_a_request_whose_scores_are_all_minus_infinity_gets_zeros_on_both_paths(kernel_calls):
    case = _decode_case([6, 9], head_dim=8)
    case.qs[0].copy_(-case.qs[0].abs() - 1)  # every query element negative ...
    for t in range(6):  # ... against +inf keys: every score of request 0 is -inf
        blk = int(case.block_table[0, t // 16])
        case.key_cache[blk, t % 16] = float("inf")
    got, want = _both_paths(
        lambda: paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.1, mode=3)[0]
    )
    assert kernel_calls == [True, False]
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_table_entries_a_request_does_not_need_are_never_read_on_either_path(kernel_calls):
    # The device reads only the blocks of each request's first kv_len tokens; the rest of a
    # row may hold padding such as -1.
    case = _decode_case([3, 40])
    case.block_table[0, 1:] = -1
    got, want = _both_paths(
        lambda: paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.1, mode=3)[0]
    )
    assert kernel_calls == [True, False]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    naive, _ = naive_batch(case, 0.1, rule_for(3))
    torch.testing.assert_close(got.double(), naive, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "what",
    ["lse", "window", "float16", "prefill"],
)
def test_calls_outside_the_kernel_stay_on_pytorch(kernel_calls, what):
    q_lens = [3, 2] if what == "prefill" else [1, 1]
    case = make_paged_case(
        q_lens,
        [30, 9],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.float16 if what == "float16" else torch.float32,
    )
    kwargs = {"lse": what == "lse"}
    if what == "window":
        kwargs.update(mode=4, pre=5, nxt=0)
    else:
        kwargs["mode"] = 3
    got, want = _both_paths(
        lambda: paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.25, **kwargs)[0]
    )
    assert not any(kernel_calls)
    assert torch.equal(got, want)


@pytest.mark.parametrize("q_lens", [[3, 1], [1, 5, 1, 2, 1]])
def test_the_one_row_requests_of_a_prefill_call_go_to_the_kernel(kernel_calls, q_lens):
    """Decoding requests riding along with prompt chunks (one query row each, every key
    visible) are answered by the kernel in one call, the others by the packed path; the rows
    land where the operator puts them."""
    case = make_paged_case(
        q_lens,
        [30, 9, 12, 40, 7][: len(q_lens)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
    )
    got, want = _both_paths(
        lambda: paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.25, mode=3)[0]
    )
    assert kernel_calls == [True, False]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_two_threads_split_the_work_without_changing_it():
    case = _decode_case([2048, 700, 3000, 1500, 16, 2500, 900, 1800], head_dim=16)
    call = lambda: paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.25, mode=3)[0]  # noqa: E731
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = call()
        torch.set_num_threads(2)
        two = call()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_the_kernel_shares_torchs_openmp_runtime():
    """Built with OpenMP, the kernel's threads are torch's: one libgomp in the process."""
    status = cpu_kernels.status()
    if not status.available:
        pytest.skip(status.reason)
    paged_fia_v1(
        _decode_case([64, 80], head_dim=16), num_heads=4, num_kv_heads=2, scale=0.25, mode=3
    )
    with open("/proc/self/maps") as maps:
        gomps = {line.split()[-1] for line in maps if "libgomp" in line}
    torch_gomp = {g for g in gomps if "torch" in g}
    if not torch_gomp:
        pytest.skip("this torch does not ship GNU OpenMP")
    assert gomps == torch_gomp


def _status_in_subprocess(env: dict[str, str]) -> str:
    code = (
        "from kvskill.runtime.ops import cpu_kernels; s = cpu_kernels.status(); "
        "print(s.available, s.reason)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_status_inside_the_disabled_block_says_so():
    with cpu_kernels.disabled():
        state = cpu_kernels.status()
    assert not state.available and "disabled()" in state.reason
    assert cpu_kernels.status().available


def test_kernels_can_be_switched_off():
    assert _status_in_subprocess({"KVSKILL_CPU_KERNELS": "0"}).startswith(
        "False KVSKILL_CPU_KERNELS=0"
    )


def test_a_compiler_that_fails_leaves_the_reference_in_charge(tmp_path):
    line = _status_in_subprocess({"CC": "false", "KVSKILL_KERNEL_CACHE": str(tmp_path)})
    assert line.startswith("False paged_decode could not be compiled (false failed:")
    assert not list(tmp_path.rglob("*.so"))


def test_a_compiler_that_writes_nothing_or_undecodable_messages_falls_back(tmp_path):
    mute = tmp_path / "mute-cc"  # exits 0 without writing the library
    mute.write_text("#!/bin/sh\nexit 0\n")
    noisy = tmp_path / "noisy-cc"  # fails with a message that is not UTF-8
    noisy.write_text("#!/bin/sh\nprintf '\\377 broken\\n' >&2\nexit 1\n")
    for script in (mute, noisy):
        script.chmod(0o755)
        cache = tmp_path / f"cache-{script.name}"
        line = _status_in_subprocess({"CC": str(script), "KVSKILL_KERNEL_CACHE": str(cache)})
        assert line.startswith(f"False paged_decode could not be compiled ({script.name} failed:")
        assert not list(cache.rglob("*.so"))


def test_a_cached_library_that_does_not_load_is_rebuilt(tmp_path):
    line = _status_in_subprocess({"KVSKILL_KERNEL_CACHE": str(tmp_path)})
    assert line.startswith("True")
    [built] = tmp_path.rglob("paged_decode.so")
    built.write_bytes(b"")  # truncated
    line = _status_in_subprocess({"KVSKILL_KERNEL_CACHE": str(tmp_path)})
    assert line.startswith("True paged_decode compiled with")
    assert built.stat().st_size > 0


def test_a_compiler_command_with_a_launcher_is_split_like_a_shell_would(tmp_path):
    line = _status_in_subprocess({"CC": "env cc", "KVSKILL_KERNEL_CACHE": str(tmp_path)})
    assert line.startswith("True paged_decode compiled with env cc")


def test_the_library_is_built_once_into_the_cache(tmp_path):
    line = _status_in_subprocess({"KVSKILL_KERNEL_CACHE": str(tmp_path)})
    assert line.startswith("True paged_decode compiled with")
    built = list(tmp_path.rglob("paged_decode.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    _status_in_subprocess({"KVSKILL_KERNEL_CACHE": str(tmp_path)})
    assert built[0].stat().st_mtime_ns == stamp


def test_kernel_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    from kvskill.runtime.ops.cpu_kernels import build

    for name in ("KVSKILL_KERNEL_CACHE", "KVSKILL_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert build._cache_dir() == tmp_path / "home" / ".cache" / "kvskill" / "cpu_kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build._cache_dir() == tmp_path / "xdg" / "kvskill" / "cpu_kernels"
    monkeypatch.setenv("KVSKILL_CACHE_DIR", str(tmp_path / "kv"))
    assert build._cache_dir() == tmp_path / "kv" / "cpu_kernels"
    monkeypatch.setenv("KVSKILL_KERNEL_CACHE", str(tmp_path / "exact"))
    assert build._cache_dir() == tmp_path / "exact"


def _shared_prefix_case(own_lens, *, shared, layout, heads=4, kv_heads=2, dim=32, block_size=4):
    """q, caches and block table of requests whose first `shared` blocks are the same blocks,
    and a twin where each request holds its own copy of them (same values, nothing shared)."""
    g = torch.Generator().manual_seed(len(own_lens) * 31 + shared)
    batch = len(own_lens)
    own_blocks = [-(-n // block_size) for n in own_lens]
    width = shared + max(own_blocks)

    def cache(num_blocks):
        if layout == "BSH":
            return torch.empty(num_blocks, block_size, kv_heads * dim)
        return torch.empty(num_blocks, kv_heads, block_size, dim)

    prefix_k = torch.randn(shared, *cache(1).shape[1:], generator=g)
    prefix_v = torch.randn(shared, *cache(1).shape[1:], generator=g)
    own_k = [torch.randn(n, *cache(1).shape[1:], generator=g) for n in own_blocks]
    own_v = [torch.randn(n, *cache(1).shape[1:], generator=g) for n in own_blocks]

    def build(copies):
        k_parts, v_parts = [cache(1).zero_()], [cache(1).zero_()]  # block 0 is the null block
        table = torch.zeros(batch, width, dtype=torch.int32)
        next_id = 1
        if not copies:
            k_parts.append(prefix_k), v_parts.append(prefix_v)
            ids = list(range(1, shared + 1))
            next_id += shared
        for b in range(batch):
            if copies:
                k_parts.append(prefix_k), v_parts.append(prefix_v)
                ids = list(range(next_id, next_id + shared))
                next_id += shared
            k_parts.append(own_k[b]), v_parts.append(own_v[b])
            own_ids = list(range(next_id, next_id + own_blocks[b]))
            next_id += own_blocks[b]
            table[b, : shared + own_blocks[b]] = torch.tensor(ids + own_ids, dtype=torch.int32)
        return torch.cat(k_parts), torch.cat(v_parts), table

    q = torch.randn(batch, heads, 1, dim, generator=g)
    kv_lens = [shared * block_size + n for n in own_lens]
    return q, build(copies=False), build(copies=True), kv_lens


#: (heads, kv_heads, head dim, block size, shared blocks): the shared stages score four query
#: rows at a time against key rows in groups of eight (the rest one by one) and weight value
#: slices of 32; these cover both, their leftovers (query rows not a multiple of four, a block
#: of 12 rows), two threads (enough key rows to split), and a prefix packed in two parts
#: (over 512 rows) read by several groups of 16 query rows (8 query heads a kv head).
SHARED_SHAPES = [
    (4, 2, 32, 4, 5),
    (6, 2, 64, 12, 5),
    (16, 8, 128, 16, 5),
    (16, 2, 32, 16, 40),
]


@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
@pytest.mark.parametrize("own_lens", [[0, 5, 9, 1], [3, 3], [13, 0, 2, 7, 4, 11]])
@pytest.mark.parametrize("shape", SHARED_SHAPES, ids=lambda s: "h{}kv{}d{}bs{}x{}".format(*s))
def test_a_shared_prefix_gives_bit_for_bit_the_per_request_result(layout, own_lens, shape):
    """Blocks every request shares are read once for all of them (the shared-prefix stages);
    each (request, head) still sums in the per-request order, so the outputs are equal."""
    from kvskill.runtime.ops.cpu_kernels import paged_decode

    heads, kv_heads, dim, block_size, shared = shape
    q, (k, v, table), (k2, v2, table2), kv_lens = _shared_prefix_case(
        own_lens,
        shared=shared,
        layout=layout,
        heads=heads,
        kv_heads=kv_heads,
        dim=dim,
        block_size=block_size,
    )
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(paged_decode(q, k, v, table, kv_lens, kv_heads, 0.3))
            outs.append(paged_decode(q, k2, v2, table2, kv_lens, kv_heads, 0.3))
    finally:
        torch.set_num_threads(threads)
    assert outs[0] is not None
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_a_bad_block_after_a_shared_prefix_names_its_request():
    from kvskill.runtime.ops.cpu_kernels.paged_decode import BlockOutOfRangeError, paged_decode

    q, (k, v, table), _, kv_lens = _shared_prefix_case([6, 6, 6], shared=4, layout="BSH")
    table[2, 4] = k.size(0) + 3
    table[1, 5] = -1
    with pytest.raises(BlockOutOfRangeError) as err:
        paged_decode(q, k, v, table, kv_lens, 2, 0.3)
    assert err.value.request == 1

"""fp32 RMSNorm and SiLU x up on this CPU: the model's own PyTorch code against the one-pass
kernels ``LLM(fuse_layers=True)`` switches them to (``runtime/ops/cpu_kernels/fused_elementwise.c``).

Shapes are the Qwen3-0.6B ones (hidden 1024, 16 query heads of 128, MLP 3072) at a decode
batch of 16 tokens and a prefill step of 1024: the hidden-state norm, the per-head q norm
read from the q columns of a fused q/k/v output (strided rows), and the MLP's activation on
the two halves of a fused gate/up output (PyTorch: each half copied out, as
``prepacked_linear``'s siblings hand them over, then ``silu(gate) * up``). The two forms
alternate repeat by repeat in one process; times are the lower quartile. ``max_rel_diff`` is
the fused form's largest relative difference (it is not bit-exact).

    .venv/bin/python benchmarks/bench_fused_layers.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from _common import load_average, set_threads, write_kernel_report  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, INTERMEDIATE, KV_HEADS = 1024, 16, 128, 3072, 8
EPS = 1e-6


def _rms_norm_torch(x, weight):
    # transformers' Qwen3RMSNorm in fp32
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + EPS))


def _cases(tokens: int):
    """(name, PyTorch form, fused form) at one token count."""
    from kvskill.runtime.ops.cpu_kernels.fused_elementwise import rms_norm, silu_mul

    hidden = torch.randn(1, tokens, HIDDEN)
    weight = torch.randn(HIDDEN)
    qkv = torch.randn(1, tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q = qkv[..., : HEADS * HEAD_DIM].view(1, tokens, HEADS, HEAD_DIM)
    q_weight = torch.randn(HEAD_DIM)
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE) * 3
    gate, up = gate_up[:, :INTERMEDIATE], gate_up[:, INTERMEDIATE:]
    return (
        (
            f"rms_norm [{tokens}, {HIDDEN}]",
            lambda: _rms_norm_torch(hidden, weight),
            lambda: rms_norm(hidden, weight, EPS),
        ),
        (
            f"q_norm [{tokens}, {HEADS}, {HEAD_DIM}] strided",
            lambda: _rms_norm_torch(q.contiguous(), q_weight),
            lambda: rms_norm(q, q_weight, EPS),
        ),
        (
            f"silu(gate) * up [{tokens}, {INTERMEDIATE}]",
            lambda: torch.nn.functional.silu(gate.contiguous()) * up.contiguous(),
            lambda: silu_mul(gate, up),
        ),
    )


def _alternating_quartiles(first, second, repeats: int) -> tuple[float, float]:
    first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((first, times[0]), (second, times[1])):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return tuple(sorted(t)[len(t) // 4] for t in times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--out", type=Path, default=HERE / "results" / "bench_fused_layers.json")
    args = p.parse_args(argv)
    from kvskill.runtime.fused_layers import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(f"skipped: {reason}", file=sys.stderr)
        return 1
    set_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    load_before = load_average()
    with torch.inference_mode():
        for tokens in (16, 1024):
            for name, torch_form, fused_form in _cases(tokens):
                want, got = torch_form(), fused_form()
                rel = ((want - got).abs() / want.abs().clamp_min(1e-6)).max().item()
                t_torch, t_fused = _alternating_quartiles(torch_form, fused_form, args.repeats)
                rows.append(
                    {
                        "case": name,
                        "pytorch_us": round(t_torch * 1e6, 1),
                        "fused_us": round(t_fused * 1e6, 1),
                        "speedup": round(t_torch / t_fused, 2),
                        "max_rel_diff": rel,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    write_kernel_report(args.out, "bench_fused_layers", args.threads, load_before, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""fp32 linear layers on this CPU: PyTorch's default (MKL sgemm) against oneDNN with the weight
reordered ahead of time (what ``LLM(prepack_linear=True)`` and vLLM's CPU build use).

Shapes are the Qwen3-0.6B layers (hidden 1024, q 2048, k/v 1024, MLP 3072, vocab 151936) at
a decode batch of 1 and 16 tokens and a prefill chunk of 128 tokens. Variants alternate per
shape in one process; times are the lower quartile of the repeats. ``max_abs_diff`` is
oneDNN's largest difference from the default (it is not bit-exact).

    .venv/bin/python benchmarks/bench_linear.py --threads 1 [--out results/bench_linear.json]
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

#: (rows, in features, out features)
SHAPES = (
    (1, 1024, 3072),
    (16, 1024, 2048),
    (16, 1024, 1024),
    (16, 1024, 3072),
    (16, 3072, 1024),
    (16, 1024, 151936),
    (128, 1024, 3072),
)


def _quartile_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 4]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--out", type=Path, default=HERE / "results" / "bench_linear.json")
    args = p.parse_args(argv)
    set_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    load_before = load_average()
    with torch.inference_mode():
        for m, k, n in SHAPES:
            x, w = torch.randn(m, k), torch.randn(n, k) * 0.02
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)

            def default(x=x, w=w):
                return torch.nn.functional.linear(x, w)

            def onednn(x=x, packed=packed):
                return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

            diff = (default() - onednn()).abs().max().item()
            t_default = _quartile_s(default, args.repeats)
            t_onednn = _quartile_s(onednn, args.repeats)
            rows.append(
                {
                    "shape": [m, k, n],
                    "default_ms": round(t_default * 1e3, 3),
                    "onednn_prepacked_ms": round(t_onednn * 1e3, 3),
                    "speedup": round(t_default / t_onednn, 2),
                    "max_abs_diff": diff,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    write_kernel_report(args.out, "bench_linear", args.threads, load_before, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

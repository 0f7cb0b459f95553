"""Compile the C kernels once per machine and load them with ctypes.

The shared library lands in ``$KVSKILL_KERNEL_CACHE`` (default ``$KVSKILL_CACHE_DIR/cpu_kernels``,
else ``$XDG_CACHE_HOME/kvskill/cpu_kernels`` or ``~/.cache/kvskill/cpu_kernels``), in a folder named
by a hash of the source, the compiler flags and the CPU model: ``-march=native`` code must not
be loaded on another CPU. It is compiled to a temporary name and renamed into place, so
processes that start together never load a half-written file.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_SOURCE_DIR = Path(__file__).resolve().parent
# -fno-math-errno and -fno-trapping-math let the compiler vectorise rintf and the clamps of the
# kernel's exp (the kernel never reads errno or floating-point exception flags). No fast-math:
# linking it would flush denormals process-wide, changing torch's numerics.
_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
_NATIVE_FLAG = "-march=native"
# A kernel that splits its work over threads does it on torch's OpenMP pool when built with
# -fopenmp (see paged_decode.c); without OpenMP it starts threads of its own.
_OPENMP_FLAG = "-fopenmp"
#: Flag sets tried in order until one compiles.
_FLAG_SETS = (
    (*_FLAGS, _NATIVE_FLAG, _OPENMP_FLAG),
    (*_FLAGS, _NATIVE_FLAG),
    (*_FLAGS, _OPENMP_FLAG),
    _FLAGS,
)
_LIBS = ("-lpthread", "-lm")
_COMPILE_TIMEOUT_S = 120


@dataclass(frozen=True, slots=True)
class KernelStatus:
    """Whether the compiled kernels are in use, and why (one line)."""

    available: bool
    reason: str


_loaded: dict[str, ctypes.CDLL | None] = {}
_reasons: dict[str, str] = {}
_forced_off = 0


def status(name: str = "paged_decode") -> KernelStatus:
    """Load (compiling if needed) kernel ``name`` and report whether it is in use."""
    if _forced_off:
        return KernelStatus(False, "turned off by cpu_kernels.disabled() for this block")
    lib = load(name)
    return KernelStatus(lib is not None, _reasons[name])


def load(name: str) -> ctypes.CDLL | None:
    """The compiled library of ``<name>.c``, or None when kernels are off or cannot be built."""
    if _forced_off:
        return None
    if name not in _loaded:
        _loaded[name], _reasons[name] = _load(name)
    return _loaded[name]


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the block on the PyTorch reference only (tests compare the two paths with it)."""
    global _forced_off
    _forced_off += 1
    try:
        yield
    finally:
        _forced_off -= 1


def _load(name: str) -> tuple[ctypes.CDLL | None, str]:
    setting = os.environ.get("KVSKILL_CPU_KERNELS", "1").strip().lower()
    if setting in ("0", "off", "false", "no"):
        return None, "KVSKILL_CPU_KERNELS=0: the PyTorch reference runs everything"
    # $CC may carry a launcher or flags ("ccache gcc"), as make passes it to a shell.
    try:
        compiler = shlex.split(os.environ.get("CC", ""))
    except ValueError as exc:
        return None, f"$CC cannot be parsed ({exc}): the PyTorch reference runs everything"
    compiler = compiler or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not compiler[0]:
        return None, "no C compiler (cc, gcc or $CC) found: the PyTorch reference runs everything"
    source = _SOURCE_DIR / f"{name}.c"
    try:
        path = _built(compiler, source)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:
            # A cached library that does not load (truncated, or built by a broken compiler
            # run) is rebuilt once instead of being trusted forever.
            path.unlink(missing_ok=True)
            path = _built(compiler, source)
            lib = ctypes.CDLL(str(path))
        return lib, f"{name} compiled with {_name(compiler)}, at {path}"
    # RuntimeError: Path.home() without a home directory to find
    except (OSError, RuntimeError, subprocess.SubprocessError, _BuildError) as exc:
        return None, f"{name} could not be compiled ({exc}): the PyTorch reference runs it"


class _BuildError(Exception):
    pass


def _name(compiler: list[str]) -> str:
    return " ".join([Path(compiler[0]).name, *compiler[1:]])


def _built(compiler: list[str], source: Path) -> Path:
    # The headers the kernels include are part of what is compiled: a change to one must
    # build anew rather than load a library made from the old text.
    text = b"\0".join(
        [source.read_bytes(), *(h.read_bytes() for h in sorted(_SOURCE_DIR.glob("*.h")))]
    )
    for flags in _FLAG_SETS:
        digest = hashlib.sha256(
            b"\0".join(
                [text, " ".join(flags).encode(), _cpu_model().encode(), " ".join(compiler).encode()]
            )
        ).hexdigest()[:16]
        target = _cache_dir() / digest / f"{source.stem}.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [*compiler, *flags, "-o", tmp, str(source), *_LIBS]
        try:
            # errors="replace": a compiler speaking another encoding must not raise here
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=_COMPILE_TIMEOUT_S,
            )
            if done.returncode == 0 and os.path.getsize(tmp) > 0:
                os.replace(tmp, target)
                return target
            error = (done.stderr.strip().splitlines() or ["no output file"])[0]
        except subprocess.TimeoutExpired:
            error = f"no result within {_COMPILE_TIMEOUT_S} s"
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise _BuildError(f"{_name(compiler)} failed: {error}")


def _cache_dir() -> Path:
    explicit = os.environ.get("KVSKILL_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    kvskill_cache = os.environ.get("KVSKILL_CACHE_DIR")
    if kvskill_cache:
        return Path(kvskill_cache) / "cpu_kernels"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvskill" / "cpu_kernels"


def _cpu_model() -> str:
    """The CPU's model and instruction-set flags (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = ("model name", "flags", "Features", "CPU part")
    seen = {line.split(":")[0].strip(): line for line in lines if line.startswith(wanted)}
    return "\n".join(sorted(seen.values())) or f"{platform.machine()} {platform.processor()}"

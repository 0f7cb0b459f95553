"""Trust is per directory: code in a model directory runs only when the user allows it.

``verify`` and ``run`` (and ``LLM(dir)``) import the Python files of a directory. Without
``--trust-remote-code`` (``trust_remote_code=True``) they do so only when every importable
file in it is one kvskill itself wrote from the installed transformers' own code:

* ``apply`` of a model type (``qwen3``) or of a checkpoint directory without modeling code
  writes a converted ``modeling_*.py`` (and, standalone, a ``runner_*.py``) derived from
  transformers' file. It records the sha256 of each file it wrote in ``kvskill_plan.json``
  (``conversion.written_code``) with an HMAC of that list under a key private to this user
  (``$KVSKILL_STATE_DIR/trust.key``, default ``~/.local/state/kvskill``, mode 0600), so a
  directory made elsewhere, or a plan edited to list other files, does not verify;
* any other importable file (remote code copied from MODEL, an edited modeling file, a
  ``.pyc`` or extension module, a file in a subfolder) needs the flag, converted or not.

Directories are imported with bytecode writing off, so running them leaves no
``__pycache__`` behind (which would otherwise be an unlisted file next time).
"""

from __future__ import annotations

import hashlib
import hmac
import importlib.machinery
import json
import os
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvskill.core.errors import BadInputError

PLAN_FILE = "kvskill_plan.json"
KEY_FILE = "trust.key"
#: suffixes Python can import code from (.py, .pyc, extension modules)
CODE_SUFFIXES = tuple(sorted(set(importlib.machinery.all_suffixes()), key=len, reverse=True))


def state_dir() -> Path:
    """Where kvskill keeps its per-user state (the trust key)."""
    explicit = os.environ.get("KVSKILL_STATE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kvskill"


def _key(create: bool) -> bytes | None:
    path = state_dir() / KEY_FILE
    try:
        data = path.read_bytes()
        if len(data) >= 32:
            return data
    except OSError:
        pass
    if not create:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = secrets.token_bytes(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(key)
        return key
    except FileExistsError:  # another process made it meanwhile
        return _key(create=False)
    except OSError:
        return None


def _digest(key: bytes, files: dict[str, str]) -> str:
    payload = json.dumps(sorted(files.items())).encode("utf-8")
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


def sign_written_code(files: dict[str, str]) -> dict[str, Any] | None:
    """The ``written_code`` record for the Python files kvskill writes (name -> text), or
    None when no key can be kept (the output then needs ``--trust-remote-code``)."""
    key = _key(create=True)
    if key is None:
        return None
    hashes = {
        name: hashlib.sha256(text.encode("utf-8")).hexdigest() for name, text in files.items()
    }
    return {"files": hashes, "hmac": _digest(key, hashes)}


def code_files(directory: Path) -> list[Path]:
    """Every file under ``directory`` that Python could import code from (sorted)."""
    found = []
    for root, _dirs, names in os.walk(directory, followlinks=False):
        for name in names:
            if name.endswith(CODE_SUFFIXES):
                found.append(Path(root) / name)
    return sorted(found)


def untrusted_code(directory: Path) -> list[str]:
    """Importable files in ``directory`` that kvskill cannot prove it wrote (relative paths)."""
    directory = Path(directory)
    files = code_files(directory)
    if not files:
        return []
    listed = _listed_hashes(directory)
    foreign = []
    for path in files:
        name = path.relative_to(directory).as_posix()
        expected = listed.get(name)
        if expected is None or path.is_symlink() or _sha256_file(path) != expected:
            foreign.append(name)
    return foreign


def _listed_hashes(directory: Path) -> dict[str, str]:
    """name -> sha256 of the files the plan says kvskill wrote, if its HMAC holds."""
    from kvskill.core.inputs import read_json

    plan_path = directory / PLAN_FILE
    if not plan_path.is_file():
        return {}
    try:
        plan = read_json(plan_path, what="plan", root=directory)
    except BadInputError:
        return {}
    conversion = plan.get("conversion") if isinstance(plan, dict) else None
    record = conversion.get("written_code") if isinstance(conversion, dict) else None
    if not isinstance(record, dict):
        return {}
    files, mac = record.get("files"), record.get("hmac")
    if not isinstance(files, dict) or not isinstance(mac, str):
        return {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        return {}
    key = _key(create=False)
    if key is None or not hmac.compare_digest(_digest(key, files), mac):
        return {}
    return files


def _sha256_file(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def require_trust(directory: Path, trust_remote_code: bool, *, action: str = "run") -> None:
    """Refuse to import a directory's code unless kvskill wrote all of it or the user trusts it.

    Raises:
        BadInputError: the directory holds code kvskill did not write and the flag is off.
    """
    if trust_remote_code:
        return
    foreign = untrusted_code(directory)
    if foreign:
        shown = ", ".join(foreign[:3]) + (
            f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        )
        raise BadInputError(
            f"{directory} holds Python code kvskill did not write ({shown}); {action} would "
            "execute it: pass --trust-remote-code (trust_remote_code=True) if you trust it"
        )


@contextmanager
def no_bytecode_writes() -> Iterator[None]:
    """Import without writing ``__pycache__`` into the user's directory."""
    previous = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        yield
    finally:
        sys.dont_write_bytecode = previous

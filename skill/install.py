"""Install the agent skill (SKILL.md + references/*.md) into an agent's skills folder.

The installer keeps a manifest of what it wrote (sha256 per file) beside the copy, so it
can tell three cases apart on a later run:

* the copy equals what this kvskill ships: nothing to do;
* the copy equals what an earlier kvskill wrote (hash in the manifest): update it;
* the copy differs from both: somebody edited it. Refuse (exit 2, naming the file)
  unless ``--force``.

Every file is written to a temporary file in the same folder and renamed into place, and
all decisions are taken before the first write, so a refusal leaves the copy untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from importlib.resources.abc import Traversable
from pathlib import Path, PurePosixPath

from kvskill import __version__, resources
from kvskill.core.errors import BadInputError
from kvskill.core.inputs import is_inside, read_json

MANIFEST = ".kvskill-manifest.json"


class Agent(str, Enum):
    """Which agent's skills folder the default target is."""

    CLAUDE = "claude"
    AGENTS = "agents"

    @property
    def folder(self) -> str:
        return {Agent.CLAUDE: ".claude/skills", Agent.AGENTS: ".agents/skills"}[self]


class Action(str, Enum):
    CREATED = "created"
    UPDATED = "updated"
    OVERWRITTEN = "overwritten"  #: edited by hand, replaced because of --force
    UNCHANGED = "unchanged"
    REMOVED = "removed"  #: installed earlier, no longer shipped, untouched since
    KEPT = "kept"  #: no longer shipped but edited by hand: left alone


@dataclass(kw_only=True)
class InstallResult:
    """What one install did, file by file (paths relative to ``directory``)."""

    directory: Path
    actions: list[tuple[Action, str]] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return any(a not in (Action.UNCHANGED, Action.KEPT) for a, _ in self.actions)

    def describe(self) -> list[str]:
        """One line per file written or removed, then a summary line."""
        if not self.changed:
            return [
                f"{resources.SKILL_NAME} is up to date in {self.directory} "
                f"({len(self.actions)} file{'s' if len(self.actions) != 1 else ''}, nothing written)"
            ]
        lines = [
            f"{action.value:<11} {self.directory / name}"
            for action, name in self.actions
            if action is not Action.UNCHANGED
        ]
        counts: dict[str, int] = {}
        for action, _ in self.actions:
            counts[action.value] = counts.get(action.value, 0) + 1
        summary = ", ".join(f"{n} {a}" for a, n in counts.items())
        lines.append(f"installed {resources.SKILL_NAME} into {self.directory}: {summary}")
        return lines


def shipped_files() -> list[tuple[str, Traversable]]:
    """(relative path, source) of every file the skill consists of, SKILL.md first."""
    files = [("SKILL.md", resources.skill_md())]
    files += [(f"references/{page.name}", page) for page in resources.reference_pages()]
    return files


def default_target(agent: Agent, cwd: Path | None = None) -> Path:
    """``<git toplevel or cwd>/.claude/skills`` (or ``.agents/skills``)."""
    cwd = cwd or Path.cwd()
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"],
            cwd=cwd,
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        )
        root = Path(proc.stdout.strip()) if proc.returncode == 0 and proc.stdout.strip() else cwd
    except (OSError, subprocess.SubprocessError):
        root = cwd  # no git: the current folder is the project
    return root / agent.folder


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_manifest(directory: Path) -> dict[str, str]:
    """The manifest's name -> sha256, keeping only names that are plain relative paths of a
    file inside ``directory``: the manifest lives in a folder others can write, so a name
    such as ``../victim.txt`` or ``/etc/passwd`` is never acted on."""
    path = directory / MANIFEST
    if not path.is_file():
        return {}
    try:
        data = read_json(path, what="skill manifest", root=directory)
        files = data.get("files", {})
        items = files.items()
    except (BadInputError, AttributeError):
        return {}  # a broken manifest: every differing file counts as edited
    return {
        k: v
        for k, v in items
        if isinstance(k, str) and isinstance(v, str) and _safe_name(directory, k)
    }


def _safe_name(directory: Path, name: str) -> bool:
    """True for a normalised relative path (no ``..``, not absolute, no backslash) whose
    real location is inside ``directory``."""
    pure = PurePosixPath(name)
    if (
        not name
        or "\\" in name
        or "\0" in name
        or pure.is_absolute()
        or any(part in ("", ".", "..") for part in name.split("/"))
    ):
        return False
    return is_inside((directory / name).parent, directory)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _plan(
    directory: Path, files: Sequence[tuple[str, bytes]], manifest: dict[str, str], force: bool
) -> list[tuple[Action, str]]:
    """Decide every file's action before writing anything; refuse on a hand edit."""
    actions: list[tuple[Action, str]] = []
    for name, data in files:
        path = directory / name
        if not is_inside(path.parent, directory):
            raise BadInputError(
                f"{path.parent} leads outside {directory} (a symlink?); kvskill writes the skill "
                "only inside its own folder"
            )
        if not path.exists() and not path.is_symlink():
            actions.append((Action.CREATED, name))
            continue
        if path.is_dir():
            raise BadInputError(f"{path} is a folder; expected the skill file {name}")
        # a symlink is never kvskill's (it writes files): it counts as edited
        current = None if path.is_symlink() else _sha256(path.read_bytes())
        if current == _sha256(data):
            actions.append((Action.UNCHANGED, name))
        elif manifest.get(name) == current:
            actions.append((Action.UPDATED, name))
        elif force:
            actions.append((Action.OVERWRITTEN, name))
        else:
            raise BadInputError(
                f"{path} was edited since kvskill installed it; rerun with --force to "
                "overwrite it (or move your changes elsewhere first)"
            )
    shipped = {name for name, _ in files}
    for name, recorded in sorted(manifest.items()):
        path = directory / name
        if name in shipped or path.is_symlink() or not path.is_file():
            continue
        # NOTE: only a file kvskill can prove it wrote (its hash is the recorded one) is
        # removed, --force or not; anything else stays.
        pristine = _sha256(path.read_bytes()) == recorded
        actions.append((Action.REMOVED if pristine else Action.KEPT, name))
    return actions


def install_skill(
    *,
    target: Path | None = None,
    agent: Agent = Agent.CLAUDE,
    force: bool = False,
    files: Sequence[tuple[str, Traversable | Path]] | None = None,
) -> InstallResult:
    """Install the skill into ``<target>/model-infer-kvcache/``.

    Args:
        target: the skills folder; default ``default_target(agent)``.
        agent: picks the default folder when ``target`` is None.
        force: overwrite copies that were edited by hand (files no longer shipped are
            removed only when unedited, force or not).
        files: (relative path, source) pairs; default: what this kvskill ships.

    Raises:
        BadInputError: a file was edited by hand (without ``force``), or the target
            cannot be written.
    """
    base = target if target is not None else default_target(agent)
    directory = base.expanduser() / resources.SKILL_NAME
    if directory.exists() and not directory.is_dir():
        raise BadInputError(f"{directory} exists and is not a folder")
    contents = [(name, src.read_bytes()) for name, src in (files or shipped_files())]
    manifest = _read_manifest(directory)
    try:
        actions = _plan(directory, contents, manifest, force)
        by_name = dict(contents)
        for action, name in actions:
            if action in (Action.CREATED, Action.UPDATED, Action.OVERWRITTEN):
                _write_atomic(directory / name, by_name[name])
            elif action is Action.REMOVED:
                (directory / name).unlink()
        new_manifest = {
            "kvskill": __version__,
            "files": {name: _sha256(data) for name, data in contents}
            | {name: manifest[name] for action, name in actions if action is Action.KEPT},
        }
        path = directory / MANIFEST
        text = json.dumps(new_manifest, indent=2, sort_keys=True) + "\n"
        old = path.read_text(encoding="utf-8") if path.is_file() else None
        if _manifest_files(old) != new_manifest["files"] or old is None:
            _write_atomic(path, text.encode("utf-8"))
    except OSError as exc:
        where = exc.filename or directory
        raise BadInputError(f"cannot write the skill into {where}: {exc.strerror or exc}") from exc
    return InstallResult(directory=directory, actions=actions)


def _manifest_files(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        return json.loads(text).get("files")
    except (ValueError, AttributeError):
        return None

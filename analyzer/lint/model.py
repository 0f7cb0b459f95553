"""Result records of ``kvskill lint``: findings, unreadable files and the per-run report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One known mistake at one place in a file."""

    path: str
    line: int  #: 1-based
    column: int  #: 1-based
    rule: str  #: stable id, e.g. "KV001"
    name: str  #: stable slug, e.g. "no-causal-mask-in-prefill"
    message: str  #: what is wrong here, in one line
    fix: str  #: what to write instead, in one line

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class FileError:
    """A file that could not be linted (unreadable or not Python)."""

    path: str
    line: int
    message: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(kw_only=True)
class LintReport:
    """Everything one ``kvskill lint`` run found, in file order then line order."""

    findings: list[Finding] = field(default_factory=list)
    errors: list[FileError] = field(default_factory=list)
    files: int = 0  #: files read (including the ones that failed to parse)

    @property
    def exit_code(self) -> int:
        """1 when there are findings, else 2 when a file could not be read, else 0.

        NOTE: findings win over unreadable files, so a CI gate that checks for 1 still sees
        the real mistakes even when one file in the tree is not valid Python.
        """
        if self.findings:
            return 1
        if self.errors:
            return 2
        return 0

    def to_dict(self) -> dict:
        return {
            "findings": [f.to_dict() for f in self.findings],
            "errors": [e.to_dict() for e in self.errors],
            "files": self.files,
        }

"""Exceptions that carry the exit codes of the command-line contract.

Exit codes: 0 success, 1 a check failed (verify mismatch, lint findings), 2 bad input or
usage, 3 unsupported model (with the reason). Anything else is a bug in kvskill.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    CHECK_FAILED = 1
    BAD_INPUT = 2
    UNSUPPORTED = 3
    INTERNAL = 70  #: an unexpected exception: a bug in kvskill, reported as one line


class KvskillError(Exception):
    """Base of every error kvskill reports to a user. Subclasses fix the exit code."""

    exit_code: ExitCode = ExitCode.INTERNAL
    #: short machine-readable name used in ``{"error": {"code": ...}}``
    code: str = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class CheckFailedError(KvskillError):
    """A check ran and failed: verify found a mismatch, lint found problems."""

    exit_code = ExitCode.CHECK_FAILED
    code = "check_failed"


class BadInputError(KvskillError):
    """The user gave a path, file, option or value kvskill cannot use."""

    exit_code = ExitCode.BAD_INPUT
    code = "bad_input"


class UnsupportedModelError(KvskillError):
    """The model cannot be served (or converted) by kvskill; the message says why."""

    exit_code = ExitCode.UNSUPPORTED
    code = "unsupported_model"

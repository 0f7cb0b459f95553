"""What the process knows about interrupts: the exit codes, and whether Ctrl-C arrived.

Shared by the entry point, which installs the handlers before anything heavy is imported,
and the CLI, which reports an error a library made of an interrupt as the interrupt it was.
Its own module so that neither of the two imports the other for it.
"""

from __future__ import annotations

INTERRUPTED = 130
TERMINATED = 143


class Terminated(BaseException):
    """SIGTERM arrived; unwinds like KeyboardInterrupt so cleanup code runs."""


#: whether a SIGINT arrived in this process (``sigint_seen``)
_sigint = False


def on_sigterm(signum, frame) -> None:
    raise Terminated()


def on_sigint(signum, frame) -> None:
    global _sigint
    _sigint = True
    raise KeyboardInterrupt


def sigint_seen() -> bool:
    """Whether Ctrl-C reached this process. A library may turn the KeyboardInterrupt into an
    error of its own (numpy's extension loader, interrupted mid-import, raises ImportError
    "cannot load module more than once per process"); such an error is still an interrupt."""
    return _sigint

"""The ``kvskill`` executable: interrupts handled from the first instruction on.

Importing the CLI pulls in click, libcst and more, which takes a moment; a Ctrl-C then (or at
any later point) must still end as one line and exit 130, so this module imports nothing
heavy before it can catch the interrupt. SIGTERM is turned into the same clean exit (143),
so ``finally`` blocks (stage-directory cleanup) run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from kvskill.interrupts import (
    INTERRUPTED,
    TERMINATED,
    Terminated,
    on_sigint,
    on_sigterm,
    sigint_seen,
)


def interrupted(code: int = INTERRUPTED) -> None:
    """Report an interrupt on one line and exit, ignoring a second Ctrl-C meanwhile."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sys.stderr.write(
            "kvskill: interrupted\n" if code == INTERRUPTED else "kvskill: terminated\n"
        )
    finally:
        exit_now(code)


def exit_now(code: int) -> None:
    """Leave with ``code`` at once. Every ``finally`` between the interrupt and here has run
    (stage directories are gone); what is skipped is interpreter shutdown, where an interrupt
    that landed mid-import was seen to resurface and kill the process with SIGINT (-2) after
    the one line was printed."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing more to say
            stream.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    try:
        signal.signal(signal.SIGINT, on_sigint)
        signal.signal(signal.SIGTERM, on_sigterm)
        from kvskill.cli import main as cli_main

        cli_main(argv)
    except SystemExit as exc:
        if exc.code in (INTERRUPTED, TERMINATED):  # the CLI reported the interrupt itself
            exit_now(exc.code)
        raise
    except KeyboardInterrupt:
        interrupted(INTERRUPTED)
    except Terminated:
        interrupted(TERMINATED)
    except Exception:
        if sigint_seen():  # the interrupt came back as another error (see sigint_seen)
            interrupted(INTERRUPTED)
        raise


if __name__ == "__main__":
    main()

"""The ``kvskill`` command line: a click group whose commands live in ``kvskill.commands``.

Every error a user can cause ends here as one line on stderr (or one JSON object on stdout
with ``--format json``) and an exit code from ``kvskill.core.errors.ExitCode``; never a traceback
unless ``--verbose`` asks for one.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import traceback

import click
from kvskill import __version__
from kvskill.commands import COMMANDS
from kvskill.core.errors import ExitCode, KvskillError
from kvskill.interrupts import sigint_seen
from kvskill.library_noise import quiet_kernel_fallbacks

#: Ctrl-C (128 + SIGINT), as shells report it
EXIT_INTERRUPTED = 130

EPILOG = """\b
Examples:
  kvskill analyze qwen3
  kvskill apply qwen3 --mode framework --out converted/
  kvskill verify converted/
  kvskill run converted/ --random-weights --num-requests 8

\b
Exit codes: 0 success, 1 check failed, 2 bad input or usage,
3 unsupported model, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM),
other: a bug in kvskill.
"""


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is now, so a handler set up by one in-process run
    (tests capture stderr per run) never writes to a stream that was closed since."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


@click.group(epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="kvskill")
@click.option("-v", "--verbose", count=True, help="More logging on stderr (-vv for debug).")
@click.pass_context
def cli(ctx: click.Context, verbose: int) -> None:
    """Migrate an LLM's KV cache to paged attention for Ascend NPUs.

    analyze decides the KV design with evidence, apply rewrites the model, verify proves the
    conversion token-exact, run generates with the converted model in the bundled runtime.
    """
    ctx.ensure_object(dict)
    ctx.obj["verbose"] = verbose
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])


for _command in COMMANDS:
    cli.add_command(_command)


def _wants_json(argv: list[str]) -> bool:
    for i, arg in enumerate(argv):
        if arg == "--format=json" or (arg == "--format" and argv[i + 1 : i + 2] == ["json"]):
            return True
    return False


def _report(code: str, message: str, exit_code: int, as_json: bool) -> None:
    message = " ".join(message.split()) or code  # one line, always
    if as_json:
        click.echo(json.dumps({"error": {"code": code, "message": message}}))
    else:
        click.echo(f"kvskill: error: {message}", err=True)
    sys.exit(exit_code)


def _interrupted(as_json: bool) -> None:
    """Ctrl-C: one line, exit 130; a second Ctrl-C while reporting is ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if as_json:
        _report("interrupted", "interrupted", EXIT_INTERRUPTED, as_json)
    click.echo("kvskill: interrupted", err=True)
    sys.exit(EXIT_INTERRUPTED)


def is_operator_rejection(exc: BaseException) -> bool:
    """An ``OpInputError``: a call the real operator would refuse (a failed check of the
    conversion, e.g. under the strict NPU profile), not a bug of kvskill. Looked up only when
    the operators were imported, so the CLI's start stays free of torch."""
    checks = sys.modules.get("kvskill.runtime.ops.reference._checks")
    return checks is not None and isinstance(exc, checks.OpInputError)


def is_operator_refusal(exc: BaseException) -> bool:
    """A ``RefusedOperatorError``: a torch_npu operator or feature the CPU reference refuses by
    name (quantized, collective, graph mode), so the model path is unsupported here, not a bug."""
    refused = sys.modules.get("kvskill.runtime.ops.reference.refused")
    return refused is not None and isinstance(exc, refused.RefusedOperatorError)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI and translate every failure into the documented exit codes."""
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = _wants_json(argv)
    verbose = any(a in ("-v", "--verbose") or a.startswith("-vv") for a in argv)
    if not verbose:
        quiet_kernel_fallbacks()
    try:
        # NOTE: commands return None (success) or an int exit code (e.g. 1 for lint
        # findings); --help and --version come back here as 0.
        result = cli.main(args=argv, prog_name="kvskill", standalone_mode=False)
    except KvskillError as exc:
        if verbose:
            traceback.print_exc()
        _report(exc.code, str(exc), int(exc.exit_code), as_json)
    except click.exceptions.Abort as exc:
        # click turns a Ctrl-C inside a command into Abort: still an interrupt (exit 130)
        if isinstance(exc.__context__, KeyboardInterrupt):
            _interrupted(as_json)
        _report("aborted", "aborted", int(ExitCode.BAD_INPUT), as_json)
    except click.ClickException as exc:
        message = exc.format_message()
        ctx = getattr(exc, "ctx", None)
        if ctx is not None:
            message += f" (see '{ctx.command_path} --help')"
        _report("usage", message, int(ExitCode.BAD_INPUT), as_json)
    except KeyboardInterrupt:
        _interrupted(as_json)
    except Exception as exc:  # a bug: say so in one line, keep the traceback behind -v
        if sigint_seen():  # Ctrl-C that a library turned into another error
            _interrupted(as_json)
        if verbose:
            traceback.print_exc()
        if is_operator_refusal(exc):
            _report("operator_refused", str(exc), int(ExitCode.UNSUPPORTED), as_json)
        if is_operator_rejection(exc):
            _report(
                "operator_rejected",
                f"an operator rejected a call of the converted model: {exc}",
                int(ExitCode.CHECK_FAILED),
                as_json,
            )
        _report(
            "internal",
            f"internal error ({type(exc).__name__}: {exc}); rerun with -v for the traceback "
            "and report it",
            int(ExitCode.INTERNAL),
            as_json,
        )
    sys.exit(result if isinstance(result, int) else int(ExitCode.OK))

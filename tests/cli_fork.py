"""Run ``python -m kvskill ARGS`` as a child process without paying its imports each time.

Most of a CLI call in a test is Python importing torch, transformers and kvskill (seconds
each call on two cores), not the work under test. A fork server imports them once; every call
is then a ``fork()`` of that process which sets its own working directory, environment,
stdin/stdout/stderr and argv, runs ``kvskill.entry.main`` exactly as the console script does
and exits with its code. The test still sees a separate process: its exit code (or the signal
that killed it), its own stdout and stderr, files written relative to its own cwd and HOME.

What a forked call does not exercise: importing kvskill from scratch (a crash at import time)
and signals that arrive during those imports. The tests of Ctrl-C and SIGTERM therefore start
real ``python -m kvskill`` processes.

    client (pytest)  --JSON request line-->  server (imports done)  --fork-->  child
                     <--JSON reply line----                          <--waitpid--

Run as a script, this file is the server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class CliResult:
    code: int
    out: str
    err: str


class ForkedCli:
    """A client of one fork server process; ``run`` is ``subprocess.run`` for the kvskill CLI."""

    def __init__(self, env: dict[str, str]) -> None:
        self._scratch = tempfile.TemporaryDirectory(prefix="kvskill-forkserver-")
        server_env = dict(env)
        # whatever is read from HOME while importing must not land in a test's HOME
        server_env["HOME"] = self._scratch.name
        self._server = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=self._scratch.name,
            env=server_env,
            text=True,
        )
        ready = self._server.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the kvskill fork server did not start: {ready!r}")
        self._calls = 0

    def run(self, args: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> CliResult:
        self._calls += 1
        out = Path(self._scratch.name) / f"{self._calls}.out"
        err = Path(self._scratch.name) / f"{self._calls}.err"
        request = {
            "argv": [str(a) for a in args],
            "cwd": str(cwd),
            "env": env,
            "out": str(out),
            "err": str(err),
            "timeout": timeout,
        }
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        line = self._server.stdout.readline()
        if not line:
            raise RuntimeError("the kvskill fork server died")
        reply = json.loads(line)
        if reply.get("timeout"):
            raise subprocess.TimeoutExpired(["kvskill", *request["argv"]], timeout)
        result = CliResult(
            reply["code"], out.read_text(errors="replace"), err.read_text(errors="replace")
        )
        out.unlink()
        err.unlink()
        return result

    def close(self) -> None:
        if self._server.poll() is None:
            self._server.stdin.close()
            try:
                self._server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
        self._scratch.cleanup()


# ---- the server ----------------------------------------------------------------------------


def _preload() -> None:
    """Import what every verb needs, so that each forked call starts warm."""
    import importlib
    import pkgutil

    import kvskill.commands
    import kvskill.entry  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    for module in pkgutil.iter_modules(kvskill.commands.__path__):
        importlib.import_module(f"kvskill.commands.{module.name}")
    # the model most CLI tests use
    importlib.import_module("transformers.models.qwen3.modeling_qwen3")


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)  # what the interpreter does with a non-int code
    return 1


def _child(request: dict) -> None:
    """Become ``python -m kvskill ARGV`` in the request's cwd and environment; never returns."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        stdin = os.open(os.devnull, os.O_RDONLY)
        stdout = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        stderr = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
            os.close(fd)
        import kvskill.entry

        sys.argv = [str(Path(kvskill.entry.__file__).with_name("__main__.py")), *request["argv"]]
        try:
            kvskill.entry.main(request["argv"])
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:  # an uncaught error: print it as the interpreter would
            import traceback

            traceback.print_exc()
            code = 1
        import atexit

        atexit._run_exitfuncs()  # os._exit skips them; a real process runs them
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _wait(pid: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.WIFSIGNALED(status):
                return {"code": -os.WTERMSIG(status)}
            return {"code": os.WEXITSTATUS(status)}
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"timeout": True}
        time.sleep(0.005)


def serve() -> None:
    _preload()
    replies = sys.stdout
    replies.write("ready\n")
    replies.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        replies.write(json.dumps(_wait(pid, request["timeout"])) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve()

"""The CLI contract: help, version, exit codes and the JSON error shape."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from kvskill import __version__
from kvskill.cli import main


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_help_lists_every_command_and_the_exit_codes(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    for command in ("analyze", "apply", "verify", "run", "lint", "skill"):
        assert command in out
    assert "Exit codes" in out


def test_version(capsys):
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0
    assert __version__ in out


@pytest.mark.parametrize("command", ["analyze", "apply", "verify", "run", "lint"])
def test_each_command_has_help_with_examples(capsys, command):
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0
    assert "Examples" in out


def test_unknown_option_is_a_usage_error(capsys):
    code, _, err = run_cli(capsys, "analyze", "--no-such-option")
    assert code == 2
    assert "no-such-option" in err


def test_missing_directory_is_bad_input(capsys, tmp_path):
    code, _, err = run_cli(capsys, "verify", str(tmp_path / "absent"))
    assert code == 2
    assert "does not exist" in err
    assert "Traceback" not in err


def test_json_errors_are_one_object_on_stdout(capsys, tmp_path):
    code, out, err = run_cli(capsys, "verify", str(tmp_path / "absent"), "--format", "json")
    assert code == 2
    payload = json.loads(out)
    assert set(payload) == {"error"}
    assert set(payload["error"]) == {"code", "message"}
    assert "\n" not in payload["error"]["message"]
    assert err == ""


def test_internal_errors_are_one_line_with_their_own_code(capsys, monkeypatch):
    from kvskill import cli as cli_module

    def boom(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(cli_module.cli, "main", boom)
    code, _, err = run_cli(capsys, "analyze", "qwen3")
    assert code not in (0, 1, 2, 3)
    assert err.count("\n") == 1
    assert "ZeroDivisionError" in err


def test_python_dash_m_kvskill_works():
    proc = subprocess.run(
        [sys.executable, "-m", "kvskill", "--help"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "analyze" in proc.stdout


@pytest.mark.parametrize(
    ("model", "choice", "code", "message"),
    [
        # MLA is converted absorbed only, in framework mode as in standalone mode.
        ("deepseek_v3", "off", 3, "un-absorbed MLA is not generated"),
        ("qwen3", "on", 2, "not MLA"),
    ],
)
def test_apply_refuses_an_mla_absorb_choice_it_cannot_honour(
    capsys, tmp_path, model, choice, code, message
):
    out_dir = tmp_path / "out"
    got, _, err = run_cli(capsys, "apply", model, "--mla-absorb", choice, "--out", str(out_dir))
    assert got == code
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out_dir.exists()


def test_an_interrupt_a_library_turns_into_another_error_is_still_exit_130(monkeypatch, capsys):
    """numpy's extension loader, interrupted mid-import, raises ImportError instead of
    KeyboardInterrupt; the CLI still ends as one line and exit 130."""
    import signal

    import kvskill.cli as cli_module
    from kvskill import entry, interrupts

    def import_interrupted(argv):
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            raise ImportError("cannot load module more than once per process") from None

    def exit_in_pytest(code):  # the real one leaves the process with os._exit
        raise SystemExit(code)

    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(cli_module, "main", import_interrupted)
    monkeypatch.setattr(entry, "exit_now", exit_in_pytest)
    try:
        with pytest.raises(SystemExit) as exc:
            entry.main([])
    finally:
        signal.signal(signal.SIGINT, saved[0])
        signal.signal(signal.SIGTERM, saved[1])
        monkeypatch.setattr(interrupts, "_sigint", False)
    assert exc.value.code == 130
    assert capsys.readouterr().err == "kvskill: interrupted\n"

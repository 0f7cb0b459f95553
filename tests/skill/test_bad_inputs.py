"""Every bad input is a clean error: the CLI in a child process, attacked as issue #30 did.

Each case asserts the exit code, one ``kvskill: error:`` line on stderr and no traceback, that
the inputs are unchanged, and that nothing outside the scratch folders (MODEL, --out, the
skill folder) was written or deleted: every child runs with an empty working directory and
HOME of its own, and a folder of victim files sits beside the inputs.

The children are forked from a process that has imported kvskill already (``cli_fork``);
the signal tests at the end start real ``python -m kvskill`` processes instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "implementer"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cli_fork import CliResult as Result  # noqa: E402
from cli_fork import ForkedCli  # noqa: E402
from remote_model import write_remote_model  # noqa: E402

#: the shrunk Qwen3 of scripts/demo.sh
SMALL = (
    "num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
    "num_key_value_heads=2,head_dim=16,vocab_size=128,max_position_embeddings=256"
)
#: exit codes that mean a crash: internal error, abort, OOM kill, segfault
CRASH_CODES = {70, 134, 137, 139, -6, -9, -11}


class Sandbox:
    """Scratch folders for one test: inputs, an empty cwd and HOME, and victim files."""

    def __init__(self, root: Path, cli: ForkedCli) -> None:
        self.root = root
        self.cli = cli
        self.cwd = root / "cwd"
        self.home = root / "home"
        self.victims = root / "victims"
        for path in (self.cwd, self.home, self.victims):
            path.mkdir(parents=True, exist_ok=True)
        (self.victims / "victim.txt").write_text("precious\n")
        self.watched: dict[Path, dict[str, str]] = {}

    def env(self) -> dict[str, str]:
        env = base_env()
        env["HOME"] = str(self.home)
        return env

    def kvskill(self, *args: str, timeout: float = 300) -> Result:
        return self.cli.run(list(args), cwd=self.cwd, env=self.env(), timeout=timeout)

    def watch(self, *paths: Path) -> None:
        """Record a tree's content; ``check_untouched`` asserts it is the same afterwards."""
        for path in paths:
            self.watched[path] = tree_digest(path)

    def check_untouched(self) -> None:
        assert list(self.cwd.iterdir()) == [], "wrote into the working directory"
        assert list(self.home.iterdir()) == [], "wrote into HOME"
        assert (self.victims / "victim.txt").read_text() == "precious\n"
        assert sorted(p.name for p in self.victims.iterdir()) == ["victim.txt"]
        for path, digest in self.watched.items():
            assert tree_digest(path) == digest, f"{path} changed"


def base_env() -> dict[str, str]:
    """The environment of every CLI call of this module (HOME is each sandbox's own)."""
    env = dict(os.environ)
    env.update(
        KVSKILL_OPS="reference",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        # the compiled CPU kernel is a cache of kvskill's own; keep it out of HOME
        KVSKILL_KERNEL_CACHE=os.environ.get(
            "KVSKILL_KERNEL_CACHE", str(Path.home() / ".cache" / "kvskill" / "cpu_kernels")
        ),
    )
    return env


def tree_digest(path: Path) -> dict[str, str]:
    if not path.exists() and not path.is_symlink():
        return {}
    if path.is_file() or path.is_symlink():
        return {"": _file_digest(path)}
    return {
        str(p.relative_to(path)): _file_digest(p)
        for p in sorted(path.rglob("*"))
        if p.is_file() or p.is_symlink()
    }


def _file_digest(path: Path) -> str:
    if path.is_symlink():
        return "link:" + os.readlink(path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_clean_error(result: Result, code: int = 2, *, contains: str | None = None) -> None:
    """Exit ``code``, exactly one 'kvskill: error:' line on stderr, no traceback."""
    assert result.code not in CRASH_CODES, result.err[-2000:]
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert result.code == code, (result.code, result.err[-2000:])
    assert "Traceback" not in result.err
    assert len(lines) == 1 and lines[0].startswith("kvskill: error:"), result.err[-2000:]
    if contains is not None:
        assert contains in lines[0], lines[0]


@pytest.fixture(scope="module")
def cli() -> ForkedCli:
    server = ForkedCli(base_env())
    yield server
    server.close()


@pytest.fixture
def box(tmp_path, cli) -> Sandbox:
    sandbox = Sandbox(tmp_path, cli)
    yield sandbox
    sandbox.check_untouched()


@pytest.fixture(scope="module")
def converted(tmp_path_factory, cli) -> Path:
    """``kvskill apply qwen3`` of a small config: a directory kvskill wrote itself."""
    root = tmp_path_factory.mktemp("converted")
    box = Sandbox(root, cli)
    out = root / "qwen3"
    result = box.kvskill("apply", "qwen3", "--config-overrides", SMALL, "--out", out)
    assert result.code == 0, result.err
    return out


def remote_dir(path: Path) -> Path:
    """The tests' transformers-4-style remote-code model (config + modeling + configuration)."""
    write_remote_model(path)
    return path


def with_marker(directory: Path, marker: Path) -> None:
    """Make every Python file of ``directory`` write ``marker`` when it is imported."""
    for file in directory.glob("*.py"):
        text = file.read_text()
        file.write_text(f"open({str(marker)!r}, 'a').write({file.name!r} + '\\n')\n" + text)


def model_dir(path: Path, config: dict | None = None, modeling: str | None = None) -> Path:
    """A model directory of transformers' qwen3 (config only), or with its own modeling file."""
    path.mkdir(parents=True, exist_ok=True)
    base = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    (path / "config.json").write_text(json.dumps({**base, **(config or {})}))
    if modeling is not None:
        (path / "modeling_bad.py").write_text(modeling)
    return path


# ---- parsers that cannot crash the process ----------------------------------------------

NESTED_PARENS = "x = " + "(" * 3000 + "1" + ")" * 3000 + "\n"
NESTED_NOT = "x = " + "not " * 20000 + "1\n"
LONG_CHAIN = "x = " + "+".join(["1"] * 6000) + "\n"


@pytest.mark.parametrize(
    "source", [NESTED_PARENS, NESTED_NOT, LONG_CHAIN], ids=["parens", "not", "chain"]
)
@pytest.mark.parametrize("verb", ["analyze", "apply", "lint"])
def test_deeply_nested_code_is_refused_not_a_segfault(box, source, verb):
    model = model_dir(box.root / "model", modeling=source)
    box.watch(model)
    if verb == "lint":
        result = box.kvskill("lint", model / "modeling_bad.py")
    elif verb == "apply":
        result = box.kvskill("apply", model, "--out", box.root / "out")
        assert not (box.root / "out").exists()
    else:
        result = box.kvskill("analyze", model)
    if verb == "lint":  # lint reports unreadable files as errors of the run: exit 2
        assert result.code == 2 and "Traceback" not in result.err, result.err
        assert "nested" in result.out or "operators" in result.out, result.out
    else:
        assert_clean_error(result, 2)


def deep_json(depth: int) -> str:
    return '{"model_type": "qwen3", "x": ' + "[" * depth + "]" * depth + "}"


CONFIG_BYTES = {
    "not-utf8": b'{"model_type": "qwen3", "name": "\xff\xfe"}',
    "deep-json": deep_json(100_000).encode(),
    "not-json": b"{model_type: qwen3",
    "json-list": b"[1, 2, 3]",
    "huge-int": b'{"model_type": "qwen3", "num_hidden_layers": 1' + b"0" * 5000 + b"}",
}


@pytest.mark.parametrize("case", sorted(CONFIG_BYTES))
def test_malformed_config_json_is_bad_input(box, case):
    model = box.root / "model"
    model.mkdir()
    (model / "config.json").write_bytes(CONFIG_BYTES[case])
    box.watch(model)
    assert_clean_error(box.kvskill("analyze", model), 2)


def test_non_utf8_modeling_file_is_bad_input(box):
    model = model_dir(box.root / "model", modeling="x = 1\n")
    (model / "modeling_bad.py").write_bytes(b"# \xff\xfe\nx = 1\n")
    box.watch(model)
    assert_clean_error(box.kvskill("analyze", model), 2, contains="UTF-8")
    result = box.kvskill("lint", model / "modeling_bad.py")
    assert result.code == 2 and "UTF-8" in result.out and "Traceback" not in result.err


CONFIG_VALUES = {
    "zero-hidden": {"hidden_size": 0},
    "negative-heads": {"num_attention_heads": -4},
    "zero-kv-heads": {"num_key_value_heads": 0},
    "billion-layers": {"num_hidden_layers": 10**9},
    "string-layers": {"num_hidden_layers": "four"},
    "float-width": {"hidden_size": 64.5},
    "kv-not-dividing": {"num_attention_heads": 4, "num_key_value_heads": 3},
}


@pytest.mark.parametrize("case", sorted(CONFIG_VALUES))
def test_config_values_outside_the_models_invariants_are_bad_input(box, case):
    model = model_dir(box.root / "model", CONFIG_VALUES[case])
    box.watch(model)
    started = time.perf_counter()
    assert_clean_error(box.kvskill("analyze", model), 2)
    assert time.perf_counter() - started < 120  # refused before anything is sized


@pytest.mark.parametrize(
    "args",
    [
        ["--attn-tp-size", "3"],
        ["--attn-tp-size", "1000"],
        ["--kv-memory", "0"],
        ["--kv-memory", "lots"],
        ["--kv-memory", "-5G"],
        ["--hbm-gb", "nan"],
        ["--hbm-gb", "inf"],
        ["--hbm-gb", "-1"],
        ["--block-size", str(10**9)],
        ["--config-overrides", "num_hidden_layers=1000000000"],
        ["--config-overrides", "hidden_size=0"],
    ],
    ids=lambda a: " ".join(a),
)
def test_bad_analyze_options_are_bad_input(box, args):
    base = SMALL.replace("num_hidden_layers=2,", "")
    if args[0] == "--config-overrides":
        args = ["--config-overrides", f"{base},{args[1]}"]
    else:
        args = [*args, "--config-overrides", SMALL]
    assert_clean_error(box.kvskill("analyze", "qwen3", *args), 2)


def test_sizes_mean_the_same_in_every_verb(box):
    # 512M is binary (MiB) in analyze as in run; 500MB is decimal
    result = box.kvskill("analyze", "qwen3", "--config-overrides", SMALL, "--kv-memory", "512M",
                         "--format", "json")  # fmt: skip
    assert result.code == 0, result.err
    from kvskill.core.sizes import parse_size

    assert parse_size("512M") == 512 * 2**20 == parse_size("512MiB")
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("1TiB") == 2**40


def test_symlink_loop_and_long_path_are_bad_input(box):
    loop = box.root / "loop"
    loop.mkdir()
    (loop / "config.json").symlink_to(loop / "config.json")
    assert_clean_error(box.kvskill("analyze", loop), 2)
    (box.root / "self").symlink_to(box.root / "self")
    assert_clean_error(box.kvskill("analyze", box.root / "self"), 2)
    assert_clean_error(box.kvskill("analyze", "x" * 5000), 2)
    assert_clean_error(box.kvskill("analyze", str(box.root / ("d" * 300) / "m")), 2)


# ---- nothing outside MODEL is read; nothing outside --out is written ------------------


def test_config_symlinked_outside_the_model_is_not_read(box):
    secret = box.victims / "victim.txt"
    model = box.root / "model"
    model.mkdir()
    (model / "config.json").symlink_to(secret)
    assert_clean_error(box.kvskill("analyze", model), 2, contains="outside")


@pytest.mark.parametrize("how", ["auto_map-path", "symlinked-modeling", "symlinked-extra"])
def test_apply_never_copies_a_file_from_outside_model(box, how):
    outside = box.root / "elsewhere"
    model = remote_dir(box.root / "model")
    shutil.copytree(model, outside)
    config = json.loads((model / "config.json").read_text())
    if how == "auto_map-path":
        config["auto_map"]["AutoModelForCausalLM"] = (
            "../elsewhere/modeling_tiny_remote.TinyRemoteForCausalLM"
        )
        (model / "config.json").write_text(json.dumps(config))
    elif how == "symlinked-modeling":
        modeling = next(model.glob("modeling_*.py"))
        modeling.unlink()
        modeling.symlink_to(outside / modeling.name)
    else:
        (model / "configuration_extra.py").symlink_to(box.victims / "victim.txt")
    box.watch(model, outside)
    result = box.kvskill("apply", model, "--out", box.root / "out")
    assert_clean_error(result, 2)
    assert not (box.root / "out").exists()


def test_out_may_not_be_model_inside_it_or_contain_it(box):
    parent = box.root / "user-folder"
    model = model_dir(parent / "model")
    (parent / "notes.txt").write_text("mine\n")
    box.watch(parent)
    for out in (model, model / "sub", parent):
        result = box.kvskill("apply", model, "--out", out, "--force",
                             "--config-overrides", SMALL)  # fmt: skip
        assert_clean_error(result, 2)
    assert not (model / "sub").exists()


def test_out_below_a_file_or_unwritable_is_bad_input(box):
    (box.root / "afile").write_text("x")
    box.watch(box.root / "afile")
    result = box.kvskill("apply", "qwen3", "--config-overrides", SMALL,
                         "--out", box.root / "afile" / "out")  # fmt: skip
    assert_clean_error(result, 2)
    if os.geteuid() != 0:  # root writes anywhere
        locked = box.root / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            result = box.kvskill("apply", "qwen3", "--config-overrides", SMALL,
                                 "--out", locked / "out")  # fmt: skip
            assert_clean_error(result, 2)
        finally:
            locked.chmod(0o700)


def test_a_stale_stage_dir_of_a_killed_apply_is_removed(box):
    out = box.root / "out"
    stale = box.root / ".out.kvskill-stage-999999999-abc"  # no such process
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 1024)
    result = box.kvskill("apply", "qwen3", "--config-overrides", SMALL, "--out", out)
    assert result.code == 0, result.err
    assert not stale.exists()
    assert sorted(p.name for p in box.root.iterdir() if p.name.startswith(".")) == []


def test_skill_install_removes_only_its_own_files_inside_the_skill_folder(box):
    target = box.root / "skills"
    result = box.kvskill("skill", "install", "--target", target)
    assert result.code == 0, result.err
    folder = target / "model-infer-kvcache"
    manifest = json.loads((folder / ".kvskill-manifest.json").read_text())
    victim = box.victims / "victim.txt"
    digest = hashlib.sha256(victim.read_bytes()).hexdigest()
    manifest["files"]["../../victims/victim.txt"] = digest
    manifest["files"][str(victim)] = digest
    (folder / "kept.md").write_text("edited by hand\n")
    manifest["files"]["kept.md"] = "0" * 64
    (folder / ".kvskill-manifest.json").write_text(json.dumps(manifest))
    for force in ([], ["--force"]):
        result = box.kvskill("skill", "install", "--target", target, *force)
        assert result.code == 0, result.err
        assert "Traceback" not in result.err
    assert (folder / "kept.md").read_text() == "edited by hand\n"


# ---- trust is per directory --------------------------------------------------------------


def test_converted_remote_code_never_runs_without_the_flag(box):
    model = remote_dir(box.root / "model")
    out = box.root / "out"
    marker = box.root / "marker.txt"
    result = box.kvskill("apply", model, "--out", out)
    assert result.code == 0, result.err
    with_marker(out, marker)
    for verb in (["run", out, "--random-weights", "--num-requests", "1", "--max-tokens", "2"],
                 ["verify", out]):  # fmt: skip
        assert_clean_error(box.kvskill(*verb), 2, contains="--trust-remote-code")
        assert not marker.exists(), f"{verb[0]} imported the directory's code"
    # the flag lets it run: the marker proves the refusal above was real
    result = box.kvskill("run", out, "--trust-remote-code", "--random-weights",
                         "--num-requests", "1", "--max-tokens", "2")  # fmt: skip
    assert marker.exists()
    marker.unlink()


def test_unconverted_remote_code_never_runs_without_the_flag(box):
    model = remote_dir(box.root / "model")
    marker = box.root / "marker.txt"
    with_marker(model, marker)
    for verb in ("analyze", "lint"):
        box.kvskill(verb, model)
    result = box.kvskill("run", model, "--random-weights", "--num-requests", "1")
    assert_clean_error(result, 2, contains="--trust-remote-code")
    result = box.kvskill("apply", model, "--out", box.root / "out")
    assert result.code == 0, result.err
    assert not marker.exists()


def test_python_api_needs_trust_remote_code_the_same_way(tmp_path):
    from kvskill import LLM
    from kvskill.core.errors import BadInputError

    model = remote_dir(tmp_path / "model")
    marker = tmp_path / "marker.txt"
    with_marker(model, marker)
    with pytest.raises(BadInputError, match="trust_remote_code=True"):
        LLM(model, random_weights=True)
    assert not marker.exists()


def test_kvskills_own_conversion_runs_and_an_edited_one_does_not(box, converted):
    args = ["--random-weights", "--num-requests", "2", "--max-tokens", "2"]
    result = box.kvskill("run", converted, *args, "--format", "json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["summary"]["generated_tokens"] == 4
    assert not list(converted.rglob("__pycache__")), "run wrote bytecode into the directory"
    # an edited modeling file, even with its hash recomputed in the plan, is not kvskill's
    edited = box.root / "edited"
    shutil.copytree(converted, edited)
    modeling = next(edited.glob("modeling_*.py"))
    modeling.write_text(modeling.read_text() + "\nimport os  # edited\n")
    plan = json.loads((edited / "kvskill_plan.json").read_text())
    record = plan["conversion"]["written_code"]
    record["files"][modeling.name] = hashlib.sha256(modeling.read_bytes()).hexdigest()
    (edited / "kvskill_plan.json").write_text(json.dumps(plan))
    assert_clean_error(box.kvskill("run", edited, *args), 2, contains=modeling.name)
    # an extra module, or shipped bytecode, is foreign code too
    extra = box.root / "extra"
    shutil.copytree(converted, extra)
    (extra / "__pycache__").mkdir()
    (extra / "__pycache__" / f"{modeling.stem}.cpython-311.pyc").write_bytes(b"\0" * 16)
    assert_clean_error(box.kvskill("run", extra, *args), 2, contains="__pycache__")


# ---- runtime options, weights, interrupts -----------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--kv-memory", "1TiB"],
        ["--kv-memory", "0"],
        ["--num-blocks", str(10**11)],
        ["--block-size", str(10**9)],
        ["--device", "npu"],
        ["--device", "mps"],
        ["--prompt-ids", "1,x,3"],
    ],
    ids=lambda a: " ".join(a),
)
def test_bad_run_options_are_bad_input(box, converted, args):
    result = box.kvskill("run", converted, "--random-weights", "--max-tokens", "2",
                         *([] if "--prompt-ids" in args else ["--num-requests", "1"]),
                         *args)  # fmt: skip
    assert_clean_error(result, 2)
    if args == ["--device", "npu"]:
        assert "torch_npu" in result.err and "npu[:N]" not in result.err


@pytest.mark.parametrize("case", ["not-utf8", "deep", "strings", "missing"])
def test_bad_prompt_files_are_bad_input(box, converted, case):
    path = box.root / "prompts.json"
    data = {
        "not-utf8": b"[[1, 2, \xff]]",
        "deep": ("[" * 100_000 + "]" * 100_000).encode(),
        "strings": b'[["a", "b"]]',
    }.get(case)
    if data is not None:
        path.write_bytes(data)
    result = box.kvskill("run", converted, "--random-weights", "--prompt-ids", path)
    assert_clean_error(result, 2)


def test_bad_verify_options_are_bad_input(box, converted):
    for atol in ("-1", "nan", "inf"):
        assert_clean_error(box.kvskill("verify", converted, "--atol", atol), 2)


def test_apply_refuses_a_kv_mode_the_framework_cannot_write(box):
    # standalone mode 1's layout is never written silently as something else in framework mode
    result = box.kvskill("apply", "qwen3", "--kv-mode", "contiguous", "--out", box.root / "o")
    assert_clean_error(result, 2, contains="framework mode writes legacy or paged")
    assert not (box.root / "o").exists()


def test_run_refuses_a_tensor_parallel_conversion_at_another_size(box):
    # converted for 2 ranks: `run` defaults to --tp 2; one rank cannot hold that split
    out = box.root / "tp2"
    result = box.kvskill("apply", "qwen3", "--config-overrides", SMALL, "--attn-tp-size", "2",
                         "--out", out)  # fmt: skip
    assert result.code == 0, result.err
    result = box.kvskill("run", out, "--random-weights", "--num-requests", "1", "--tp", "1")
    assert_clean_error(result, 2, contains="attn_tp_size=2")


def safetensors_bytes(num_floats: int) -> bytes:
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [num_floats], "data_offsets": [0, 4 * num_floats]}}
    ).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * (4 * num_floats)


@pytest.mark.parametrize("damage", ["half", "header-only", "wrong-shape", "garbage"])
def test_damaged_weights_never_verify_or_run(box, converted, damage):
    directory = box.root / "damaged"
    shutil.copytree(converted, directory)
    data = safetensors_bytes(1000)
    if damage == "half":
        data = data[: len(data) // 2]
    elif damage == "header-only":
        data = data[:8]
    elif damage == "wrong-shape":
        data = data.replace(b"[1000]", b"[1001]")
    else:
        data = b"\xff" * 64
    (directory / "model.safetensors").write_bytes(data)
    box.watch(directory)
    for shrink in ([], ["--no-shrink"]):
        assert_clean_error(box.kvskill("verify", directory, *shrink), 2, contains="weights file")
    result = box.kvskill("run", directory, "--num-requests", "1", "--max-tokens", "2")
    assert_clean_error(result, 2, contains="weights file")


def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(box):
    for delay in (0.3, 1.0, 2.5):
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvskill", "analyze", "qwen3"],
            cwd=box.cwd,
            env=box.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        if proc.returncode == 0:  # finished before the signal: nothing to check
            continue
        assert proc.returncode == 130, (delay, err)
        # one line (click may print an empty line first when the command was running)
        assert err.strip() == "kvskill: interrupted", (delay, err)
        assert out == ""


def test_sigterm_during_apply_leaves_no_stage_dir(box):
    out = box.root / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvskill", "apply", "qwen3", "--config-overrides", SMALL,
         "--out", str(out)],
        cwd=box.cwd, env=box.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(2.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err
    assert proc.returncode in (0, 143), err
    leftovers = [p.name for p in box.root.iterdir() if ".kvskill-" in p.name]
    assert leftovers == []
    # either the whole output or none of it
    assert not out.exists() or (out / "kvskill_plan.json").is_file()

"""SKILL.md and the reference pages: valid front matter, code that parses and runs, FA calls
identical to what `kvskill apply` emits, CLI lines the real CLI accepts, links and rule ids
that exist."""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import yaml
from kvskill.analyzer.lint import RULES
from kvskill.cli import cli as cli_main
from kvskill.resources import SKILL_NAME

ROOT = Path(__file__).resolve().parents[2]
SKILL_MD = ROOT / "SKILL.md"
REFERENCES = ROOT / "references"
PAGES = [SKILL_MD, *sorted(REFERENCES.glob("*.md"))]

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
FA_OPS = {"npu_fused_infer_attention_score", "npu_fused_infer_attention_score_v2"}
EMITTED = "# emitted by: "
RUNNABLE = "# runnable"


@dataclass(frozen=True)
class Block:
    page: Path
    index: int  #: position among the page's fenced blocks
    lang: str
    code: str

    @property
    def label(self) -> str:
        return f"{self.page.name}#{self.index}"


def blocks(lang: str | None = None) -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for index, match in enumerate(FENCE.finditer(text)):
            block = Block(page, index, match.group(1), match.group(2))
            if lang is None or block.lang == lang:
                found.append(block)
    return found


PYTHON = blocks("python")
RUNNABLES = [b for b in PYTHON if b.code.startswith(RUNNABLE)]
SYNCED = [b for b in PYTHON if b.code.startswith(EMITTED)]


def front_matter(text: str) -> tuple[dict, str]:
    assert text.startswith("---\n"), "SKILL.md must open with a --- front-matter fence"
    head, sep, body = text[4:].partition("\n---\n")
    assert sep, "SKILL.md front matter is not closed by a --- line"
    return yaml.safe_load(head), body


# ---- front matter and layout ----------------------------------------------------------------


def test_front_matter_is_a_valid_agent_skill():
    meta, body = front_matter(SKILL_MD.read_text(encoding="utf-8"))
    assert meta["name"] == SKILL_NAME == "model-infer-kvcache"
    description = meta["description"]
    assert isinstance(description, str) and 100 < len(description) <= 1024
    # it says when to trigger, not only what it is
    assert "Use when" in description
    assert len(body.splitlines()) < 500


def test_packaged_skill_md_is_the_root_file():
    packaged = ROOT / "skill" / "SKILL.md"
    assert packaged.is_symlink() and packaged.resolve() == SKILL_MD.resolve()


def test_every_reference_is_linked_from_skill_md_and_every_link_exists():
    text = SKILL_MD.read_text(encoding="utf-8")
    linked = set(re.findall(r"references/([\w.-]+\.md)", text))
    existing = {p.name for p in REFERENCES.glob("*.md")}
    assert linked - existing == set(), f"SKILL.md links missing pages: {linked - existing}"
    assert existing - linked == set(), f"pages SKILL.md never points to: {existing - linked}"


def test_pages_refer_only_to_pages_that_exist():
    existing = {p.name for p in REFERENCES.glob("*.md")}
    for page in PAGES:
        named = set(
            re.findall(r"\b([a-z_-]+(?:_reference|-examples|_ops)\.md)\b", page.read_text())
        )
        assert named <= existing, f"{page.name} names missing pages {named - existing}"


def test_lint_rule_ids_cited_exist_and_the_table_covers_every_rule():
    text = SKILL_MD.read_text(encoding="utf-8")
    cited = set(re.findall(r"\bKV\d{3}\b", text))
    known = {rule.id for rule in RULES}
    assert cited - known == set(), f"unknown lint rules cited: {cited - known}"
    table_rows = set(re.findall(r"^\| (KV\d{3}) \|", text, re.M))
    assert table_rows == known, f"rules missing from the error table: {known - table_rows}"


# ---- code blocks ------------------------------------------------------------------------------


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.label)
def test_python_block_parses(block):
    ast.parse(block.code, filename=block.label)


def test_the_required_runnable_programs_exist():
    runnable_code: dict[str, str] = {}
    for block in RUNNABLES:
        runnable_code[block.page.name] = runnable_code.get(block.page.name, "") + block.code
    fa = runnable_code.get("fa-code-examples.md", "")
    assert "block_table=" in fa and "npu_fused_infer_attention_score(" in fa  # paged FA vs naive
    assert "register_attn_type(" in runnable_code.get("framework_kv_reference.md", "")
    hybrid = runnable_code.get("noncontiguous_kv_reference.md", "")
    assert "KVCacheManager(" in hybrid and "use_hybrid_blocks=True" in hybrid
    assert {"standalone_kv_reference.md"} <= runnable_code.keys()


@pytest.mark.parametrize("block", RUNNABLES, ids=lambda b: b.label)
def test_runnable_block_lints_clean(block):
    # the complete programs are examples of correct code, so the common-error checks agree
    from kvskill.analyzer.lint import lint_source

    findings = lint_source(block.code, block.label)
    assert findings == [], [f"{f.rule} line {f.line}: {f.message}" for f in findings]


# Runs every runnable block in one fresh interpreter (one torch import), each in its own
# namespace and working directory; reports each block's traceback or None.
DRIVER = """
import json, os, sys, tempfile, traceback, io, contextlib
results = []
for label, code in json.load(sys.stdin):
    with tempfile.TemporaryDirectory() as cwd:
        os.chdir(cwd)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(code, label, "exec"), {"__name__": "__main__"})
            results.append([label, None])
        except BaseException:
            results.append([label, traceback.format_exc()])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def runnable_results() -> dict[str, str | None]:
    env = {**os.environ, "KVSKILL_OPS": "reference", "OMP_NUM_THREADS": "1"}
    payload = json.dumps([[b.label, b.code] for b in RUNNABLES])
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER],
        input=payload,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("block", RUNNABLES, ids=lambda b: b.label)
def test_runnable_block_runs_on_the_reference_ops(runnable_results, block):
    error = runnable_results[block.label]
    assert error is None, f"{block.label} failed:\n{error}"


# ---- FA examples in sync with the implementer --------------------------------------------------


def npu_calls(source: str) -> list[tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]]]:
    """Every ``torch_npu.<op>(...)`` call: (op, positional args, keywords), as source text."""
    calls = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch_npu"
        ):
            args = tuple(ast.unparse(a) for a in node.args)
            keywords = tuple((k.arg or "**", ast.unparse(k.value)) for k in node.keywords)
            calls.append((node.func.attr, args, keywords))
    return calls


def apply_args(block: Block) -> list[str]:
    """The `kvskill apply ...` arguments named on the block's first line."""
    first = block.code.splitlines()[0][len(EMITTED) :]
    words = shlex.split(first)
    assert words[:2] == ["kvskill", "apply"], f"{block.label}: {first!r} is not an apply line"
    return words[2:]


def without_docstring(func: ast.FunctionDef) -> ast.FunctionDef:
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        func.body = body[1:] or [ast.Pass()]
    return func


def emitted_statements(source: str) -> set[str]:
    """Every statement without a body (assignments, calls, ...) and every function (minus
    its docstring), normalised by ast so formatting and comments do not count."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef):
            found.add(ast.unparse(without_docstring(node)))
        elif isinstance(node, ast.stmt) and not hasattr(node, "body"):
            found.add(ast.unparse(node))
    return found


@functools.cache
def converted_source(args: tuple[str, ...]) -> str:
    """The Python `kvskill apply <args>` would write (modeling file, and runner in standalone
    mode), converted in-process."""
    from kvskill.implementer.writer import ApplyOptions, convert_model

    ctx = cli_main.commands["apply"].make_context("apply", [*args, "--dry-run"])
    params = ctx.params
    options = ApplyOptions(
        deploy_mode=params["deploy_mode"],
        fa_version=params["fa_version"],
        kv_mode=params["kv_mode"],
        mla_absorb=params["mla_absorb"],
    )
    conversion = convert_model(params["model"], options)
    # the modeling file, and in standalone mode the runner
    return "\n".join([conversion.converted, *conversion.added.values()])


def test_fa_examples_cover_every_emitted_path():
    targets = {
        " ".join(apply_args(b))
        for b in SYNCED
        if b.page.name == "fa-code-examples.md" and any(c[0] in FA_OPS for c in npu_calls(b.code))
    }
    assert {"qwen3", "gpt_oss", "deepseek_v3"} <= targets
    assert any("--mode standalone" in t and "contiguous" in t for t in targets)


@pytest.mark.slow
@pytest.mark.parametrize("block", SYNCED, ids=lambda b: " ".join(apply_args(b)))
def test_emitted_code_matches_what_apply_writes(block):
    generated_source = converted_source(tuple(apply_args(block)))
    # every statement shown is in the generated file, as written (comments aside)
    shown = [
        ast.unparse(without_docstring(node) if isinstance(node, ast.FunctionDef) else node)
        for node in ast.parse(block.code).body
    ]
    assert shown, f"{block.label} shows no code"
    emitted = emitted_statements(generated_source)
    missing = [stmt for stmt in shown if stmt not in emitted]
    assert not missing, f"{block.label} shows code `apply` does not emit: {missing}"
    documented = npu_calls(block.code)
    documented_fa = [c for c in documented if c[0] in FA_OPS]
    if not documented_fa:
        return
    generated_fa = sorted({c for c in npu_calls(generated_source) if c[0] in FA_OPS})
    # the page shows exactly the fused-attention calls the rewrite emits, keyword for keyword
    assert sorted(set(documented_fa)) == generated_fa, (
        f"{block.label} drifted from `kvskill apply {' '.join(apply_args(block))}`:\n"
        f"documented: {documented_fa}\ngenerated:  {generated_fa}"
    )


def test_npu_call_comparison_sees_a_changed_keyword():
    block = next(b for b in SYNCED if apply_args(b) == ["gpt_oss"])
    mutated = block.code.replace("softmax_scale=self.scaling", "scale=self.scaling")
    assert mutated != block.code
    assert npu_calls(mutated) != npu_calls(block.code)


# ---- CLI lines ----------------------------------------------------------------------------------


def skill_md_command_lines() -> list[str]:
    text = SKILL_MD.read_text(encoding="utf-8")
    lines = []
    for block in blocks("bash"):
        if block.page != SKILL_MD:
            continue
        lines += [line.split(" #")[0].strip() for line in block.code.splitlines()]
    lines += re.findall(r"`(kvskill [^`]*)`", text)
    return [line for line in lines if line.startswith("kvskill ")]


def reference_command_lines() -> list[str]:
    lines = []
    for block in blocks("bash"):
        if block.page != SKILL_MD:
            lines += [line.split(" #")[0].strip() for line in block.code.splitlines()]
    return [line for line in lines if line.startswith("kvskill ")]


def check_command_line(line: str) -> None:
    """Parse ``line`` with the real click commands, validating option names, arity, choices
    and ranges, without running anything (paths need not exist)."""
    words = shlex.split(line)[1:]
    command: click.Command = cli_main
    ctx = click.Context(cli_main, info_name="kvskill")
    path = ["kvskill"]
    while isinstance(command, click.Group):
        assert words, f"{line!r}: no subcommand after {' '.join(path)}"
        name = words.pop(0)
        assert name in command.commands, f"{line!r}: unknown command {name!r}"
        command = command.commands[name]
        path.append(name)
        ctx = click.Context(command, info_name=name, parent=ctx)
    parser = command.make_parser(ctx)
    try:
        values, positional, _ = parser.parse_args(args=list(words))
    except click.UsageError as exc:
        raise AssertionError(f"{line!r}: {exc.format_message()}") from exc
    for param in command.params:
        if not isinstance(param, click.Option) or param.name not in values:
            continue
        value = values[param.name]
        if not isinstance(value, (str, list, tuple)):
            continue  # not given on the line
        if isinstance(param.type, click.Path) or param.is_flag:
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            try:
                param.type.convert(item, param, ctx)
            except click.BadParameter as exc:
                raise AssertionError(f"{line!r}: {param.name}: {exc.format_message()}") from exc
    arguments = [p for p in command.params if isinstance(p, click.Argument)]
    assert not positional, f"{line!r}: unexpected extra arguments {positional}"
    if words:  # a bare `kvskill analyze` names the command in prose; with words it is a call
        for argument in arguments:
            given = values.get(argument.name)
            # click marks an absent argument with a sentinel (or None / empty in older versions)
            present = isinstance(given, str) or (isinstance(given, (list, tuple)) and given)
            assert not argument.required or present, f"{line!r}: missing {argument.name.upper()}"


def test_skill_md_quotes_cli_lines():
    lines = skill_md_command_lines()
    for verb in ("analyze", "apply", "verify", "run", "lint", "skill install"):
        assert any(line.startswith(f"kvskill {verb}") for line in lines), verb


@pytest.mark.parametrize("line", skill_md_command_lines() + reference_command_lines())
def test_quoted_cli_line_parses_with_the_real_cli(line):
    check_command_line(line)


@pytest.mark.parametrize(
    "line",
    [
        "kvskill analyze qwen3 --format xml",
        "kvskill apply qwen3 --mode cloud --out x/",
        "kvskill verify converted/ --no-such-flag",
        "kvskill run converted/ --top-p 2",
        "kvskill apply --out x/",
        "kvskill skill uninstall",
    ],
)
def test_command_line_check_rejects_bad_lines(line):
    with pytest.raises(AssertionError):
        check_command_line(line)

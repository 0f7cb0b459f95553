"""Run analyze -> apply -> verify for every supported family and rewrite the README table.

The "Supported models" table of README.md is generated from these runs, never typed by hand:

    .venv/bin/python scripts/supported_models.py            # run all, rewrite README.md
    .venv/bin/python scripts/supported_models.py --check    # run all, exit 1 if any fails
    .venv/bin/python scripts/supported_models.py qwen3 gpt_oss --no-write

Each family is converted from the installed transformers (or, for the remote-code row, from
the transformers-4-style model directory the tests write) into a temporary directory and
verified with the default options (shrunk config, fp32, logits within atol 1e-4 plus 16 float32
ulps of the largest logit, three chains).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
START = "<!-- supported-models:start -->"
END = "<!-- supported-models:end -->"
REMOTE = "remote code (transformers 4 style)"


@dataclass(frozen=True)
class Family:
    name: str
    #: config overrides a real checkpoint would carry but the default config lacks
    overrides: dict[str, Any] = field(default_factory=dict)
    note: str = ""


FAMILIES = [
    Family("llama"),
    Family("qwen2"),
    Family("qwen3"),
    Family("mistral"),
    Family("qwen3_moe"),
    Family("mixtral"),
    Family("gpt_oss"),
    Family("qwen3_next"),
    Family("qwen3_5"),
    Family("kimi_linear"),
    Family("deepseek_v3"),
    Family("deepseek_v32"),
    Family("glm_moe_dsa"),
    Family("mistral_large4"),
    Family("deepseek_v4"),
    Family("glm5_next"),
    Family(
        "deepseek_v2",
        {"num_experts_per_tok": 2},
        "default config leaves num_experts_per_tok unset; set to 2 as in checkpoints",
    ),
    Family(REMOTE, note="the test model of tests/implementer/remote_model.py"),
]


def _model_source(family: Family, workdir: Path) -> str:
    if family.name != REMOTE:
        return family.name
    sys.path.insert(0, str(ROOT / "tests" / "implementer"))
    from remote_model import write_remote_model

    return str(write_remote_model(workdir / "remote-source"))


def _analyze_cell(plan) -> str:
    modes = ", ".join(
        f"{kind} sparse {m.prefill}/{m.decode}" for kind, m in plan.sparse_mode.items()
    )
    kinds = plan.layer_attn_types()
    states = kinds.count("Mamba")
    if states:
        modes += f", Mamba states in {states} of {len(kinds)} layers"
    extra = ", learnable sinks" if plan.has_sinks else ""
    extra += ", MLA absorbed" if plan.mla_absorb else ""
    if plan.compressed_attention is not None:
        extra += ", compressed " + " / ".join(
            f"{k.name} x{len(k.layer_indices)}" for k in plan.compressed_attention.kinds
        )
    if plan.indexer is not None:
        extra += f", DSA indexer top-{plan.indexer.topk} in {len(plan.indexer.layers)} layers"
        if plan.indexer.pool_size > 1:
            extra += f" (pools of {plan.indexer.pool_size} + the open pool)"
    return (
        f"{plan.kv_mode}, {plan.attention.upper()}, {plan.input_layout}, {modes}, "
        f"FA {plan.fa_version}{extra}"
    )


def _verify_cell(report) -> str:
    if report.passed:
        return (
            f"pass: tokens identical over {len(report.prompts)} prompts, max abs logit diff "
            f"{report.max_logit_diff:.1e}, 3 chains ok"
        )
    failures = report.failures()
    return "FAIL: " + (failures[0] if failures else "see kvskill verify")


def run_family(family: Family, workdir: Path) -> dict[str, str]:
    """One table row: analyze, apply + verify (framework), standalone."""
    from kvskill.analyzer import analyze_model
    from kvskill.core.errors import KvskillError
    from kvskill.implementer.writer import ApplyOptions, apply_model
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    row = {"family": family.name, "note": family.note}
    model = _model_source(family, workdir)
    try:
        row["analyze"] = _analyze_cell(analyze_model(model, config_overrides=family.overrides))
    except KvskillError as exc:
        row["analyze"] = f"refused: {exc}"
        row["framework"] = row["standalone"] = "-"
        return row
    out = workdir / f"{family.name.replace(' ', '_')}-framework"
    try:
        apply_model(model, out, ApplyOptions(config_overrides=family.overrides))
        report = verify_directory(out, VerifyOptions(trust_remote_code=True))
        row["framework"] = _verify_cell(report)
    except KvskillError as exc:
        row["framework"] = f"unsupported: {exc}"
    row["standalone"] = _standalone_cell(model, family, workdir)
    return row


def _standalone_cell(model: str, family: Family, workdir: Path) -> str:
    """Standalone mode: apply, then the same verify as framework mode."""
    from kvskill.core.errors import KvskillError
    from kvskill.implementer.writer import ApplyOptions, apply_model
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    out = workdir / f"{family.name.replace(' ', '_')}-standalone"
    try:
        apply_model(
            model,
            out,
            ApplyOptions(
                deploy_mode="standalone", config_overrides=family.overrides, kv_mode="paged"
            ),
        )
        return _verify_cell(verify_directory(out, VerifyOptions(trust_remote_code=True)))
    except KvskillError as exc:
        return f"unsupported: {exc}"


def render_table(rows: list[dict[str, str]]) -> str:
    def cell(text: str) -> str:
        return " ".join(text.split()).replace("|", "\\|")

    lines = [
        "| family | analyze | apply + verify (framework) | standalone |",
        "|---|---|---|---|",
    ]
    for row in rows:
        name = f"`{row['family']}`" if row["family"] != REMOTE else row["family"]
        if row["note"]:
            name += f" ({row['note']})"
        lines.append(
            f"| {cell(name)} | {cell(row['analyze'])} | {cell(row['framework'])} | "
            f"{cell(row['standalone'])} |"
        )
    return "\n".join(lines)


def rewrite_readme(table: str, readme: Path = README) -> None:
    text = readme.read_text(encoding="utf-8")
    block = (
        f"{START}\nGenerated by `scripts/supported_models.py` from real `kvskill verify` runs "
        f"(torch {torch.__version__.split('+')[0]}, shrunk configs, fp32, atol 1e-4 + 16 "
        "float32 ulps of the largest logit).\n\n"
        f"{table}\n{END}"
    )
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        # first run: replace the placeholder table under the heading
        heading = "## Supported models\n"
        head, sep, rest = text.partition(heading)
        if not sep:
            raise SystemExit(f"{readme} has no '## Supported models' section")
        next_section = rest.find("\n## ")
        tail = rest[next_section:] if next_section >= 0 else ""
        text = f"{head}{sep}\n{block}\n{tail}"
    readme.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="subset of families (default: all)")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--check", action="store_true", help="exit 1 if a family fails")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    chosen = [f for f in FAMILIES if not args.families or f.name in args.families]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvskill-families-") as tmp:
        for family in chosen:
            print(f"== {family.name}", file=sys.stderr, flush=True)
            rows.append(run_family(family, Path(tmp)))
            print(f"   {rows[-1]['framework']}", file=sys.stderr, flush=True)
    table = render_table(rows)
    print(table)
    if not args.no_write and not args.families:
        rewrite_readme(table)
        print(f"rewrote {README}", file=sys.stderr)
    failed = [r["family"] for r in rows if not r["framework"].startswith("pass")]
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())

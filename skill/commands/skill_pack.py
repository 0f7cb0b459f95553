"""``kvskill skill``: install or print the agent skill (SKILL.md + references)."""

from __future__ import annotations

from pathlib import Path

import click
from kvskill import resources
from kvskill.install import Agent, install_skill

EPILOG = """\b
Examples:
  kvskill skill install                      # into <repo>/.claude/skills/model-infer-kvcache/
  kvskill skill install --agent agents       # into <repo>/.agents/skills/model-infer-kvcache/
  kvskill skill install --target ~/skills --force
  kvskill skill show | less

\b
Exit codes: 0 installed or already up to date, 2 a file was edited by hand (rerun with
--force to overwrite it) or the target cannot be written.
"""


@click.group(epilog=EPILOG)
def skill() -> None:
    """Install or show the model-infer-kvcache agent skill."""


@skill.command("install", epilog=EPILOG)
@click.option(
    "--target",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Skills folder (default: .claude/skills or .agents/skills of the current repo).",
)
@click.option(
    "--agent", type=click.Choice([a.value for a in Agent]), default="claude", show_default=True
)
@click.option("--force", is_flag=True, help="Overwrite a copy that was modified by hand.")
def install(target: Path | None, agent: str, force: bool) -> None:
    """Copy SKILL.md and references into <target>/model-infer-kvcache/."""
    result = install_skill(target=target, agent=Agent(agent), force=force)
    for line in result.describe():
        click.echo(line)


@skill.command("show")
def show() -> None:
    """Print SKILL.md."""
    click.echo(resources.skill_md().read_text(encoding="utf-8"), nl=False)

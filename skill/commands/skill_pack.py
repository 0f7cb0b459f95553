"""``kvskill skill``: install or print the agent skill (SKILL.md + references)."""

from __future__ import annotations

from pathlib import Path

import click
from kvskill.errors import NotImplementedYetError


@click.group()
def skill() -> None:
    """Install or show the model-infer-kvcache agent skill."""


@skill.command("install")
@click.option(
    "--target",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Skills folder (default: .claude/skills or .agents/skills of the current repo).",
)
@click.option(
    "--agent", type=click.Choice(["claude", "agents"]), default="claude", show_default=True
)
@click.option("--force", is_flag=True, help="Overwrite a copy that was modified by hand.")
def install(**options) -> None:
    """Copy SKILL.md and references into <target>/model-infer-kvcache/."""
    raise NotImplementedYetError("`kvskill skill install` is not implemented yet")


@skill.command("show")
def show() -> None:
    """Print SKILL.md."""
    raise NotImplementedYetError("`kvskill skill show` is not implemented yet")

"""One module per CLI command; each is a thin layer over the library."""

from kvskill.commands.analyze import analyze
from kvskill.commands.apply import apply
from kvskill.commands.lint import lint
from kvskill.commands.run import run
from kvskill.commands.skill_pack import skill
from kvskill.commands.verify import verify

COMMANDS = [analyze, apply, verify, run, lint, skill]

__all__ = ["COMMANDS"]

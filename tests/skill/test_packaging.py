"""Package data is reachable through importlib.resources and the console script runs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from kvskill import resources


def test_skill_md_is_package_data_with_front_matter():
    text = resources.skill_md().read_text(encoding="utf-8")
    assert text.startswith("---\n")
    assert "name: model-infer-kvcache" in text


def test_references_and_templates_are_package_data():
    assert resources.references_dir().is_dir()
    assert resources.templates_dir().is_dir()


def test_subpackages_map_to_the_top_level_folders():
    import kvskill.analyzer
    import kvskill.implementer
    import kvskill.runtime

    root = Path(__file__).resolve().parents[2]
    assert Path(kvskill.analyzer.__file__).parent == root / "analyzer"
    assert Path(kvskill.implementer.__file__).parent == root / "implementer"
    assert Path(kvskill.runtime.__file__).parent == root / "runtime"


def test_console_script_runs():
    script = Path(sys.executable).parent / "kvskill"
    exe = str(script) if script.exists() else shutil.which("kvskill")
    assert exe, "the kvskill console script is not installed"
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "kvskill" in proc.stdout


def test_every_package_folder_is_listed_for_the_wheel():
    """A subpackage missing from pyproject's explicit list would vanish from a built wheel."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(config["tool"]["setuptools"]["packages"])
    package_dir = config["tool"]["setuptools"]["package-dir"]
    found = set()
    for name, folder in package_dir.items():
        for init in (root / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(root / folder).parts
            found.add(".".join((name, *relative)))
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"

"""The import layering of pyproject.toml's [tool.importlinter] holds, and a planted upward import breaks it.

import-linter reads the package as installed, where the service folders sit inside `pagedserve/`;
the test lays that tree out with links, from pyproject.toml's own package-dir mapping."""
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"


def installed_layout(into: Path, planted: str | None = None) -> Path:
    """Links every installed module of pagedserve under `into`, as setuptools would place it; with
    `planted`, pagedserve/common/plan.py is a copy that also imports that module."""
    package_dir = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-dir"]
    root = into / "pagedserve"
    root.mkdir()
    for entry in (ROOT / "pagedserve").iterdir():
        if entry.name != "__pycache__":
            (root / entry.name).symlink_to(entry)
    for name, folder in package_dir.items():
        (into / name.replace(".", "/")).symlink_to(ROOT / folder)
    if planted:
        common = root / "common"
        common.unlink()
        common.mkdir()
        for f in (ROOT / "pagedserve" / "common").glob("*.py"):
            (common / f.name).symlink_to(f)
        plan = common / "plan.py"
        plan.unlink()
        plan.write_text((ROOT / "pagedserve/common/plan.py").read_text() + f"\nimport {planted}\n")
    return into


def lint(layout: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
               "sys.exit(lint_imports_command())", str(PYPROJECT), "--no-cache"]
    return subprocess.run(command, cwd=layout, env={"PYTHONPATH": str(layout)}, capture_output=True,
                          text=True, timeout=120)


def test_the_layering_contracts_hold(tmp_path):
    result = lint(installed_layout(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout


def test_an_upward_import_from_the_floor_breaks_the_build(tmp_path):
    result = lint(installed_layout(tmp_path, planted="pagedserve.scheduler_svc.scheduler"))
    assert result.returncode == 1
    assert "pagedserve.common.plan -> pagedserve.scheduler_svc.scheduler" in result.stdout
    assert "Contracts: 1 kept, 1 broken." in result.stdout


def test_importing_a_service_by_its_folder_name_breaks_the_build(tmp_path):
    result = lint(installed_layout(tmp_path, planted="kernels.attention"))
    assert result.returncode == 1 and "Contracts: 1 kept, 1 broken." in result.stdout

"""The set-up files agree with each other."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from conftest import ROOT


def test_environment_yml_pins_what_pyproject_pins():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.10's standard library reads no TOML")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"])
    for extra in ("course", "test"):
        wanted |= set(project["optional-dependencies"][extra])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert set(pip) - {"-e ."} == wanted
    assert "-e ." in pip and "python=3.11" in env["dependencies"]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make lab" in readme
    assert (ROOT / ".ci/run").read_text().strip().splitlines()[-1] == "make test"


def test_lint_is_clean():
    """ruff (pyproject.toml's rules, undefined names included) over the package, tests and notebooks."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "."], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr

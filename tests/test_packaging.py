"""The set-up files agree with each other."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from common import ROOT

LOCK = ROOT / "requirements" / "lock.txt"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_entries() -> list[tuple[str, str, str]]:
    """(name, version, environment marker) of every line of the lock."""
    found = []
    for line in LOCK.read_text().splitlines():
        if match := re.match(r"([A-Za-z0-9_.-]+)==(\S+)(?:\s*;\s*(.+))?$", line):
            found.append((normalize(match[1]), match[2], match[3] or ""))
    return found


def test_environment_yml_installs_from_the_lock():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert pip == ["-c requirements/lock.txt", "-e .[course,test]"]
    assert "python=3.11" in env["dependencies"]


def test_the_lock_was_made_by_make_lock_and_holds_the_pins():
    text = LOCK.read_text()
    assert "make lock" in text.splitlines()[1], "requirements/lock.txt is made by `make lock`, not by hand"
    names = {name for name, _, _ in lock_entries()}
    assert {"torch", "cloudpickle", "jupyterlab", "nbgrader", "pytest", "ruff"} <= names
    for pin in (ROOT / "requirements" / "pins.txt").read_text().splitlines():
        if pin.strip() and not pin.startswith("#"):
            name, version = pin.split("==")
            assert (normalize(name), version, "") in lock_entries(), f"the lock does not hold the pin {pin}"


@pytest.mark.skipif(bool(os.environ.get("CS336_UNLOCKED")), reason="make test-latest: the newest versions, on purpose")
def test_this_environment_is_the_lock():
    """Every package installed here is one the lock names, at the lock's version for this platform and Python: a
    dependency added to pyproject.toml without `make lock` shows up here, not on a learner's machine."""
    from importlib import metadata

    from packaging.markers import Marker

    wanted = {name: version for name, version, marker in lock_entries() if not marker or Marker(marker).evaluate()}
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    problems = []
    for dist in metadata.distributions():
        if Path(dist.locate_file("")).resolve() != site:  # e.g. setuptools' own vendored copies
            continue
        name, version = normalize(dist.metadata["Name"]), dist.version
        if name in ("pip", "setuptools", "wheel", "cs336-parallel", "uv"):
            continue
        if name not in wanted:
            problems.append(f"{name} {version} is installed but not in the lock (run `make lock`)")
        elif version.split("+")[0] != wanted[name]:  # torch 2.13.0+cpu is the CPU build of the lock's 2.13.0
            problems.append(f"{name} {version} is installed, the lock has {wanted[name]}")
    assert not problems, "\n".join(problems)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make lab" in readme
    assert (ROOT / ".ci/run").read_text().strip().splitlines()[-1] == "make test"


def test_lint_is_clean():
    """ruff (pyproject.toml's rules, undefined names included) over the package, tests and notebooks."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "."], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr

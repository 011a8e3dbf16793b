"""`make test-latest`: the whole suite on the newest versions pyproject.toml allows, and who breaks it.

It builds .venv-latest with `make test VENV=.venv-latest LATEST=1` (the newest releases, apart from what
requirements/pins.txt holds on purpose) and runs the suite there. It prints which packages are newer than the
lock; when the suite fails, it puts each of them back to the lock's version in turn, reruns the tests that
failed, and names the packages whose new release the failures come from. Standard library only: it runs
before any environment exists.

    make test-latest                  # everything (as long as `make test`)
    make test-latest ARGS="-x -k cluster"
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-latest"
PYTHON = VENV / "bin" / "python"
LOCK = ROOT / "requirements" / "lock.txt"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked() -> dict[str, set[str]]:
    """The lock's versions of each package (one per platform or Python where they differ)."""
    versions: dict[str, set[str]] = {}
    for line in LOCK.read_text().splitlines():
        if match := re.match(r"([A-Za-z0-9_.-]+)==([^\s;]+)", line):
            versions.setdefault(normalize(match[1]), set()).add(match[2])
    return versions


def installed() -> dict[str, str]:
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")
    done = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, check=True)
    return {normalize(name): version for name, version in json.loads(done.stdout).items()}


def newer_than_lock() -> dict[str, tuple[str, str]]:
    """{package: (installed version, the lock's)} for every package the lock holds at another version."""
    lock = locked()
    return {name: (version, "/".join(sorted(lock[name]))) for name, version in sorted(installed().items())
            if name in lock and version.split("+")[0] not in lock[name]}


def pip(*args: str) -> None:
    subprocess.run([PYTHON, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args], check=True,
                   cwd=ROOT)


def failed_tests_pass() -> bool:
    """Whether the tests that failed in the last run pass now."""
    done = subprocess.run([PYTHON, "-m", "pytest", "--lf", "-q"], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "CS336_UNLOCKED": "1"})
    return done.returncode == 0


def culprits(newer: dict[str, tuple[str, str]]) -> list[str]:
    """The packages whose lock version alone makes the failed tests pass again."""
    found = []
    for name, (version, _) in newer.items():
        pip("-c", str(LOCK), name)  # the lock's version, for this platform
        try:
            if failed_tests_pass():
                found.append(name)
        finally:
            pip(f"{name}=={version}")
    return found


def main() -> int:
    args = shlex.join(sys.argv[1:])
    env = {**os.environ, "CS336_UNLOCKED": "1"}  # the suite's check that the environment is the lock is skipped
    for stamp in VENV.glob(".installed*"):  # install anew: releases may have come out since the last run
        stamp.unlink()
    suite = subprocess.run(["make", "test", f"VENV={VENV.name}", "LATEST=1", f"ARGS={args}"], cwd=ROOT, env=env)
    if not PYTHON.exists():
        return suite.returncode or 1
    newer = newer_than_lock()
    print("\nmake test-latest: packages newer than requirements/lock.txt:")
    for name, (version, lock) in newer.items():
        print(f"  {name} {version} (lock: {lock})")
    if not newer:
        print("  none: the lock is up to date")
    if suite.returncode == 0:
        print("The suite passes on the newest versions: `make lock` may take them (then `make test`).")
        return 0
    if not newer:
        print("The suite fails here, but no package is newer than the lock: the failure is not a new release.")
        return suite.returncode
    print("The suite fails. Trying each newer package at the lock's version, on the tests that failed...")
    found = culprits(newer)
    if found:
        for name in found:
            version, lock = newer[name]
            print(f"BREAKS THE SUITE: {name} {version} (the failing tests pass with the lock's {name} {lock})")
    else:
        print("No single package explains the failures: several new releases together, or not a release at all.")
    return suite.returncode


if __name__ == "__main__":
    sys.exit(main())

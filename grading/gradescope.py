"""A Gradescope autograder for one assignment: `python -m grading gradescope ASSIGNMENT [--out autograder.zip]`.

Gradescope unpacks autograder.zip into /autograder/source of an Ubuntu container and runs its `setup.sh` there once
(as root) when it builds the image; then, for each submission, it runs `run_autograder` (copied to /autograder/),
which grades the files uploaded to /autograder/submission/ and leaves /autograder/results/results.json. The zip
holds:
- setup.sh: bubblewrap (the sandbox), make and Python's venv from apt, then the course's locked environment
  (`make .venv/.installed TORCH=cpu`: Gradescope's machines have no GPU);
- run_autograder [ROOT]: `python -m grading.gradescope ROOT` in ROOT/source (ROOT is /autograder unless given; the
  Python is ROOT/source/.venv's, or the one CS336_AUTOGRADER_PYTHON names, as the tests do);
- the package, grading/ with this assignment's master only, and what building the environment needs.

`grade(root)` grades as `python -m grading autograde` does, with the same execution, limits and trust boundary
(`classroom.grade_alone`): the tests in this process, the notebook's kernel and the test ranks in sandboxes where
bubblewrap can run. Gradescope's containers usually forbid the namespaces a sandbox needs: then the kernel and the
test ranks run as the unprivileged user `setup.sh` makes (`sandbox.USER`), who can read neither the masters nor the
grading code (`lock_down`) and cannot write the results; every process of that user is ended before the results are
written. Where neither is possible, nothing is graded. The results' top-level `output` says which it was.
results.json holds one test per graded cell: its name, score, max_score, visibility and `output`, the one-line
reason it failed (never a hidden test's code).
"""

from __future__ import annotations

import json
import os
import sys
import zipfile
from pathlib import Path

import nbformat

from cs336_parallel import selfcheck
from grading import classroom, gradebook, sandbox
from grading.gradebook import COURSE, REPO, Score

# What building the environment needs, besides the package and the grading code.
BUILD = ("pyproject.toml", "README.md", "Makefile", "requirements/lock.txt")
SETUP = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (Ubuntu): the sandbox (bubblewrap),
# make and Python's venv, then the course's locked environment, with PyTorch's CPU build (no GPU there).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends bubblewrap make python3 python3-venv python3-pip util-linux
# Where the container forbids a sandbox, notebooks run as this user, who may read the environment and the package only.
id cs336-student >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin cs336-student
cd /autograder/source
make .venv/.installed TORCH=cpu
"""
RUN = """#!/usr/bin/env bash
# Gradescope runs this for each submission (as /autograder/run_autograder): grade ROOT/submission's notebook,
# write ROOT/results/results.json. ROOT is /autograder unless given.
set -euo pipefail
ROOT="$(cd "${1:-/autograder}" && pwd)"
cd "$ROOT/source"
exec "${CS336_AUTOGRADER_PYTHON:-.venv/bin/python}" -m grading.gradescope "$ROOT"
"""


# -- the zip --------------------------------------------------------------------------------------------------

def source_files(assignment: str, course: Path = COURSE) -> dict[str, Path]:
    """{name in the zip: file}: the package, the grading code, this assignment's master (and no other), and what
    building the environment needs."""
    package = [p for p in (REPO / "cs336_parallel").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    files = {p.relative_to(REPO).as_posix(): p
             for p in [*package, *sorted(COURSE.glob("*.py")), *(REPO / name for name in BUILD)]}
    master = course / "source" / assignment
    files.update({f"grading/source/{assignment}/{p.relative_to(master).as_posix()}": p
                  for p in master.rglob("*") if p.is_file()})
    return files


def build(assignment: str, out: Path, course: Path = COURSE) -> Path:
    """Write the autograder of `assignment` to `out` (a zip in Gradescope's layout); returns `out`."""
    if assignment not in (known := gradebook.assignments(course)):
        raise SystemExit(f"{assignment} is not an assignment of the course ({', '.join(known)})")
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, text in (("setup.sh", SETUP), ("run_autograder", RUN)):
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o100755 << 16  # executable
            zf.writestr(info, text)
        for name, file in sorted(source_files(assignment, course).items()):
            zf.write(file, name)
    return out


# -- grading one submission ---------------------------------------------------------------------------------------

def find_notebook(submission: Path, assignment: str) -> Path | str:
    """The uploaded notebook: `<assignment>.ipynb` anywhere in the upload, else its only notebook; else why not."""
    notebooks = sorted(p for p in submission.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    named = [p for p in notebooks if p.name == f"{assignment}.ipynb"]
    if len(named) == 1 or len(notebooks) == 1:
        return (named or notebooks)[0]
    found = ", ".join(p.name for p in notebooks) or "none"
    return f"upload your notebook, {assignment}.ipynb (notebooks found: {found})"


def master_tests(assignment: str) -> list[Score]:
    """Every graded test cell of the master, at 0 points: the results when nothing could be graded."""
    master = nbformat.read(COURSE / "source" / assignment / f"{assignment}.ipynb", as_version=4)
    return [Score(c.metadata.nbgrader.grade_id, 0, c.metadata.nbgrader.get("points", 0))
            for c in selfcheck.graded_cells(master)]


def results(scores: list[Score], notes: list[str]) -> dict:
    """Gradescope's results.json: one test per graded cell, and the notes as the top-level output."""
    tests = [{"name": s.cell.removeprefix("test_"), "score": s.score, "max_score": s.max_score,
              "visibility": "visible", "output": s.reason or ("passed" if s.score == s.max_score else "")}
             for s in scores]
    return {"score": sum(s.score for s in scores), "output": "\n".join(notes), "tests": tests}


def lock_down(root: Path) -> None:
    """Before a notebook runs as the unprivileged user: it may pass through root/source and read the package (and an
    environment built there), and nothing else of root: not the grading code and masters, not the submission, not
    the results (which root writes, after every process of that user has ended)."""
    source = root / "source"
    root.chmod(0o711)
    source.chmod(0o755)  # listed: Python finds the package by listing the folders on its path
    for path in [source / "grading", root / "submission", *(p for p in source.iterdir() if p.is_file())]:
        path.chmod(0o700 if path.is_dir() else 0o600)
    for top in (source / "cs336_parallel", source / ".venv"):
        for folder, _, files in os.walk(top):
            os.chmod(folder, 0o755)
            for name in files:
                path = Path(folder, name)
                if not path.is_symlink():
                    path.chmod(path.stat().st_mode | 0o444)
    (root / "results").mkdir(exist_ok=True)
    (root / "results").chmod(0o755)


def isolation(root: Path) -> tuple[bool | None, str]:
    """(use a sandbox?, what the results say): a sandbox where bubblewrap runs; else the unprivileged user, where
    this is root and the user exists (after `lock_down`); else None: nothing is graded."""
    problem = sandbox.unavailable()
    if problem is None:
        return True, ("Graded in a sandbox (bubblewrap), with the course's limits, the hidden tests in the grader's "
                      "process.")
    if os.geteuid() == 0 and (no_user := sandbox.user_unavailable()) is None:
        lock_down(root)
        return False, (f"Graded without a sandbox (this container cannot make one: {problem}): the notebook ran as the "
                       f"unprivileged user {sandbox.USER}, who can read neither the course nor the results.")
    why = no_user if os.geteuid() == 0 else "the autograder does not run as root"
    return None, f"Not graded: this container can make no sandbox ({problem}), and {why}."


def grade(root: Path) -> dict:
    """Grade root/submission's notebook; write and return root/results/results.json."""
    [assignment] = gradebook.assignments()  # the zip holds one master
    use_sandbox, note = isolation(root)
    notes = [note]
    notebook = find_notebook(root / "submission", assignment)
    scores = master_tests(assignment)
    if use_sandbox is None:
        pass
    elif isinstance(notebook, str):
        notes.append(f"Not graded: {notebook}.")
    else:
        try:
            scores, run = classroom.grade_alone(notebook, assignment, use_sandbox=use_sandbox)
        except RuntimeError as e:  # the notebook could not be run at all
            notes.append(f"Not graded: {str(e).splitlines()[-1].strip()}")
        else:
            if run is not None and run.limit:
                notes.append(f"Stopped early: {run.limit}; the tests that did not finish score 0.")
    found = results(scores, notes)
    (root / "results").mkdir(parents=True, exist_ok=True)
    (root / "results" / "results.json").write_text(json.dumps(found, indent=1))
    return found


if __name__ == "__main__":
    grade(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/autograder"))

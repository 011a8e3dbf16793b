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
(`classroom.grade_alone`): the tests in this process, the notebook's kernel in a sandbox where bubblewrap can run.
Gradescope's containers may forbid the namespaces a sandbox needs: it then grades without one and says so in the
results' top-level `output`. results.json holds one test per graded cell: its name, score, max_score, visibility
and `output`, the one-line reason it failed (never a hidden test's code).
"""

from __future__ import annotations

import json
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
apt-get install -y -q --no-install-recommends bubblewrap make python3 python3-venv python3-pip
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


def grade(root: Path) -> dict:
    """Grade root/submission's notebook; write and return root/results/results.json."""
    [assignment] = gradebook.assignments()  # the zip holds one master
    problem = sandbox.unavailable()
    notes = [f"Graded without a sandbox: this container cannot make one ({problem})." if problem else
             "Graded in a sandbox (bubblewrap), with the course's limits, the hidden tests in the grader's process."]
    notebook = find_notebook(root / "submission", assignment)
    scores = master_tests(assignment)
    if isinstance(notebook, str):
        notes.append(f"Not graded: {notebook}.")
    else:
        try:
            scores, run = classroom.grade_alone(notebook, assignment, use_sandbox=problem is None)
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

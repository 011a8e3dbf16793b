"""Running a real class: the student edition a class is given (no solution, no hidden test) and its visible
self-check, the Gradescope autograder run against a simulated /autograder, and the class report (tests.png,
reasons.md, canvas.csv)."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

from common import ROOT
from cs336_parallel import selfcheck
from cs336_parallel.magics import grade_command
from fixtures.cheats import BLANK_SHARD_RANGE, GRADESCOPE_CHEAT, SHARD_RANGE, Submission, notebook
from grading import classroom, edition, gradebook, gradescope, report, sandbox
from grading.gradebook import Score

ASSIGNMENT = "00_setup"  # the smallest notebook
WRONG_SHARD_RANGE = SHARD_RANGE.replace("start + base + (rank < extra)", "start + base")  # drops the remainder
ANSWERS = {"correct": SHARD_RANGE, "wrong": WRONG_SHARD_RANGE, "blank": BLANK_SHARD_RANGE}


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Path:
    """The course's masters, copied: releasing and grading write beside them, not in grading/."""
    root = tmp_path_factory.mktemp("course")
    for name in gradebook.assignments():
        shutil.copytree(gradebook.COURSE / "source" / name, root / "source" / name)
    return root


@pytest.fixture(scope="module")
def secrets(course) -> dict[str, str]:
    return edition.secret_lines(course)


@pytest.fixture(scope="module")
def student_edition(course, tmp_path_factory) -> Path:
    into = tmp_path_factory.mktemp("edition") / "cs336-parallel-class"
    edition.write(into, course)
    return into


def submission(kind: str) -> nbformat.NotebookNode:
    """A student's 00_setup: the student version with a correct, wrong or blank answer, or a cheat."""
    student = nbformat.read(ROOT / "notebooks" / f"{ASSIGNMENT}.ipynb", 4)
    if kind == "cheat":
        return notebook(GRADESCOPE_CHEAT, student)
    return notebook(Submission(kind, kind, ASSIGNMENT, {"shard_range": ANSWERS[kind]}), student)


# -- the student edition ------------------------------------------------------------------------------------------

def test_the_edition_holds_the_learners_files_and_no_grading_or_tests(student_edition):
    top = {p.name for p in student_edition.iterdir()}
    assert {"notebooks", "cs336_parallel", "README.md", "Makefile", "pyproject.toml", "environment.yml",
            "requirements", "docs", ".gitignore"} <= top, top
    assert not top & {"grading", "tests", ".ci"}, top
    assert sorted(p.stem for p in (student_edition / "notebooks").glob("*.ipynb")) == gradebook.assignments()
    assert (student_edition / "notebooks" / "Makefile").exists()
    assert [p.name for p in (student_edition / "requirements").iterdir()] == ["lock.txt"]
    assert not list(student_edition.rglob("__pycache__"))


def test_no_solution_or_hidden_test_line_of_any_master_is_anywhere_in_the_edition(secrets, student_edition):
    assert set(secrets.values()) == set(gradebook.assignments()), "every master has telling lines"
    assert len(secrets) > 100
    assert edition.leaks(student_edition, secrets) == []


def test_the_search_finds_a_solution_line_in_a_notebook_and_a_hidden_test_line_in_any_file(course, secrets,
                                                                                           student_edition, tmp_path):
    master = nbformat.read(course / "source" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb", 4)
    solution = next(c.source for c in master.cells if "### BEGIN SOLUTION" in c.source)
    hidden = next(c.source for c in master.cells if "### BEGIN HIDDEN TESTS" in c.source)
    solution_line = next(line.strip() for line in solution.splitlines() if line.strip() in secrets)
    hidden_line = next(line.strip() for line in hidden.splitlines() if line.strip() in secrets)
    copy = tmp_path / "edition"
    shutil.copytree(student_edition / "notebooks", copy / "notebooks")
    nb = nbformat.read(copy / "notebooks" / f"{ASSIGNMENT}.ipynb", 4)
    nb.cells.append(nbformat.v4.new_code_cell(f'x = 1\n    {solution_line}  # "quoted"'))  # JSON-escaped on disk
    nbformat.write(nb, copy / "notebooks" / f"{ASSIGNMENT}.ipynb")
    (copy / "cs336_parallel").mkdir()
    (copy / "cs336_parallel" / "helper.py").write_text(f"def f():\n    {hidden_line}\n")
    found = edition.leaks(copy, secrets)
    assert any(solution_line in f and f.startswith("notebooks/00_setup.ipynb") for f in found), found
    assert any(hidden_line in f and f.startswith("cs336_parallel/helper.py") for f in found), found


def test_the_edition_refuses_a_folder_that_is_not_an_edition(course, tmp_path):
    (tmp_path / "work.txt").write_text("mine")
    with pytest.raises(SystemExit, match="neither empty nor an earlier student edition"):
        edition.write(tmp_path, course)
    assert (tmp_path / "work.txt").read_text() == "mine"


def test_course_only_parts_are_left_out_and_edition_only_parts_shown():
    text = ("a\n# course only\nb\n# end course only\nc\n| row | x | <!-- course only -->\n"
            "<!-- course only -->\nd\n<!-- end course only -->\n<!-- edition only\ne\n-->\nf\n")
    assert edition.edition_text(text) == "a\nc\ne\nf\n"
    with pytest.raises(ValueError, match="course only"):
        edition.edition_text("a\n# course only\nb\n")


def test_the_editions_readme_is_the_learners_part_with_the_note_on_hidden_tests(student_edition):
    readme = (student_edition / "README.md").read_text()
    assert "make lab TORCH=cpu" in readme and "make grade NOTEBOOK=" in readme and "## For learners" in readme
    assert "hidden tests, which\ngrade your work, run when you submit it" in readme
    for course_only in ("course only", "edition only", "grading/", "make test", "make notebooks", "make lock",
                        "For instructors", "student-edition"):
        assert course_only not in readme, course_only
    for picture in edition.pictures(readme):
        assert (student_edition / picture).exists()


def make_dry_run(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-n", *args, "VENV=/nonexistent/venv"], cwd=folder, capture_output=True,
                          text=True)


def test_the_editions_makefile_installs_the_lock_and_grades_with_the_visible_tests(student_edition):
    makefile = (student_edition / "Makefile").read_text()
    assert "grading" not in makefile and "course only" not in makefile
    lab = make_dry_run(student_edition, "lab", "TORCH=cpu").stdout
    assert "-c requirements/lock.txt" in lab and "download.pytorch.org/whl/cpu" in lab and "jupyter lab" in lab
    grade = make_dry_run(student_edition, "grade", "NOTEBOOK=notebooks/00_setup.ipynb").stdout
    assert "-m cs336_parallel.selfcheck notebooks/00_setup.ipynb" in grade
    assert make_dry_run(student_edition, "test").returncode != 0  # no developer targets
    assert "sys.version_info >= (3, 10)" in lab  # the Python check stays


def test_the_courses_make_grade_and_grade_magic_still_run_the_hidden_tests(student_edition):
    grade = make_dry_run(ROOT, "grade", "NOTEBOOK=notebooks/00_setup.ipynb").stdout
    assert "-m grading selfgrade notebooks/00_setup.ipynb" in grade
    command, cwd = grade_command("/x/00_setup.ipynb", ROOT)
    assert command[1:] == ["-m", "grading", "selfgrade", "/x/00_setup.ipynb"] and cwd == ROOT
    command, cwd = grade_command("/x/00_setup.ipynb", student_edition)
    assert command[1:] == ["-m", "cs336_parallel.selfcheck", "/x/00_setup.ipynb"] and cwd == Path("/x")


@pytest.mark.slow
def test_grading_in_the_edition_runs_the_visible_tests_and_says_the_hidden_ones_run_on_submission(student_edition,
                                                                                                   tmp_path):
    """What the edition's `make grade` runs, from the edition, on a wrong answer: one line per test cell, then the
    note on hidden tests; the notebook file is not changed."""
    path = tmp_path / f"{ASSIGNMENT}.ipynb"
    nbformat.write(submission("wrong"), path)
    before = path.read_bytes()
    done = subprocess.run([sys.executable, "-m", "cs336_parallel.selfcheck", str(path)], cwd=student_edition,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[1:4] == ["  ok  shard_range                 1 / 1",
                          "  --  shard_range_uneven          0 / 1   shard_range(10, 0, 4) returned (0, 2), "
                          "expected (0, 3)",
                          "  ok  shard_range_arguments       0.5 / 0.5"], lines
    assert lines[4:] == ["  total 1.5 / 2.5", selfcheck.HIDDEN_NOTE]
    assert path.read_bytes() == before
    assert "Traceback" not in done.stderr and "WARNING" not in done.stderr, done.stderr


# -- the Gradescope autograder --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def autograder(course, tmp_path_factory) -> Path:
    return gradescope.build(ASSIGNMENT, tmp_path_factory.mktemp("gradescope") / "autograder.zip", course)


def test_the_autograder_zip_has_gradescopes_layout_and_this_assignments_master_only(autograder):
    with zipfile.ZipFile(autograder) as zf:
        names = zf.namelist()
        modes = {info.filename: info.external_attr >> 16 for info in zf.infolist()}
        setup = zf.read("setup.sh").decode()
    for script in ("setup.sh", "run_autograder"):
        assert modes[script] & 0o111, f"{script} is not executable"
    assert {"Makefile", "pyproject.toml", "README.md", "requirements/lock.txt", "grading/nbgrader_config.py",
            "grading/gradescope.py", "cs336_parallel/selfcheck.py", f"grading/source/{ASSIGNMENT}/{ASSIGNMENT}.ipynb",
            } <= set(names)
    assert {n.split("/")[2] for n in names if n.startswith("grading/source/")} == {ASSIGNMENT}
    assert not [n for n in names if "__pycache__" in n or n.startswith(("tests/", "notebooks/", "grading/release"))]
    assert "apt-get install" in setup and "bubblewrap" in setup and "python3-venv" in setup
    assert "make .venv/.installed TORCH=cpu" in setup


def run_autograder(autograder: Path, upload: dict[str, nbformat.NotebookNode], path: str = "", *,
                   left_behind_s: float = 0) -> dict:
    """Gradescope's steps on a simulated /autograder (a new folder in /tmp, as /autograder is open to all): the zip
    unpacked into source/, run_autograder copied to the top, the upload in submission/; then run_autograder as
    root, with this environment's Python (and `path` as PATH, if given). Returns results.json as it is
    `left_behind_s` later: for a notebook that leaves a process behind, once that process had time to write it.

    A run with a sandbox goes in a folder of its own that others may not enter: Gradescope runs one autograder per
    container, and a run here must not show its masters to another run's notebook, which looks in /tmp/*/."""
    parent = "/tmp" if path else tempfile.mkdtemp(prefix="autograders-", dir="/tmp")
    root = Path(tempfile.mkdtemp(prefix="autograder-", dir=parent))
    root.chmod(0o755)
    try:
        with zipfile.ZipFile(autograder) as zf:
            zf.extractall(root / "source")
        shutil.copy(root / "source" / "run_autograder", root / "run_autograder")
        (root / "run_autograder").chmod(0o755)
        (root / "submission").mkdir()
        for name, nb in upload.items():
            nbformat.write(nb, root / "submission" / name)
        env = {**os.environ, "CS336_AUTOGRADER_PYTHON": sys.executable, **({"PATH": path} if path else {})}
        done = subprocess.run([str(root / "run_autograder"), str(root)], env=env, capture_output=True, text=True,
                              timeout=1200)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        time.sleep(left_behind_s)  # what a process left behind would write, it has written by now
        return json.loads((root / "results" / "results.json").read_text())
    finally:
        shutil.rmtree(root if parent == "/tmp" else parent, ignore_errors=True)


LEFT_BEHIND_S = 8  # the cheat's process writes the results 5 s after the notebook starts it
EXPECTED = {  # points of test_shard_range, _uneven, _arguments
    "correct": [1, 1, 0.5],
    "wrong": [1, 0, 0.5],
    "blank": [0, 0, 0],
    "cheat": [0, 0, 0],
}


@pytest.fixture(scope="module")
def gradescope_results(autograder, unprivileged_user, tmp_path_factory) -> dict[str, dict]:
    """Every simulated Gradescope run of this file, two at a time (each is a whole grading: a kernel and its ranks):
    one per kind of EXPECTED, the cheat where no sandbox can run, and an upload without the notebook."""
    tools = tmp_path_factory.mktemp("bin")  # a container without bubblewrap: what Ubuntu has, bubblewrap aside
    for tool in ("bash", "env", "setpriv"):
        (tools / tool).symlink_to(shutil.which(tool))
    runs = {kind: ({"my_work.ipynb" if kind == "correct" else f"{ASSIGNMENT}.ipynb": submission(kind)}, "")
            for kind in EXPECTED}  # any one name will do
    runs["no sandbox"] = ({f"{ASSIGNMENT}.ipynb": submission("cheat")}, str(tools))
    runs["no notebook"] = ({"a.ipynb": submission("blank"), "b.ipynb": submission("blank")}, "")
    leaves_a_process = {"cheat", "no sandbox"}  # the others wait for nothing
    with ThreadPoolExecutor(2) as pool:
        futures = {run: pool.submit(run_autograder, autograder, upload, path,
                                    left_behind_s=LEFT_BEHIND_S if run in leaves_a_process else 0)
                   for run, (upload, path) in runs.items()}
    return {run: future.result() for run, future in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", EXPECTED)
def test_run_autograder_writes_gradescopes_results(gradescope_results, secrets, kind):
    results = gradescope_results[kind]
    tests = results["tests"]
    assert [t["name"] for t in tests] == ["shard_range", "shard_range_uneven", "shard_range_arguments"]
    assert [t["score"] for t in tests] == EXPECTED[kind] and [t["max_score"] for t in tests] == [1, 1, 0.5]
    assert results["score"] == sum(EXPECTED[kind])
    assert all(set(t) == {"name", "score", "max_score", "visibility", "output"} for t in tests)
    assert all(t["visibility"] == "visible" and "\n" not in t["output"] for t in tests)
    assert all((t["output"] == "passed") == (t["score"] == t["max_score"]) for t in tests), tests
    assert "sandbox" in results["output"]
    text = json.dumps(results)
    assert not [line for line, name in secrets.items() if name == ASSIGNMENT and line in text]


@pytest.mark.slow
def test_where_no_sandbox_can_run_the_notebook_runs_as_a_user_who_reads_nothing_and_writes_nothing(
        gradescope_results):
    """The cheat reads the master from the autograder's folder and leaves a process that writes full marks after
    the notebook ends: as the unprivileged user it can do neither, with a sandbox or without one."""
    for run in ("cheat", "no sandbox"):
        results = gradescope_results[run]
        assert results["score"] == 0 and len(results["tests"]) == 3, (run, results)
        assert all(t["output"] for t in results["tests"]), results
    output = gradescope_results["no sandbox"]["output"]
    assert output.startswith("Graded without a sandbox (this container cannot make one: bubblewrap"), output
    assert f"ran as the unprivileged user {sandbox.USER}" in output


@pytest.mark.slow
def test_a_submission_without_the_notebook_scores_zero_and_says_what_to_upload(gradescope_results):
    results = gradescope_results["no notebook"]
    assert results["score"] == 0 and [t["max_score"] for t in results["tests"]] == [1, 1, 0.5]
    assert "upload your notebook, 00_setup.ipynb (notebooks found: a.ipynb, b.ipynb)" in results["output"]


# -- the class report ------------------------------------------------------------------------------------------------

def test_tests_are_summarized_hardest_first_with_the_most_common_reasons():
    job = lambda student: gradebook.Submission(ASSIGNMENT, student, "/course")  # noqa: E731
    graded = [report.Graded(job(f"s{i}"), [Score("test_a", 1, 1), Score("test_b", 0, 2, f"reason {i % 7}")])
              for i in range(30)] + [report.Graded(job("late"), None)]
    tests = report.summarize(graded)
    assert [(t.test, t.passed, t.graded, t.points) for t in tests] == [("test_b", 0, 30, 2), ("test_a", 30, 30, 1)]
    markdown = report.reasons_markdown(tests)
    assert "## 00_setup · b (2 pt): 0 of 30 passed" in markdown
    assert "## 00_setup · a (1 pt): 30 of 30 passed" in markdown
    assert markdown.count("| 5 | reason") == 2 and markdown.count("| 4 | reason") == 3  # the five most common
    assert Counter(line.startswith("| ") for line in markdown.splitlines())[True] == 6  # the header and five


@pytest.mark.slow
def test_autograde_writes_the_picture_the_reasons_and_canvass_columns(course, tmp_path):
    root = tmp_path / "class"
    shutil.copytree(course / "source" / ASSIGNMENT, root / "source" / ASSIGNMENT)
    for kind in ("correct", "wrong", "blank"):
        (root / "submitted" / kind / ASSIGNMENT).mkdir(parents=True)
        nbformat.write(submission(kind), root / "submitted" / kind / ASSIGNMENT / f"{ASSIGNMENT}.ipynb")
    classroom.autograde([ASSIGNMENT], root, jobs=2)
    folder = root / "report"
    assert (folder / "tests.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    reasons = (folder / "reasons.md").read_text()
    assert reasons.index("shard_range_uneven (1 pt): 1 of 3 passed") < reasons.index("shard_range (1 pt): 2 of 3")
    wrong = report.markdown_text("shard_range(10, 0, 4) returned (0, 2), expected (0, 3)")  # escaped: literal text
    assert f"| 1 | {wrong} |" in reasons
    assert f"| 1 | {report.markdown_text('`shard_range` is not implemented yet')}" in reasons
    rows = list(csv.reader((folder / "canvas.csv").open()))
    assert rows[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", ASSIGNMENT]
    assert rows[1] == ["Points Possible", "", "", "", "", "2.5"]
    assert rows[2:] == [["blank", "", "", "blank", "", "0"], ["correct", "", "", "correct", "", "2.5"],
                        ["wrong", "", "", "wrong", "", "1.5"]]
    exported = subprocess.run([sys.executable, "-m", "grading", "--course", str(root), "export", "--canvas",
                               str(root / "grades.csv")], cwd=ROOT, capture_output=True, text=True)
    assert exported.returncode == 0, exported.stderr
    assert (root / "grades.csv").read_text() == (folder / "canvas.csv").read_text()


def test_a_new_gradebook_gets_nbgraders_schema_version_without_starting_alembic(tmp_path, monkeypatch):
    """nbgrader would start `alembic heads` for each new gradebook (3 s); the course reads the version itself.
    Ground truth: the one revision of nbgrader's migration scripts that no other one revises."""
    from nbgrader import dbutil
    from nbgrader.api import Gradebook

    scripts = [p.read_text() for p in Path(dbutil.ALEMBIC_DIR, "versions").glob("*.py")]
    revisions = {re.search(r"^revision = ['\"](\w+)", s, re.M)[1] for s in scripts}
    revised = {m[1] for s in scripts if (m := re.search(r"^down_revision = ['\"](\w+)", s, re.M))}
    started = []
    monkeypatch.setattr(subprocess, "check_output", lambda *args, **kwargs: started.append(args))
    gradebook.api(tmp_path)
    with Gradebook(f"sqlite:///{tmp_path / 'gradebook.db'}"):
        pass
    with sqlite3.connect(tmp_path / "gradebook.db") as db:
        assert db.execute("SELECT version_num FROM alembic_version").fetchall() == [((revisions - revised).pop(),)]
    assert not started

"""The graded course end to end, asserted through nbgrader's gradebook: the release, how the masters are written,
the learner's loop, and the grader's defences on the real nbgrader path. (Each notebook's fixtures are graded in
test_mutations.py.)"""

from __future__ import annotations

import ast
import csv
import re
import shutil
import subprocess
from pathlib import Path

import mutation
import nbformat
import pytest

from common import ROOT
from grading import classroom, gradebook, verdict

ASSIGNMENTS = gradebook.assignments()


def grade_cells(nb) -> dict[str, nbformat.NotebookNode]:
    """The cells nbgrader knows (answers, tests, read-only cells), by grade_id."""
    return {c.metadata["nbgrader"]["grade_id"]: c for c in nb.cells if "nbgrader" in c.metadata}


def graded_cells(nb) -> dict[str, nbformat.NotebookNode]:
    """The autograded test cells (nbgrader's `grade` flag), by grade_id."""
    return {grade_id: c for grade_id, c in grade_cells(nb).items() if c.metadata["nbgrader"].get("grade")}


def copy_course(root: Path, *names: str) -> Path:
    for name in names:
        shutil.copytree(gradebook.COURSE / "source" / name, root / "source" / name)
    return root


def autograde(root: Path, name: str, submissions: dict[str, nbformat.NotebookNode]) -> dict[str, list]:
    """Grade each student's notebook; {student: gradebook.scores(...)}."""
    for student, nb in submissions.items():
        target = root / "submitted" / student / name
        target.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, target / f"{name}.ipynb")
    classroom.autograde([name], root, jobs=2)
    return {student: gradebook.scores(name, student, root) for student in submissions}


# -- the release -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def released_course(tmp_path_factory) -> Path:
    """A copy of the course with every assignment generated (in one nbgrader session: 3 s, not 2 s each)."""
    root = copy_course(tmp_path_factory.mktemp("released"), *ASSIGNMENTS)
    gradebook.release(root, root / "notebooks", list(ASSIGNMENTS))
    return root


@pytest.fixture(params=ASSIGNMENTS)
def released(request, released_course) -> tuple[str, Path]:
    """(assignment, course root)."""
    return request.param, released_course


def test_committed_notebooks_are_the_current_release(released):
    name, root = released
    generated = (root / "notebooks" / f"{name}.ipynb").read_bytes()
    committed = ROOT / "notebooks" / f"{name}.ipynb"
    assert committed.exists() and committed.read_bytes() == generated, (
        f"notebooks/{name}.ipynb is out of date: run `make notebooks` (python -m grading release)")


def test_release_has_no_solution_hidden_test_or_output(released):
    name, root = released
    source = (gradebook.COURSE / "source" / name / f"{name}.ipynb").read_text()
    text = (root / "notebooks" / f"{name}.ipynb").read_text()
    for marker in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"):
        assert marker not in text
    assert "### BEGIN SOLUTION" in source and "### BEGIN HIDDEN TESTS" in source
    released_sources = "\n".join(c.source for c in nbformat.reads(text, 4).cells)
    for cell in nbformat.reads(source, 4).cells:
        for block in re.findall(r"### BEGIN (?:SOLUTION|HIDDEN TESTS)\n(.*?)### END", cell.source, re.S):
            assert block.strip() not in released_sources
    nb = nbformat.reads(text, 4)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")


# -- how the masters are written ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ASSIGNMENTS)
def test_test_cells_follow_the_house_rules(name):
    """Every test cell is a %%test cell (one exercise, a namespace of its own), comes with visible checks before its
    hidden ones, explains each failed assert, and runs on the ranks only drivers of the package's test code, which
    it imports (what crosses is data and names, never test code); no notebook defines test code in a cell of its
    own; the setup cell is read-only; the cells a learner may edit reach into nothing."""
    nb = nbformat.read(gradebook.COURSE / "source" / name / f"{name}.ipynb", 4)
    assert grade_cells(nb), f"{name} has no exercise"
    first = nb.cells[next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")]
    code = [line for line in first.source.splitlines() if not line.startswith("#")]  # after the hosted-install note
    assert code[0] == "%load_ext cs336_parallel" and first.metadata.get("nbgrader", {}).get("locked")
    exercises = mutation.exercises(nb)
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        assert not cell.source.startswith("%%test_helpers"), "test code lives in cs336_parallel.testing, not in cells"
        if meta.get("grade"):
            head, _, body = cell.source.partition("\n")
            assert head.split()[:1] == ["%%test"] and head.split()[1] in exercises, (meta["grade_id"], head)
            assert meta["grade_id"].startswith(f"test_{head.split()[1]}"), meta["grade_id"]
            visible = body.strip() and not body.lstrip().startswith("### BEGIN HIDDEN")
            assert visible, f"{meta['grade_id']}: no visible test before the hidden ones"
            tree = ast.parse(mutation._python(cell.source))
            bare = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert) and n.msg is None]
            assert not bare, f"{meta['grade_id']}: the assert on line {bare} says nothing when it fails"
            imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                        and (node.module or "").startswith("cs336_parallel.testing") for a in node.names}
            for driver in drivers(tree):
                assert driver in imported, (f"{meta['grade_id']}: checks.run({driver}, ...) must name a driver of "
                                            "cs336_parallel.testing: test code never crosses to the ranks")
        elif cell.cell_type == "code" and not meta.get("locked"):
            assert not verdict.reaches_in(cell.source), (cell.source[:80], verdict.reaches_in(cell.source))


def drivers(tree: ast.AST) -> list[str]:
    """The names passed as the function of `checks.run(world_size, fn, ...)` in a test cell."""
    return [call.args[1].id for call in ast.walk(tree) if isinstance(call, ast.Call)
            and ast.unparse(call.func) == "checks.run" and len(call.args) > 1 and isinstance(call.args[1], ast.Name)]


# -- the real grading path: edits, deletions, displayed scores, machinery, feedback -------------------------------

@pytest.fixture(scope="module")
def defences(tmp_path_factory) -> tuple[Path, dict[str, list]]:
    """00_setup graded for students who edit or delete a test cell, display a score before failing, or reach
    into the kernel's machinery after a correct answer."""
    name = "00_setup"
    root = copy_course(tmp_path_factory.mktemp("defences"), name)
    gradebook.release(root, root / "notebooks", [name])
    master = nbformat.read(root / "source" / name / f"{name}.ipynb", 4)
    blank = nbformat.read(root / "release" / name / f"{name}.ipynb", 4)

    edited = nbformat.from_dict(blank)
    for grade_id, cell in graded_cells(edited).items():
        cell.source = f"print('{grade_id}: ok')  # a learner's edit: the test no longer tests"
    deleted = nbformat.from_dict(master)
    deleted.cells = [c for c in deleted.cells
                     if c.metadata.get("nbgrader", {}).get("grade_id") != "test_shard_range_uneven"]
    displayed = nbformat.from_dict(blank)
    grade_cells(displayed)["shard_range"].source = (
        "def shard_range(n, rank, world_size):\n    import sys\n    sys.displayhook(2.0)\n"
        "    raise NotImplementedError()")
    machinery = nbformat.from_dict(master)
    answer = grade_cells(machinery)["shard_range"]
    answer.source += "\n\nget_ipython().set_custom_exc((BaseException,), lambda *args, **kwargs: None)"
    submissions = {"edited": edited, "deleted": deleted, "displayed": displayed, "machinery": machinery}
    return root, autograde(root, name, submissions)


@pytest.mark.slow
def test_edited_test_cells_earn_nothing(defences):
    _, scores = defences
    assert all(s.score == 0 for s in scores["edited"]), scores["edited"]


@pytest.mark.slow
def test_a_deleted_test_cell_earns_nothing_and_the_others_keep_their_points(defences):
    _, scores = defences
    by_cell = {s.cell: s for s in scores["deleted"]}
    assert by_cell["test_shard_range_uneven"].score == 0 < by_cell["test_shard_range_uneven"].max_score
    assert all(s.score == s.max_score for c, s in by_cell.items() if c != "test_shard_range_uneven")


@pytest.mark.slow
def test_a_displayed_number_is_no_partial_credit(defences):
    _, scores = defences
    assert all(s.score == 0 for s in scores["displayed"]), scores["displayed"]


@pytest.mark.slow
def test_code_that_reaches_into_the_kernel_costs_nothing_and_is_listed_for_review(defences):
    """The tests run in the grader: a correct answer beside machinery code keeps its points, and the report lists
    the cell for the instructor (scores.csv's review column, the student's reasons file)."""
    root, scores = defences
    assert all(s.score == s.max_score for s in scores["machinery"]), scores["machinery"]
    rows = [row for row in csv.DictReader((root / "report" / "scores.csv").open()) if row["student"] == "machinery"]
    assert rows and all("get_ipython" in row["review"] for row in rows), rows
    assert "for review (not scored)" in (root / "report" / "reasons" / "machinery.txt").read_text()
    assert not any(row["review"] for row in csv.DictReader((root / "report" / "scores.csv").open())
                   if row["student"] in ("edited", "deleted"))


@pytest.mark.slow
def test_feedback_gives_each_reason_and_no_hidden_test(defences):
    root, scores = defences
    gradebook.feedback(["00_setup"], root)
    html = (root / "feedback" / "displayed" / "00_setup" / "00_setup.html").read_text()
    assert "is not implemented yet" in html
    master = nbformat.read(root / "source" / "00_setup" / "00_setup.ipynb", 4)
    for cell in graded_cells(master).values():
        for hidden in re.findall(r"### BEGIN HIDDEN TESTS\n(.*?)### END", cell.source, re.S):
            for line in hidden.strip().splitlines():
                assert line.strip() not in html, line


@pytest.mark.slow
def test_the_instructor_workflow_collect_autograde_feedback_export(tmp_path, capsys):
    root, submissions = copy_course(tmp_path / "course", "00_setup"), tmp_path / "downloads"
    for student, source in [("ada", gradebook.COURSE / "source"), ("bo", ROOT / "notebooks")]:
        (submissions / student).mkdir(parents=True)
        shutil.copy(next(source.rglob("00_setup.ipynb")), submissions / student / "00_setup.ipynb")
    (submissions / "bo" / "notes.ipynb").write_text("{}")  # not an assignment: skipped with a message
    assert gradebook.collect(submissions, root) == [("ada", "00_setup"), ("bo", "00_setup")]
    classroom.autograde(None, root, jobs=2)
    assert "autograding: 100%" in capsys.readouterr().err  # the progress bar over students
    gradebook.feedback(None, root)
    for student in ("ada", "bo"):
        assert (root / "feedback" / student / "00_setup/00_setup.html").exists()
    rows = gradebook.export(tmp_path / "grades.csv", root).read_text().splitlines()
    by_student = {row.split(",")[3]: row.split(",") for row in rows[1:]}
    assert by_student["ada"][-2:] == ["2.5", "2.5"] and by_student["bo"][-2:] == ["0.0", "2.5"]


@pytest.mark.slow
def test_a_learner_grades_their_own_notebook_after_the_first_exercise(tmp_path):
    """The first hour: the student version of 01 with only ring_reduce_scatter written, self-graded from the
    notebooks folder (where JupyterLab's terminal opens); each failure comes with its reason."""
    mine = nbformat.read(ROOT / "notebooks" / "01_collectives.ipynb", 4)
    solution = grade_cells(nbformat.read(gradebook.COURSE / "source/01_collectives/01_collectives.ipynb", 4))
    grade_cells(mine)["ring_reduce_scatter"].source = solution["ring_reduce_scatter"].source
    nbformat.write(mine, tmp_path / "01_collectives.ipynb")
    done = subprocess.run(["make", "grade", f"NOTEBOOK={tmp_path / '01_collectives.ipynb'}"],
                          capture_output=True, text=True, cwd=ROOT / "notebooks", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"ok\s+ring_reduce_scatter\s+2 / 2", done.stdout), done.stdout
    assert re.search(r"ok\s+ring_reduce_scatter_traffic\s+0.5 / 0.5", done.stdout), done.stdout
    assert re.search(r"--\s+ring_all_gather\s+0 / 2\s+`ring_all_gather` is not implemented yet", done.stdout)
    assert "total 4 / 18" in done.stdout, done.stdout

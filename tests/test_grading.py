"""The graded course end to end, asserted through nbgrader's gradebook: generate the student versions,
then autograde the solution, the blank release, and submissions that cheat, fail or hang."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

from conftest import ROOT
from grading import course

ASSIGNMENTS = course.assignments()
pytestmark = pytest.mark.timeout(900)  # a module fixture autogrades a notebook three or four times
EDITED_IN = ASSIGNMENTS[0]  # editing a test cell is checked once: it is nbgrader's mechanism, not a notebook's


def wrong_submission(name: str):
    """tests/fixtures/wrong/<name>.py: WRONG answers, and optionally DEADLOCK answers and a DELETED_TEST."""
    try:
        return importlib.import_module(f"fixtures.wrong.{name}")
    except ModuleNotFoundError:
        pytest.fail(f"tests/fixtures/wrong/{name}.py is missing: every notebook ships a plausible wrong submission")


def grade_cells(nb) -> dict[str, nbformat.NotebookNode]:
    """The cells nbgrader knows (answers, tests, read-only cells), by grade_id."""
    return {c.metadata["nbgrader"]["grade_id"]: c for c in nb.cells if "nbgrader" in c.metadata}


def graded_cells(nb) -> dict[str, nbformat.NotebookNode]:
    """The autograded test cells (nbgrader's `grade` flag), by grade_id."""
    return {grade_id: c for grade_id, c in grade_cells(nb).items() if c.metadata["nbgrader"].get("grade")}


@pytest.fixture(scope="module", params=ASSIGNMENTS)
def released(request, tmp_path_factory) -> tuple[str, Path]:
    """(assignment, course root): a copy of the course with that one assignment generated."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    shutil.copytree(course.COURSE / "source" / name, root / "source" / name)
    course.release(root, root / "notebooks", [name])
    return name, root


def test_committed_notebooks_are_the_current_release(released):
    name, root = released
    generated = (root / "notebooks" / f"{name}.ipynb").read_bytes()
    committed = ROOT / "notebooks" / f"{name}.ipynb"
    assert committed.exists() and committed.read_bytes() == generated, (
        f"notebooks/{name}.ipynb is out of date: run `make notebooks` (python grading/course.py release)")


def test_release_has_no_solution_hidden_test_or_output(released):
    name, root = released
    source = (course.COURSE / "source" / name / f"{name}.ipynb").read_text()
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


@dataclass
class Graded:
    name: str
    scores: dict[str, dict[str, tuple[float, float]]]  # student -> grade_id -> (score, max)
    seconds: dict[str, float]
    notebooks: dict[str, nbformat.NotebookNode]  # student -> the autograded notebook


def _replace_answers(nb, answers: dict[str, str]) -> None:
    cells = grade_cells(nb)
    for grade_id, code in answers.items():
        cells[grade_id].source = code.strip()


def _submissions(root: Path, name: str) -> dict[str, nbformat.NotebookNode]:
    solution = nbformat.read(root / "source" / name / f"{name}.ipynb", 4)
    blank = nbformat.read(root / "release" / name / f"{name}.ipynb", 4)
    fixture = wrong_submission(name)
    wrong = nbformat.read(root / "source" / name / f"{name}.ipynb", 4)
    _replace_answers(wrong, fixture.WRONG | getattr(fixture, "DEADLOCK", {}))
    deleted = getattr(fixture, "DELETED_TEST", None)
    wrong.cells = [c for c in wrong.cells if c.metadata.get("nbgrader", {}).get("grade_id", "") != deleted]
    submissions = {"solution": solution, "blank": blank, "wrong": wrong}
    if name == EDITED_IN:
        edited = nbformat.read(root / "release" / name / f"{name}.ipynb", 4)
        for grade_id, cell in graded_cells(edited).items():
            cell.source = f"print('{grade_id}: ok')  # a learner's edit: the test no longer tests"
        submissions["edited"] = edited
    return submissions


@pytest.fixture(scope="module")
def graded(released) -> Graded:
    name, root = released
    grader = course.api(root)
    scores, seconds, notebooks = {}, {}, {}
    for student, nb in _submissions(root, name).items():
        target = root / "submitted" / student / name
        target.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, target / f"{name}.ipynb")
        t0 = time.monotonic()
        result = grader.autograde(name, student)
        seconds[student] = time.monotonic() - t0
        assert result["success"], result.get("error")
        scores[student] = {s.cell: (s.score, s.max_score) for s in course.scores(name, student, root)}
        notebooks[student] = nbformat.read(root / "autograded" / student / name / f"{name}.ipynb", 4)
    return Graded(name, scores, seconds, notebooks)


def test_the_solution_scores_full_marks_with_no_stderr_and_no_timeout(graded):
    assert graded.scores["solution"] and all(s == m for s, m in graded.scores["solution"].values()), graded.scores
    for grade_id, cell in graded_cells(graded.notebooks["solution"]).items():
        kinds = [(o.output_type, o.get("name"), o.get("ename")) for o in cell.outputs]
        assert all(o[0] != "error" and o[1] != "stderr" for o in kinds), (grade_id, cell.outputs)


def test_the_blank_release_scores_zero_without_waiting_for_a_timeout(graded):
    assert all(s == 0 for s, _ in graded.scores["blank"].values()), graded.scores["blank"]
    for grade_id, cell in graded_cells(graded.notebooks["blank"]).items():
        errors = [o.ename for o in cell.outputs if o.output_type == "error"]
        assert errors and not {"RankTimeout", "CellTimeoutError"} & set(errors), (grade_id, errors)
    assert graded.seconds["blank"] < 60, f"the blank notebook took {graded.seconds['blank']:.0f} s to grade"


def test_edited_test_cells_earn_nothing(graded):
    if graded.name == EDITED_IN:
        assert all(s == 0 for s, _ in graded.scores["edited"].values()), graded.scores["edited"]


def test_a_wrong_answer_loses_its_own_points_and_no_others(graded):
    fixture = wrong_submission(graded.name)
    broken = {f"test_{g}" for g in fixture.WRONG | getattr(fixture, "DEADLOCK", {})}
    broken.add(getattr(fixture, "DELETED_TEST", ""))
    for grade_id, (score, max_score) in graded.scores["wrong"].items():
        if grade_id in broken:
            assert score < max_score, f"{grade_id} should lose points, scored {score}/{max_score}"
        else:
            assert score == max_score, f"{grade_id} should keep its points, scored {score}/{max_score}"


def test_a_deadlock_fails_its_test_in_time_and_the_rest_is_graded(graded):
    for grade_id in getattr(wrong_submission(graded.name), "DEADLOCK", {}):
        cell = graded_cells(graded.notebooks["wrong"])[f"test_{grade_id}"]
        errors = [o for o in cell.outputs if o.output_type == "error"]
        assert errors and errors[0].ename == "RankTimeout", cell.outputs  # the test's own limit, not nbgrader's
        assert "did not finish within" in errors[0].evalue + "".join(errors[0].traceback)


def test_a_deleted_test_cell_earns_nothing(graded):
    deleted = getattr(wrong_submission(graded.name), "DELETED_TEST", None)
    if deleted:
        score, max_score = graded.scores["wrong"][deleted]  # nbgrader still lists it
        assert score == 0 < max_score


def test_each_notebook_runs_top_to_bottom_within_2_minutes(graded):
    assert graded.seconds["solution"] < 120, f"{graded.name} took {graded.seconds['solution']:.0f} s"


def test_the_instructor_workflow_collect_autograde_feedback_export(tmp_path, capsys):
    root, submissions = tmp_path / "course", tmp_path / "downloads"
    shutil.copytree(course.COURSE / "source" / "00_setup", root / "source" / "00_setup")
    for student, source in [("ada", course.COURSE / "source"), ("bo", ROOT / "notebooks")]:
        (submissions / student).mkdir(parents=True)
        shutil.copy(next(source.rglob("00_setup.ipynb")), submissions / student / "00_setup.ipynb")
    (submissions / "bo" / "notes.ipynb").write_text("{}")  # not an assignment: skipped with a message
    assert course.collect(submissions, root) == [("ada", "00_setup"), ("bo", "00_setup")]
    course.autograde(None, root)
    assert "autograding: 100%" in capsys.readouterr().err  # the progress bar over students
    course.feedback(None, root)
    for student in ("ada", "bo"):
        assert (root / "feedback" / student / "00_setup/00_setup.html").exists()
    rows = course.export(tmp_path / "grades.csv", root).read_text().splitlines()
    by_student = {row.split(",")[3]: row.split(",") for row in rows[1:]}
    assert by_student["ada"][-2:] == ["2.0", "2.0"] and by_student["bo"][-2:] == ["0.0", "2.0"]


def test_a_learner_grades_their_own_notebook_after_the_first_exercise(tmp_path):
    """The first hour: the student version of 01 with only ring_reduce_scatter written, self-graded."""
    mine = nbformat.read(ROOT / "notebooks" / "01_collectives.ipynb", 4)
    solution = grade_cells(nbformat.read(course.COURSE / "source/01_collectives/01_collectives.ipynb", 4))
    grade_cells(mine)["ring_reduce_scatter"].source = solution["ring_reduce_scatter"].source
    nbformat.write(mine, tmp_path / "01_collectives.ipynb")
    done = subprocess.run([sys.executable, "grading/course.py", "selfgrade", str(tmp_path / "01_collectives.ipynb")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert re.search(r"ok\s+ring_reduce_scatter\s+2 / 2", done.stdout), done.stdout
    assert re.search(r"--\s+ring_all_gather\s+0 / 2", done.stdout) and "total 2 / 9" in done.stdout, done.stdout

"""Grades no answer can fake, graded the instructor's way (collect, autograde, feedback): the tests run in the
grader's own process (grading/grader.py), so tricks on the student's kernel and ranks earn nothing; honest code
is never punished for how it looks; no feedback shows a hidden test or a submission's script; and a course copied
elsewhere grades with every defence or refuses to grade."""

from __future__ import annotations

import csv
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from common import ROOT
from fixtures.cheats import CHEATS, HONEST, LEAKS, SCRIPT, Submission, notebook
from grading import classroom, gradebook, runner

ASSIGNMENTS = ("00_setup", "01_collectives")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # a module fixture grades every trick: 6 min when quiet


GRADER = {}  # what the grader's process was before and after grading the class


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> Path:
    """Every submission of tests/fixtures/cheats.py, collected from an LMS-like download folder, autograded two at
    a time, with feedback. (A blank notebook of each assignment is graded in test_mutations.py.)"""
    GRADER["before"] = {"session": os.getsid(0), "peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    root, downloads = tmp_path_factory.mktemp("course"), tmp_path_factory.mktemp("downloads")
    for name in ASSIGNMENTS:
        shutil.copytree(gradebook.COURSE / "source" / name, root / "source" / name)
    gradebook.release(root, root / "notebooks", list(ASSIGNMENTS))
    for submission in [*CHEATS, *LEAKS, *HONEST]:
        student = nbformat.read(root / "notebooks" / f"{submission.assignment}.ipynb", 4)
        (downloads / submission.name).mkdir()
        nbformat.write(notebook(submission, student), downloads / submission.name / f"{submission.assignment}.ipynb")
    gradebook.collect(downloads, root)
    classroom.autograde(None, root, jobs=2, limits=runner.Limits(wall_s=3000))  # slow under load is fine
    GRADER["after"] = {"session": os.getsid(0), "peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    gradebook.feedback(None, root)
    return root


def scores(root: Path, submission: Submission) -> dict[str, gradebook.Score]:
    return {s.cell: s for s in gradebook.scores(submission.assignment, submission.name, root)}


def answered_tests(root: Path, submission: Submission) -> set[str]:
    """The test cells of the exercises the submission answers (`test_<exercise>...`)."""
    return {cell for cell in scores(root, submission) if any(
        re.fullmatch(rf"test_{re.escape(exercise)}(_.+)?", cell) for exercise in submission.answers)}


@pytest.mark.parametrize("cheat", CHEATS, ids=lambda c: c.name)
def test_a_trick_earns_nothing(graded, cheat):
    assert all(s.score == 0 and s.reason for s in scores(graded, cheat).values()), (
        cheat.why, [(s.cell, s.score) for s in scores(graded, cheat).values() if s.score])


@pytest.mark.parametrize("honest", [*HONEST, *LEAKS[:2]], ids=lambda c: c.name)
def test_honest_code_earns_its_marks_however_it_looks(graded, honest):
    got = scores(graded, honest)
    for cell in answered_tests(graded, honest):
        should_pass = cell not in honest.loses
        assert (got[cell].score == got[cell].max_score) == should_pass, (honest.why, cell, got[cell])


def test_no_feedback_shows_a_hidden_test_line_or_a_submissions_script(graded):
    hidden = []
    for name in ASSIGNMENTS:
        master = nbformat.read(graded / "source" / name / f"{name}.ipynb", 4)
        for cell in master.cells:
            for block in re.findall(r"### BEGIN HIDDEN TESTS\n(.*?)### END", cell.source, re.S):
                hidden += [line.strip() for line in block.splitlines() if len(line.strip()) > 12]
    pages = sorted((graded / "feedback").rglob("*.html"))
    assert len(pages) == len(CHEATS) + len(LEAKS) + len(HONEST)
    for page in pages:
        html = page.read_text()
        leaked = [line for line in hidden if line in html]
        assert not leaked, (page, leaked[:3])
        assert not re.search(rf"<script[^>]*>[^<]*{SCRIPT}", html), page  # shown as text at most


def test_no_reply_runs_code_in_the_grader_or_fills_its_memory(graded):
    """A reply naming a module of the package would have made the grader import it (in_rank_server calls
    os.setsid); twelve-odd replies of 96 MiB each are refused unread, within the notebook's output limit."""
    assert GRADER["after"]["session"] == GRADER["before"]["session"]
    grown_mb = (GRADER["after"]["peak_kb"] - GRADER["before"]["peak_kb"]) / 1024
    assert grown_mb < 400, f"the grader's peak memory grew by {grown_mb:.0f} MB"
    reasons = (graded / "report" / "reasons" / "oversized_replies.txt").read_text()
    assert "output limit" in reasons, reasons


def test_what_a_students_exception_says_reaches_the_report_as_plain_text(graded):
    text = (graded / "report" / "reasons" / "escapes_in_reasons.txt").read_text()
    markdown = (graded / "report" / "reasons.md").read_text()
    for report in (text, markdown):
        assert "\x1b" not in report and "\x07" not in report
    assert "click [see](http://x) **now** | # heading" in text
    assert "\\[see\\]\\(http://x\\) \\*\\*now\\*\\* \\| \\# heading" in markdown


def test_code_that_reaches_into_the_kernel_is_listed_for_review_not_scored(graded):
    review = {row["student"]: row["review"] for row in csv.DictReader((graded / "report" / "scores.csv").open())}
    assert "_getframe" in review["expected_from_frame"] and "sys.modules" in review["settings_lookalike"], review
    assert "cs336_parallel.testing" in review["own_test_code"] and "kernel_side" in review["no_results"], review
    assert not review["honest_kernel_habits"] and not review["honest_answer_style"], review


# -- a course copied elsewhere --------------------------------------------------------------------------------

def nbgrader(args: list[str], cwd: Path, repository_importable: bool) -> subprocess.CompletedProcess:
    """nbgrader's own command line in a course folder, as an instructor might run it there."""
    tools = Path(sys.executable).parent  # the environment activated: nbgrader starts its alembic by name
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{tools}{os.pathsep}{env['PATH']}"
    if repository_importable:
        env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([str(tools / "nbgrader"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def copied(tmp_path) -> Path:
    """The course folder (configuration and masters) copied elsewhere, with one student's master submitted."""
    copy = tmp_path / "elsewhere"
    shutil.copytree(gradebook.COURSE, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__", "slurm"))
    shutil.copy(gradebook.COURSE / "nbgrader_config.py", copy / "nbgrader_config.py")
    (copy / "submitted" / "ada" / "00_setup").mkdir(parents=True)
    shutil.copy(copy / "source" / "00_setup" / "00_setup.ipynb", copy / "submitted" / "ada" / "00_setup")
    return copy


def test_nbgrader_in_a_copy_without_the_grading_code_refuses_to_load_its_configuration(copied):
    done = nbgrader(["generate_assignment", "00_setup", "--force"], copied, repository_importable=False)
    assert done.returncode != 0 and "nothing is graded" in done.stdout + done.stderr, done.stderr[-2000:]


def test_nbgraders_own_autograde_refuses_to_run_tests_in_the_students_kernel(copied):
    assert nbgrader(["generate_assignment", "00_setup", "--force"], copied, True).returncode == 0
    done = nbgrader(["autograde", "00_setup"], copied, repository_importable=True)
    assert done.returncode != 0 and "python -m grading autograde" in done.stdout + done.stderr, done.stderr[-2000:]
    assert not list((copied / "autograded").rglob("*.ipynb"))  # nothing was graded


def test_the_courses_grader_grades_a_copy_with_every_defence(copied):
    cheat = next(c for c in CHEATS if c.name == "own_test_code")
    (copied / "submitted" / cheat.name / "00_setup").mkdir(parents=True)
    student = nbformat.read(ROOT / "notebooks" / "00_setup.ipynb", 4)
    nbformat.write(notebook(cheat, student), copied / "submitted" / cheat.name / "00_setup" / "00_setup.ipynb")
    done = subprocess.run([sys.executable, "-m", "grading", "--course", str(copied), "autograde"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert all(s.score == s.max_score for s in gradebook.scores("00_setup", "ada", copied))
    assert all(s.score == 0 for s in gradebook.scores("00_setup", cheat.name, copied))

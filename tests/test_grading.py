"""The graded course end to end, asserted through nbgrader's gradebook.

One parallel autograde run grades, for every notebook, the master solution and then every fixture answer of
tests/fixtures/variants (correct ones written differently, wrong ones with one mistake each, tampering
attempts), each followed by copies of its exercise's test cells (tests/mutation.py), and the blank student
version. The rest checks the release, the learner's loop, and the grader's defences on the real nbgrader path."""

from __future__ import annotations

import ast
import csv
import importlib
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import mutation
import nbformat
import pytest

from common import ROOT
from grading import classroom, gradebook, verdict
from grading.runner import Limits

ASSIGNMENTS = gradebook.assignments()
# A module fixture autogrades a whole notebook and its fixtures: up to about 5 minutes on 2 quiet cores, three
# times that under a load of two other busy processes; a fixture that deadlocks fails on its own within seconds.
pytestmark = pytest.mark.timeout(3600)
# A notebook's kernel, its ranks and the grader's test ranks often wait on one another: its fixtures are dealt out
# to PARTS notebooks, JOBS graded at once (03 on 2 quiet cores: 300 s in one notebook, 227 s in three).
PARTS, JOBS = 3, 3
DEADLOCK_TIMEOUT_S = "10"  # a fixture that deadlocks fails its test after this long (checks.hang_timeout_s())


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


def autograded(root: Path, name: str, student: str) -> nbformat.NotebookNode:
    return nbformat.read(gradebook.autograded_notebook(root, name, student), 4)


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


# -- mutation testing: each notebook's master and every fixture, in an autograde run per notebook ----------------

def variants(name: str) -> dict:
    try:
        return importlib.import_module(f"fixtures.variants.{name}").VARIANTS
    except ModuleNotFoundError:
        pytest.fail(f"tests/fixtures/variants/{name}.py is missing: every exercise needs mutation fixtures")


@dataclass
class MutationRun:
    name: str
    scores: list  # the master's, from the gradebook
    blank: list  # the student version's, as released (notebooks/)
    notebook: nbformat.NotebookNode  # the autograded notebook
    outcomes: list[mutation.Outcome]


def grade_mutations(name: str, root: Path) -> MutationRun:
    """A notebook's master and every fixture, dealt out to PARTS notebooks graded side by side (the first also
    grades the master's own tests), the tricks on the kernel's machinery in a notebook of their own, and the blank
    student version, autograded together as a class is graded."""
    copy_course(root, name)
    master = nbformat.read(root / "source" / name / f"{name}.ipynb", 4)
    blocks = mutation.blocks(master, variants(name))
    notebooks = {"mutations" if part == 0 else f"mutations-{part}": mutation.build(master, blocks, part=part,
                                                                                   parts=PARTS)
                 for part in range(PARTS)}
    if any(b.layer == "machinery" for b in blocks):
        notebooks["machinery"] = mutation.build(master, blocks, machinery=True)
    for student, nb in notebooks.items():
        (root / "submitted" / student / name).mkdir(parents=True)
        nbformat.write(nb, root / "submitted" / student / name / f"{name}.ipynb")
    (root / "submitted" / "blank" / name).mkdir(parents=True)
    shutil.copy(ROOT / "notebooks" / f"{name}.ipynb", root / "submitted" / "blank" / name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CS336_TEST_TIMEOUT_S", DEADLOCK_TIMEOUT_S)
        # One notebook holds a whole class's worth of answers and their demonstrations: more output than one.
        classroom.autograde([name], root, jobs=JOBS, limits=Limits(wall_s=3000, output_mb=100))  # slow is fine
    outcomes = mutation.outcomes([autograded(root, name, student) for student in notebooks], blocks)
    return MutationRun(name, gradebook.scores(name, "mutations", root), gradebook.scores(name, "blank", root),
                       autograded(root, name, "mutations"), outcomes)


def test_the_other_parts_run_only_the_master_cells_their_blocks_read():
    """Part 0 runs the whole master; another part keeps the setup and answers (nbgrader's cells, not its tests),
    `%cluster` lines, and each cell that binds a name a kept cell after it reads. A cell that only shows something,
    or binds only what nothing reads, is left out."""
    def code(source: str, **nbgrader):
        c = nbformat.v4.new_code_cell(source)
        if nbgrader:
            c.metadata["nbgrader"] = nbgrader
        return c

    setup = code("%load_ext cs336_parallel\nimport torch", locked=True, grade_id="setup")
    answer = code("def f(x):\n    return x * SCALE", solution=True, grade_id="f")
    test = code("%%test f\nassert f(1) == 2", grade=True, grade_id="test_f")
    master = [setup, code("SCALE = 2"), answer, test, code("%cluster start -n 2"), code("rows = [f(1)]\nprint(rows)"),
              code("DIM, unread = 4, 0"), code("totals = {}"), code("print(DIM)"),
              code("def helper():\n    rows = 1\n    return rows")]
    demo = code("totals['a'] = f(DIM)\nrows = [helper() for _ in range(2)]")
    kept = [c.source.split("\n")[0] for c in mutation._needed(master, [demo])]
    assert kept == ["%load_ext cs336_parallel", "SCALE = 2", "def f(x):", "%cluster start -n 2", "DIM, unread = 4, 0",
                    "totals = {}", "def helper():"]


def test_a_correct_answer_reruns_the_demonstrations_that_read_it_or_what_it_computed():
    """A demonstration after the exercise's tests runs again after each correct fixture when it reads the exercise,
    or a name that a statement reading them bound or changed in place, unless a statement that does not bound it
    again."""
    nb = nbformat.v4.new_notebook()
    answer = nbformat.v4.new_code_cell("def f(x):\n    return x")
    answer.metadata["nbgrader"] = {"solution": True, "grade_id": "f"}
    test = nbformat.v4.new_code_cell("%%test f\nassert f(1) == 1")
    test.metadata["nbgrader"] = {"grade": True, "grade_id": "test_f"}
    rerun = ["y = f(1)", "print(y)", "table['a'] = f(2)", "print(table)", "def g():\n    return f(0)", "g()",
             "GB = 1e9\nz = f(2) / GB"]
    not_rerun = ["y = 3", "print(y)", "table = {}", "def h(x):\n    y = x\n    return y", "print(h(1))",
                 "print(GB)"]
    order = [rerun[0], rerun[1], not_rerun[0], not_rerun[1], not_rerun[2], rerun[2], rerun[3], rerun[4],
             not_rerun[3], not_rerun[4], rerun[5], rerun[6], not_rerun[5]]
    nb.cells = [nbformat.v4.new_code_cell("print(f(0))"), answer, test, *map(nbformat.v4.new_code_cell, order)]
    assert mutation.exercises(nb)["f"].demos == rerun


@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow) for name in ASSIGNMENTS])
def mutation_run(request, tmp_path_factory) -> MutationRun:
    """Each notebook's mutation run is a unit of its own: it fails alone, with its own message."""
    return grade_mutations(request.param, tmp_path_factory.mktemp(f"mutations-{request.param}"))


def test_the_master_scores_full_marks_with_no_error_or_stderr(mutation_run):
    assert mutation_run.scores and all(s.score == s.max_score for s in mutation_run.scores), [
        (s.cell, s.score, s.reason) for s in mutation_run.scores if s.score < s.max_score]
    for i, cell in enumerate(mutation_run.notebook.cells):
        if cell.cell_type == "code" and "mutation" not in cell.metadata:
            bad = [o.get("ename") or o.get("text", "")[:200] for o in cell.outputs
                   if o.output_type == "error" or o.get("name") == "stderr"]
            assert not bad, f"cell {i} ({cell.source[:60]!r}): {bad}"


def test_the_blank_student_version_scores_nothing_and_says_why(mutation_run):
    assert mutation_run.blank and all(s.score == 0 for s in mutation_run.blank), [
        (s.cell, s.score) for s in mutation_run.blank if s.score]
    for s in mutation_run.blank:
        assert s.reason.strip() and "\n" not in s.reason, (s.cell, s.reason)


def test_every_fixture_is_graded_as_its_kind(mutation_run, capsys):
    """Correct answers get full marks and their demonstrations run; each wrong one fails exactly the tests
    of its mistake; each tampering attempt fails every test of its exercise, caught by the defence named."""
    with capsys.disabled():
        print("\n" + mutation.table(mutation_run.name, mutation_run.outcomes))
    problems = [p for outcome in mutation_run.outcomes for p in outcome.problems()]
    assert not problems, "\n".join(problems)


def test_each_failure_says_in_one_line_which_case_failed(mutation_run):
    for outcome in mutation_run.outcomes:
        for reason in outcome.failed.values():
            assert reason.strip() and "\n" not in reason and "### BEGIN" not in reason, (outcome.block.why, reason)


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

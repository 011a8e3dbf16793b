"""Mutation testing of the grader, one autograde run per notebook: the master solution, then every fixture answer of
tests/fixtures/variants (correct ones written differently, wrong ones with one mistake each, tampering attempts),
each followed by copies of its exercise's test cells (tests/mutation.py), and the blank student version.

Each notebook's run is a unit of its own: it fails alone, with its own message, and pytest-xdist deals the
notebooks out to its workers one by one (tests/conftest.py)."""

from __future__ import annotations

import importlib
import shutil
from dataclasses import dataclass
from pathlib import Path

import mutation
import nbformat
import pytest

from common import ROOT, xdist_unit
from grading import classroom, gradebook
from grading.runner import Limits

ASSIGNMENTS = gradebook.assignments()
# A notebook's run takes up to about 5 minutes on 2 quiet cores, three times that under a load of two other busy
# processes; a fixture that deadlocks fails on its own within seconds.
pytestmark = pytest.mark.timeout(3600)
DEADLOCK_TIMEOUT_S = "10"  # a fixture that deadlocks fails its test after this long (checks.hang_timeout_s())


def autograded(root: Path, name: str, student: str) -> nbformat.NotebookNode:
    return nbformat.read(gradebook.autograded_notebook(root, name, student), 4)


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
    """A notebook's master followed by every fixture, the tricks on the kernel's machinery in a notebook of their
    own, and the blank student version, autograded together as a class is graded."""
    shutil.copytree(gradebook.COURSE / "source" / name, root / "source" / name)
    master = nbformat.read(root / "source" / name / f"{name}.ipynb", 4)
    blocks = mutation.blocks(master, variants(name))
    notebooks = {"mutations": mutation.build(master, blocks)}
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
        classroom.autograde([name], root, jobs=2, limits=Limits(wall_s=3000, output_mb=100))  # slow is fine
    outcomes = mutation.outcomes([autograded(root, name, student) for student in notebooks], blocks)
    return MutationRun(name, gradebook.scores(name, "mutations", root), gradebook.scores(name, "blank", root),
                       autograded(root, name, "mutations"), outcomes)


def test_the_machinery_notebook_runs_only_the_master_cells_its_blocks_read():
    """The notebook of tricks on the kernel's machinery keeps the master's setup and answers (nbgrader's cells, not
    its tests), `%cluster` lines, and each cell that binds a name a kept cell after it reads. A cell that only shows
    something, or binds only what nothing reads, is left out."""
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


def test_each_notebooks_mutation_run_is_a_unit_of_its_own_and_other_modules_stay_whole():
    run = "tests/test_mutations.py::test_every_fixture_is_graded_as_its_kind[{}]"
    assert xdist_unit(run.format("03_zero_fsdp")) == "tests/test_mutations.py[03_zero_fsdp]"
    assert xdist_unit(run.format("03_zero_fsdp")) != xdist_unit(run.format("02_data_parallel"))
    assert xdist_unit("tests/test_mutations.py::test_each_failure_says_in_one_line_which_case_failed[03_zero_fsdp]") \
        == xdist_unit(run.format("03_zero_fsdp"))
    assert xdist_unit("tests/test_trust.py::test_a_trick_earns_nothing[magic_by_name]") == "tests/test_trust.py"
    assert xdist_unit("tests/test_grading.py::test_test_cells_follow_the_house_rules[01_collectives]") \
        == "tests/test_grading.py"


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

"""The grader's verdicts, and what a graded notebook says to the instructor.

The grader (grading/runner.py, grading/grader.py) records its verdict on each test cell in the cell's metadata
(`record`: passed, or failed and why, in one line). Scoring is nbgrader's autograde with two steps of the course's
(nbgrader_config.py names them): `ExecutedNotebook` takes the notebook the grader executed in place of executing
it (and refuses to run without one: nbgrader's own `autograde` would run the tests in the student's kernel), and
`SaveVerdicts` scores each test cell by its verdict. Nothing the student's code displays can change a score.

`reaching(nb)` lists the cells a learner can edit whose code reaches into the kernel's machinery or the grader
(`get_ipython`, `sys.modules`, a function's `__code__`...): no exercise needs that, but honest code sometimes
does it, and no test runs in the kernel any more, so it costs no point. The class report lists them for an
instructor to look at (report.py).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
from nbformat.notebooknode import NotebookNode
from nbgrader.preprocessors import NbGraderPreprocessor, SaveAutoGrades
from traitlets import Unicode

from cs336_parallel import selfcheck
from cs336_parallel.text import printable

# What the listing looks for: the kernel's machinery, the interpreter's hooks, a function's insides, another
# frame's variables, the dispatcher's escape hatches, and code loaded from elsewhere. Names after a dot, or alone.
MACHINERY = {
    "get_ipython", "__builtins__", "__import__", "displayhook", "excepthook", "set_custom_exc",
    "input_transformers_cleanup", "input_transformers_post", "ast_transformers", "register_magic_function",
    "register_magics", "register_cell_magic", "register_line_magic", "__code__", "__globals__", "__closure__",
    "_getframe", "currentframe", "settrace", "setprofile", "get_referrers", "f_back", "f_locals", "f_globals",
    "tb_frame", "_disable_current_modes", "no_dispatch", "_DisableTorchDispatch", "_unset_dispatch_mode",
    "_push_on_torch_dispatch_stack", "_pop_torch_dispatch_stack",
}
IMPORTS = ("builtins", "ctypes", "importlib", "IPython.core", "ipykernel", "traitlets", "nbgrader", "grading",
           # the package's test code and the boundary's pieces: patching them in the kernel changes no grade (the
           # grader has its own), but a learner has no reason to
           "cs336_parallel.testing", "cs336_parallel.checks", "cs336_parallel.probes", "cs336_parallel.testcell",
           "cs336_parallel.testranks", "cs336_parallel.kernel_side", "cs336_parallel.boundary", "cs336_parallel.plain",
           "cs336_parallel.rank_host", "cs336_parallel.protocol")
CALLS = {"exec", "eval", "compile"}
MAGICS = {"run", "load", "alias_magic"}  # code from a file, or a magic under another name


def reaches_in(source: str) -> list[str]:
    """What in a cell's source reaches into the kernel or the grader: one description per finding."""
    found = []
    python_lines = []
    for line in source.splitlines():
        magic = re.match(r"\s*%{1,2}(\w+)", line)
        if magic and magic.group(1) in MAGICS:
            found.append(f"the magic %{magic.group(1)}")
        python_lines.append("" if re.match(r"\s*[%!]", line) else line)
    try:
        tree = ast.parse("\n".join(python_lines))
    except SyntaxError:
        return [*found, "code that is not Python (the listing cannot read it)"]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in MACHINERY:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "modules" and ast.unparse(node.value) == "sys":
            found.append(f"line {node.lineno}: sys.modules")
        elif isinstance(node, ast.Name) and (node.id in MACHINERY or node.id in CALLS):
            found.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
            found += [f"line {node.lineno}: import {n}" for n in names if n.startswith(IMPORTS)][:1]
    return found


def _editable(cell: NotebookNode) -> bool:
    """A code cell a learner may change: answer cells and every cell not restored from the course."""
    meta = cell.metadata.get("nbgrader", {})
    return cell.cell_type == "code" and not (meta.get("locked") or selfcheck.is_test(cell))


def reaching(nb: NotebookNode) -> list[str]:
    """`cell N: what it reaches` for each editable cell that reaches into the kernel or the grader: for the
    instructor to look at, never scored."""
    return [f"cell {number}: {'; '.join(found[:3])}" for number, cell in enumerate(nb.cells, start=1)
            if _editable(cell) and (found := reaches_in(cell.source))]


KEY = "cs336"  # a test cell's metadata entry for the grader's verdict: {"passed": bool, "reason": str}


def record(cell: NotebookNode, reason: str | None) -> None:
    """Write the grader's verdict on a test cell into its metadata: passed, or failed for `reason` (one line)."""
    line = (reason or "").strip().splitlines()
    cell.metadata[KEY] = {"passed": reason is None, "reason": printable(line[0] if line else "failed")}


def verdict_of(cell: NotebookNode) -> dict:
    """A test cell's verdict; a cell the grader gave none failed (it did not run)."""
    found = cell.metadata.get(KEY)
    if isinstance(found, dict) and isinstance(found.get("passed"), bool):
        return found
    return {"passed": False, "reason": "not run: the grader has no verdict for this test"}


class ExecutedNotebook(NbGraderPreprocessor):
    """The first step of scoring, where nbgrader would execute the notebook: the notebook the grader executed
    (grading/runner.py: its cells restored from the gradebook, then run, the tests in the grader's process) takes
    the submitted one's place. Without `results` (nbgrader's own `autograde`, which would run the hidden tests in the
    student's kernel) it refuses, saying how to grade."""

    results = Unicode("", help="the folder of executed notebooks (<results>/<assignment>/<student>/)").tag(config=True)

    def preprocess(self, nb, resources):
        if not self.results:
            raise RuntimeError("this course is graded with `python -m grading autograde` (grading/README.md): its "
                               "tests run in the grader's own process, never in the student's kernel, so nbgrader's "
                               "own autograde is refused")
        ids = resources["nbgrader"]
        path = Path(self.results, ids["assignment"], ids["student"], f"{ids['notebook']}.ipynb")
        return nbformat.read(path, as_version=4), resources


class SaveVerdicts(SaveAutoGrades):
    """nbgrader's SaveAutoGrades, with each test cell's score the grader's verdict (full points if it passed,
    else 0), not a reading of its outputs."""

    def _add_score(self, cell: NotebookNode, resources) -> None:
        if not selfcheck.is_test(cell):
            return super()._add_score(cell, resources)
        grade = self.gradebook.find_grade(cell.metadata["nbgrader"]["grade_id"], self.notebook_id,
                                          self.assignment_id, self.student_id)
        grade.auto_score = float(cell.metadata["nbgrader"]["points"]) if verdict_of(cell)["passed"] else 0.0
        grade.needs_manual_grade = grade.manual_score is not None
        self.gradebook.db.commit()


def reasons(nb: NotebookNode) -> dict[str, str]:
    """The one-line reason of every failed test cell, by grade_id: the grader's verdict."""
    return {cell.metadata["nbgrader"]["grade_id"]: verdict_of(cell)["reason"] or "failed"
            for cell in selfcheck.graded_cells(nb) if not verdict_of(cell)["passed"]}

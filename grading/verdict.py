"""What a graded notebook says, read for the instructor: each failed test's one-line reason, and the cells that reach
into the kernel.

A test cell's outputs are written by the grader (grading/grader.py): what it printed, what the student's code
printed as plain text, and a `TestFailed` error when the test failed. nbgrader scores a cell 0 when it shows an
error, so the grader's verdict is the score; nothing the student's code displays can change it.

`reaching(nb)` lists the cells a learner can edit whose code reaches into the kernel's machinery or the grader
(`get_ipython`, `sys.modules`, a function's `__code__`...): no exercise needs that, but honest code sometimes
does it, and no test runs in the kernel any more, so it costs no point. The class report lists them for an
instructor to look at (report.py).
"""

from __future__ import annotations

import ast
import re

from nbformat.notebooknode import NotebookNode
from nbgrader.preprocessors import NbGraderPreprocessor

from cs336_parallel import selfcheck

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
IMPORTS = ("builtins", "ctypes", "importlib", "IPython.core", "ipykernel", "traitlets", "nbgrader", "grading")
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
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"line {node.lineno}: import {n}" for n in names if n.startswith(IMPORTS)]
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


class RefuseExecute(NbGraderPreprocessor):
    """Stands where nbgrader's Execute would: nbgrader's own `autograde` would run the hidden tests in the student's
    kernel, so it stops instead, saying how to grade (the course grades with `python -m grading autograde`)."""

    def preprocess(self, nb, resources):
        raise RuntimeError("this course is graded with `python -m grading autograde` (grading/README.md): its tests "
                           "run in the grader's own process, never in the student's kernel, so nbgrader's own "
                           "autograde is refused")


def reasons(nb: NotebookNode) -> dict[str, str]:
    """The one-line reason of every failed test cell, by grade_id (the first error, else the stderr text)."""
    found = {}
    for cell in nb.cells:
        if not selfcheck.is_test(cell):
            continue
        grade_id = cell.metadata["nbgrader"]["grade_id"]
        errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
        stderr = [o for o in cell.get("outputs", []) if o.output_type == "stream" and o.name == "stderr"]
        if errors:
            found[grade_id] = selfcheck.error_reason(errors[0])
        elif stderr:
            first = stderr[0].text.strip().splitlines()[0][:200]
            found[grade_id] = "wrote to stderr: " + re.sub(r"\x1b\[[0-9;]*m", "", first)
    return found

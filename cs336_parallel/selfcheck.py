"""`python -m cs336_parallel.selfcheck NOTEBOOK`: a learner checks a notebook against its visible tests.

This is `make grade` and `%grade` in a class's student edition (`python -m grading student-edition`), which holds
no hidden test: a copy of the notebook, as saved, runs top to bottom in a fresh kernel; its `%%test` cells run the
visible tests there (cs336_parallel.testcell), and each one's outcome is read back from its outputs. It prints one
line per test cell, then one line saying that the hidden tests run when the work is submitted. In the course's own
repository, `make grade` runs the hidden tests instead (`python -m grading selfgrade`).

`table` and `error_reason` are shared with the grader, so a learner's check and a grade read the same.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbformat.notebooknode import NotebookNode

from .text import printable

KERNEL = "cs336-parallel"  # registered by `make lab`
CELL_TIMEOUT_S = 300  # a cell's backstop, here and in the grader (grading/nbgrader_config.py)
# The course's kernel answers once it has imported torch and started the rank server (cs336_parallel.kernel):
# seconds on a quiet machine, much longer on a busy one. A kernel that dies is noticed at once.
KERNEL_START_TIMEOUT_S = 300
QUIET_KERNEL = ["--HistoryManager.hist_file=:memory:", "--IPKernelApp.log_level=ERROR"]  # no start-up notices
HIDDEN_NOTE = ("Hidden tests run when you submit your work: they try more cases (other world sizes, uneven sizes, "
               "dtypes, bad arguments), so the grade can be lower than this.")
# Set in the checked notebook's kernel: a `%grade` cell in the notebook does not start another check.
RUNNING = "CS336_SELFCHECK"


@dataclass
class Score:
    """One test cell's outcome, here and in the course's gradebook (grading/gradebook.py)."""
    cell: str  # the test cell's grade_id, test_<exercise>[_<concern>]
    score: float
    max_score: float
    reason: str = ""  # why it failed, in one line (empty when it passed)


def table(rows: Sequence[Score]) -> list[str]:
    """One line per test: ok or --, its name, its points, and why it failed; then the total."""
    width = max((len(r.cell) for r in rows), default=0)
    lines = []
    for r in rows:
        mark = "ok" if r.score == r.max_score else "--"
        line = f"  {mark}  {r.cell.removeprefix('test_'):<{width}}  {r.score:g} / {r.max_score:g}"
        lines.append(f"{line}   {r.reason}" if r.reason else line)
    total, best = sum(r.score for r in rows), sum(r.max_score for r in rows)
    return [*lines, f"  total {total:g} / {best:g}"]


def error_reason(output: NotebookNode) -> str:
    """The one-line reason an error output gives: a failed test's own line, else `Name: message`."""
    reason = output.evalue if output.ename == "TestFailed" else f"{output.ename}: {output.evalue}".strip(": ")
    lines = printable(reason, keep_newlines=True).splitlines()
    return lines[0] if lines else ""


def test_names(cell: NotebookNode) -> list[str] | None:
    """The exercises a test cell tests, from its `%%test NAME ...` header; None for any other cell. This is what a
    test cell is, everywhere: the learner's kernel runs it as `%%test`, the grader in its own process (when its
    source is one of the master's), and nbgrader scores it (its `grade` flag gives the points)."""
    if cell.cell_type != "code":
        return None
    head = cell.source.split("\n", 1)[0].split()
    return head[1:] if head[:1] == ["%%test"] and len(head) > 1 else None


def is_test(cell: NotebookNode) -> bool:
    """A test cell (`test_names`)."""
    return test_names(cell) is not None


def graded_cells(nb: NotebookNode) -> list[NotebookNode]:
    """The graded test cells, in notebook order."""
    return [c for c in nb.cells if is_test(c) and c.metadata.get("nbgrader", {}).get("grade")]


def outcome(cell: NotebookNode) -> Score:
    """A test cell's result, read from its outputs after it ran: full points unless it shows an error."""
    meta = cell.metadata["nbgrader"]
    points = meta.get("points", 0)
    errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
    if errors:
        return Score(meta["grade_id"], 0, points, error_reason(errors[0]))
    if cell.get("execution_count") is None:
        return Score(meta["grade_id"], 0, points, "not run: the kernel stopped before this cell")
    return Score(meta["grade_id"], points, points)


def kernel_name(nb: NotebookNode) -> str:
    """The course's kernel where `make lab` registered it, else the notebook's own (a hosted Jupyter's)."""
    from jupyter_client.kernelspec import KernelSpecManager

    if KERNEL in KernelSpecManager().find_kernel_specs():
        return KERNEL
    return nb.metadata.get("kernelspec", {}).get("name", "python3")


def check(notebook: Path) -> list[Score]:
    """Run a copy of `notebook` top to bottom in a fresh kernel (its folder as the working folder; errors do not
    stop it) and return the outcome of each test cell. The file itself is not changed."""
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    nb = nbformat.read(notebook, as_version=4)
    if not graded_cells(nb):
        raise SystemExit(f"{notebook} has no test cells: is it one of the course's notebooks?")
    client = NotebookClient(nb, kernel_name=kernel_name(nb), timeout=CELL_TIMEOUT_S, allow_errors=True,
                            startup_timeout=KERNEL_START_TIMEOUT_S,
                            interrupt_on_timeout=True, extra_arguments=QUIET_KERNEL,
                            resources={"metadata": {"path": str(notebook.resolve().parent)}})
    try:
        client.execute(env={**os.environ, RUNNING: "1"})
    except DeadKernelError:
        pass  # the cells it did not reach say so
    return [outcome(cell) for cell in graded_cells(nb)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cs336_parallel.selfcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebook", type=Path)
    notebook = parser.parse_args(argv).notebook
    if not notebook.is_file():
        raise SystemExit(f"{notebook} does not exist")
    print(f"Running {notebook} with its visible tests (about as long as running it top to bottom)...", flush=True)
    print("\n".join(table(check(notebook))))
    print(HIDDEN_NOTE)


if __name__ == "__main__":
    main()

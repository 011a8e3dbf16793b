"""The class report, from the gradebook and the runs: what an instructor reads and hands back.

- `scores.csv`: one row per student, assignment and test cell (score, max_score), ready for a spreadsheet, and a
  `review` column: the submission's cells that reach into the kernel's machinery (`verdict.reaching`), listed for
  the instructor to look at and never scored;
- `reasons/<student>.txt`: for each student, one line per failed test with its one-line reason
  (`grading/verdict.py`), a line for each notebook a limit stopped early or that could not be run, ready to go
  into their feedback, and the review lines.
"""

from __future__ import annotations

import csv
from pathlib import Path

import nbformat
from nbgrader.api import MissingEntry

from grading import gradebook, runner, verdict
from grading.gradebook import Submission


def review(job: Submission) -> list[str]:
    """The cells of the submission that reach into the kernel (for the instructor; they cost no point)."""
    autograded = gradebook.autograded_notebook(Path(job.root), job.assignment, job.student)
    return verdict.reaching(nbformat.read(autograded, 4)) if autograded.exists() else []


def lines_for(job: Submission, results: Path) -> tuple[list[tuple], list[str]]:
    """(CSV rows, feedback lines) of one submission."""
    run = runner.load_run(results, job.assignment, job.student)
    notes = []
    if run is not None and run.error:
        notes.append(f"{job.assignment}: not graded: {run.error.splitlines()[0]}")
    elif run is not None and run.limit:
        notes.append(f"{job.assignment}: stopped early: {run.limit}; what did not finish scores 0")
    try:
        scores = gradebook.scores(job.assignment, job.student, Path(job.root))
    except MissingEntry:
        return [], notes or [f"{job.assignment}: not graded yet"]
    listed = review(job)
    rows = [(job.student, job.assignment, s.cell, f"{s.score:g}", f"{s.max_score:g}", " | ".join(listed))
            for s in scores]
    notes += [f"{job.assignment}  {s.cell.removeprefix('test_')}  {s.score:g} / {s.max_score:g}  {s.reason}"
              for s in scores if s.score < s.max_score]
    notes += [f"{job.assignment}  for review (not scored): {line}" for line in listed]
    return rows, notes


def write(names: list[str], root: Path, into: Path | None = None, results: Path | None = None) -> Path:
    """Write the report of `names` into `into` (default <course>/report); returns that folder."""
    into = into or root / "report"
    results = results or root / runner.RESULTS
    (into / "reasons").mkdir(parents=True, exist_ok=True)
    rows: list[tuple] = []
    notes: dict[str, list[str]] = {}
    for job in gradebook.submissions(names, root):
        job_rows, job_notes = lines_for(job, results)
        rows += job_rows
        notes.setdefault(job.student, []).extend(job_notes)
    with open(into / "scores.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "assignment", "test", "score", "max_score", "review"])
        writer.writerows(rows)
    for student, lines in notes.items():
        text = "\n".join(lines) if lines else "Every test passed."
        (into / "reasons" / f"{student}.txt").write_text(text + "\n")
    return into

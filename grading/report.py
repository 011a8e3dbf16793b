"""The class report, from the gradebook and the runs: what an instructor reads and hands back.

- `scores.csv`: one row per student, assignment and test cell (score, max_score), ready for a spreadsheet;
- `reasons/<student>.txt`: for each student, one line per failed test with its one-line reason
  (`grading/verdict.py`), and a line for each notebook a limit stopped early or that could not be run,
  ready to go into their feedback.
"""

from __future__ import annotations

import csv
from pathlib import Path

from nbgrader.api import MissingEntry

from grading import classroom, runner


def lines_for(job: runner.Job, results: Path) -> tuple[list[tuple], list[str]]:
    """(CSV rows, feedback lines) of one submission."""
    from grading import course

    run = runner.load_run(results, job.assignment, job.student)
    notes = []
    if run is not None and run.error:
        notes.append(f"{job.assignment}: not graded: {run.error.splitlines()[0]}")
    elif run is not None and run.limit:
        notes.append(f"{job.assignment}: stopped early: {run.limit}; what did not finish scores 0")
    try:
        scores = course.scores(job.assignment, job.student, Path(job.root))
    except MissingEntry:
        return [], notes or [f"{job.assignment}: not graded yet"]
    rows = [(job.student, job.assignment, s.cell, f"{s.score:g}", f"{s.max_score:g}") for s in scores]
    notes += [f"{job.assignment}  {s.cell.removeprefix('test_')}  {s.score:g} / {s.max_score:g}  {s.reason}"
              for s in scores if s.score < s.max_score]
    return rows, notes


def write(names: list[str], root: Path, into: Path | None = None, results: Path | None = None) -> Path:
    """Write the report of `names` into `into` (default <course>/report); returns that folder."""
    into = into or root / "report"
    results = results or root / classroom.RESULTS
    (into / "reasons").mkdir(parents=True, exist_ok=True)
    rows: list[tuple] = []
    notes: dict[str, list[str]] = {}
    for job in classroom.submissions(names, root):
        job_rows, job_notes = lines_for(job, results)
        rows += job_rows
        notes.setdefault(job.student, []).extend(job_notes)
    with open(into / "scores.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "assignment", "test", "score", "max_score"])
        writer.writerows(rows)
    for student, lines in notes.items():
        text = "\n".join(lines) if lines else "Every test passed."
        (into / "reasons" / f"{student}.txt").write_text(text + "\n")
    return into

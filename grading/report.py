"""The class report, from the gradebook and the runs: what an instructor reads, looks at and hands back.

- `scores.csv`: one row per student, assignment and test cell (score, max_score), ready for a spreadsheet, and a
  `review` column: the submission's cells that reach into the kernel's machinery (`verdict.reaching`), listed for
  the instructor to look at and never scored;
- `reasons/<student>.txt`: for each student, one line per failed test with its one-line reason
  (`grading/verdict.py`), a line for each notebook a limit stopped early or that could not be run, ready to go
  into their feedback, and the review lines;
- `tests.png`: per test, the share of the class that passed it (full points), hardest first, with its points;
- `reasons.md`: per test, in the same order, the five most common one-line reasons it failed, with their counts;
- `canvas.csv`: the total of each student and assignment in the columns Canvas's gradebook import reads (`canvas`).
"""

from __future__ import annotations

import csv
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbgrader.api import MissingEntry

from cs336_parallel.text import printable
from grading import gradebook, runner, verdict
from grading.gradebook import Score, Submission

MOST_COMMON = 5  # reasons per test in reasons.md
# Canvas's gradebook import: these columns first (it matches a row to a student by ID, SIS User ID or SIS Login
# ID), then one column per assignment; a second row that starts with "Points Possible" gives each one's points.
CANVAS_COLUMNS = ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]


@dataclass
class Graded:
    """One submission, and its scores (None when it has not been scored)."""
    job: Submission
    scores: list[Score] | None


@dataclass
class TestSummary:
    """One test cell across the class: how many passed it, and why the others did not."""
    __test__ = False  # not a pytest test class
    assignment: str
    test: str  # the grade_id, test_<exercise>[_<concern>]
    points: float
    passed: int = 0
    graded: int = 0
    reasons: Counter = field(default_factory=Counter)

    @property
    def share(self) -> float:
        return self.passed / self.graded if self.graded else 0.0

    @property
    def label(self) -> str:
        return f"{self.assignment} · {self.test.removeprefix('test_')} ({self.points:g} pt)"


def review(job: Submission) -> list[str]:
    """The cells of the submission that reach into the kernel (for the instructor; they cost no point)."""
    autograded = gradebook.autograded_notebook(Path(job.root), job.assignment, job.student)
    return verdict.reaching(nbformat.read(autograded, 4)) if autograded.exists() else []


def scores_of(job: Submission) -> list[Score] | None:
    try:
        return gradebook.scores(job.assignment, job.student, Path(job.root))
    except MissingEntry:
        return None


def lines_for(graded: Graded, results: Path) -> tuple[list[tuple], list[str]]:
    """(CSV rows, feedback lines) of one submission."""
    job = graded.job
    run = runner.load_execution(results, job.assignment, job.student)
    notes = []
    if run is not None and run.error:
        notes.append(f"{job.assignment}: not graded: {printable(run.error.splitlines()[0])}")
    elif run is not None and run.limit:
        notes.append(f"{job.assignment}: stopped early: {run.limit}; what did not finish scores 0")
    if graded.scores is None:
        return [], notes or [f"{job.assignment}: not graded yet"]
    listed = review(job)
    rows = [(job.student, job.assignment, s.cell, f"{s.score:g}", f"{s.max_score:g}", " | ".join(listed))
            for s in graded.scores]
    notes += [f"{job.assignment}  {s.cell.removeprefix('test_')}  {s.score:g} / {s.max_score:g}  {printable(s.reason)}"
              for s in graded.scores if s.score < s.max_score]
    notes += [f"{job.assignment}  for review (not scored): {line}" for line in listed]
    return rows, notes


# -- across the class -----------------------------------------------------------------------------------------------

def summarize(graded: list[Graded]) -> list[TestSummary]:
    """Every test cell of the scored submissions, hardest first (the smallest share passed; then notebook order)."""
    tests: dict[tuple[str, str], TestSummary] = {}
    for entry in graded:
        for s in entry.scores or []:
            summary = tests.setdefault((entry.job.assignment, s.cell), TestSummary(entry.job.assignment, s.cell,
                                                                                    s.max_score))
            summary.graded += 1
            if s.score == s.max_score:
                summary.passed += 1
            else:
                summary.reasons[s.reason or "no reason given"] += 1
    return sorted(tests.values(), key=lambda t: t.share)  # stable: notebook order among equals


def draw_tests(tests: list[TestSummary], path: Path) -> None:
    """tests.png: one bar per test, its share of the class that passed, hardest at the top, with its points."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure  # no pyplot: nothing global, no display needed

    fig = Figure(figsize=(9, 1.2 + 0.3 * len(tests)), layout="constrained")
    ax = fig.add_subplot()
    shares = [100 * t.share for t in tests]
    bars = ax.barh(range(len(tests)), shares, color=[colormaps["RdYlGn"](t.share * 0.8 + 0.1) for t in tests])
    ax.bar_label(bars, labels=[f" {t.passed}/{t.graded}" for t in tests], fontsize=8)
    ax.set_yticks(range(len(tests)), [t.label for t in tests], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 112)
    ax.set_xlabel("% of the class that passed (full points)")
    ax.set_title("Tests by the share of the class that passed, hardest first", fontsize=10)
    fig.savefig(path, dpi=120)


def markdown_text(text: str) -> str:
    """`text` as literal Markdown: printable characters only, and every character Markdown gives a meaning to
    escaped (a reason is the student's exception message: no link, heading or table cell may come of it)."""
    return re.sub(r"([\\`*_{}\[\]()#+\-.!|<>~])", r"\\\1", printable(text))


def reasons_markdown(tests: list[TestSummary]) -> str:
    """reasons.md: per test (hardest first), the most common reasons it failed and how many submissions gave each."""
    lines = ["# Why tests failed", "",
             f"Per test, hardest first (as in tests.png): the {MOST_COMMON} most common one-line reasons, and how "
             "many submissions failed with each.", ""]
    for t in tests:
        lines += [f"## {t.label}: {t.passed} of {t.graded} passed", ""]
        if t.reasons:
            lines += ["| submissions | reason |", "|---:|---|"]
            lines += [f"| {count} | {markdown_text(reason)} |" for reason, count in t.reasons.most_common(MOST_COMMON)]
            lines.append("")
    return "\n".join(lines)


def canvas(to: Path, root: Path, names: list[str] | None = None) -> Path:
    """Each student's total per assignment (of `names`; default all) in the columns of Canvas's gradebook import.
    The course knows a student only by their folder name (from `collect`): it goes in `SIS Login ID` (and
    `Student`), so name the folders by Canvas login for the import to match them. Returns `to`."""
    totals, possible = gradebook.totals(root, names)
    with open(to, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*CANVAS_COLUMNS, *possible])
        writer.writerow(["Points Possible", "", "", "", "", *(f"{p:g}" for p in possible.values())])
        for student, scores in sorted(totals.items()):
            writer.writerow([student, "", "", student, "",
                             *(f"{scores[a]:g}" if a in scores else "" for a in possible)])
    return to


def write(names: list[str], root: Path, into: Path | None = None, results: Path | None = None) -> Path:
    """Write the report of `names` into `into` (default <course>/report); returns that folder."""
    into = into or root / "report"
    results = results or root / runner.RESULTS
    (into / "reasons").mkdir(parents=True, exist_ok=True)
    graded = [Graded(job, scores_of(job)) for job in gradebook.submissions(names, root)]
    rows: list[tuple] = []
    notes: dict[str, list[str]] = {}
    for entry in graded:
        job_rows, job_notes = lines_for(entry, results)
        rows += job_rows
        notes.setdefault(entry.job.student, []).extend(job_notes)
    with open(into / "scores.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "assignment", "test", "score", "max_score", "review"])
        writer.writerows(rows)
    for student, lines in notes.items():
        text = "\n".join(lines) if lines else "Every test passed."
        (into / "reasons" / f"{student}.txt").write_text(text + "\n")
    tests = summarize(graded)
    if tests:
        draw_tests(tests, into / "tests.png")
    (into / "reasons.md").write_text(reasons_markdown(tests))
    canvas(into / "canvas.csv", root, names)
    return into

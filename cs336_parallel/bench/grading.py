"""Grading a class: 12 submissions of one notebook autograded one at a time, then with `--jobs 2`, in one run.

Both runs go through `grading/course.py autograde`, each submission in its sandbox, on copies of the same
course; half the submissions are the master solution and half the student version (nothing implemented).
Printed: the two times and their ratio, notebooks per core-hour, and what that makes for a class of 200
students with 9 notebooks on a 32-core machine (notebooks are independent, so throughput per core carries
over), and how busy the cores were: a notebook that keeps B of 2 cores busy alone leaves `--jobs 2` a ratio
of at best about B/2. Target (2 CPU cores): `--jobs 2` takes at most 0.6x the serial time, identical scores.
The grading code lives in the repository's grading/ (an instructor's tool, not part of the package).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ASSIGNMENT = "01_collectives"
SUBMISSIONS = 12
CLASS, NOTEBOOKS, CORES = 200, 9, 32  # the projection


def _course(root: Path, name: str, submission: Path | None) -> None:
    """A course copy with SUBMISSIONS submissions of `name` (the given notebook, or master and student version)."""
    from grading import course

    shutil.copytree(course.COURSE / "source" / name, root / "source" / name)
    versions = [submission] if submission else [course.COURSE / "source" / name / f"{name}.ipynb",
                                                  REPO / "notebooks" / f"{name}.ipynb"]
    for i in range(SUBMISSIONS):
        folder = root / "submitted" / f"student{i:02d}" / name
        folder.mkdir(parents=True)
        shutil.copy(versions[i % len(versions)], folder / f"{name}.ipynb")


def _busy_seconds() -> float:
    """CPU seconds the whole machine has been busy since boot (Linux; 0 elsewhere)."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def _grade(root: Path, name: str, jobs: int) -> tuple[float, float, dict]:
    """Seconds, busy cores on average, and the scores of grading the course at `root` with `jobs`."""
    from grading import course

    course.prepare([name], root)  # not timed: both runs start from a gradebook that knows the assignment
    t0, busy0 = time.perf_counter(), _busy_seconds()
    course.autograde([name], root, jobs=jobs)
    seconds = time.perf_counter() - t0
    busy = (_busy_seconds() - busy0) / seconds
    scores = {s: [(r.cell, r.score) for r in course.scores(name, s, root)]
              for s in sorted(p.name for p in (root / "submitted").iterdir())}
    return seconds, busy, scores


def main(args=None) -> None:
    sys.path.insert(0, str(REPO))
    from grading import classroom, sandbox

    submission = Path(args.notebook).resolve() if args and args.notebook else None
    name = submission.stem if submission else ASSIGNMENT
    cores = classroom.cores()
    isolation = "bubblewrap" if sandbox.problem() is None else f"none ({sandbox.problem()})"
    print(f"{SUBMISSIONS} submissions of {name} on {cores} cores, isolation: {isolation}")
    times, busy, scores = {}, {}, {}
    for jobs in (1, 2):
        with tempfile.TemporaryDirectory(prefix=f"cs336-bench-grading-{jobs}-") as tmp:
            _course(Path(tmp), name, submission)
            times[jobs], busy[jobs], scores[jobs] = _grade(Path(tmp), name, jobs)
        print(f"  --jobs {jobs}: {times[jobs]:6.1f} s  ({times[jobs] / SUBMISSIONS:.1f} s per notebook, "
              f"{busy[jobs]:.2f} cores busy on average)", flush=True)
    ratio = times[2] / times[1]
    same = scores[1] == scores[2]
    per_core_hour = SUBMISSIONS / (times[2] * min(2, cores) / 3600)
    hours = CLASS * NOTEBOOKS / (per_core_hour * CORES)
    print(f"  ratio --jobs 2 / serial: {ratio:.2f}  (target <= 0.60: {'met' if ratio <= 0.6 else 'NOT met'}; "
          f"one at a time keeps {busy[1]:.2f} cores busy, so on {min(2, cores)} cores the ratio cannot go much below "
          f"{busy[1] / min(2, cores):.2f})")
    print(f"  identical scores: {'yes' if same else 'NO'}")
    print(f"  throughput with --jobs 2: {per_core_hour:.0f} notebooks per core-hour "
          f"(serial: {SUBMISSIONS / (times[1] * cores / 3600):.0f} per core-hour of this machine)")
    print(f"  projection: {CLASS} students x {NOTEBOOKS} notebooks on {CORES} cores: {hours * 60:.0f} min "
          f"(one at a time on this machine: {CLASS * NOTEBOOKS * times[1] / SUBMISSIONS / 3600:.1f} h)")
    if not same:
        raise SystemExit("the scores differ between the serial and the parallel run")

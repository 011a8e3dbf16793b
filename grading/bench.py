"""`python -m grading.bench [--baseline CHECKOUT]`: what grading a class costs, measured side by side in one run.

12 submissions of 01_collectives (half the master, half the student version) are autograded one at a time, then
with `--jobs 2`, each in its sandbox, on copies of the same course. Printed: both times and their ratio, how busy
the cores were (a notebook that keeps B of 2 cores busy alone leaves `--jobs 2` a ratio of at best about B/2),
notebooks per core-hour and what that makes for a class of 200 students with 9 notebooks on 32 cores.

The trust boundary (tests in the grader's process, grading/grader.py) must cost at most 1.5x the design before
it, where the tests ran in the student's kernel. `--baseline CHECKOUT` times that design in the same run: a
checkout of commit 85373ed with its own `.venv` (`git worktree add ../base 85373ed && make -C ../base
.venv/.installed-test`). Without it, the ratio is against the figure recorded below.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from grading import classroom, gradebook, sandbox

ASSIGNMENT = "01_collectives"
SUBMISSIONS = 12
CLASS, NOTEBOOKS, CORES = 200, 9, 32  # the projection
# The design before the trust boundary (commit 85373ed), the same 12 submissions one at a time on this 2-core
# machine, 2026-11-25: 98.1 s, back to back with the boundary's 96.4 s.
RECORDED_BEFORE_S = 98.1

# Grades the same 12 submissions one at a time in another checkout (its own grading API: `course` before the
# boundary, `classroom` after), printing the seconds.
_SERIAL = """
import shutil, sys, tempfile, time
from pathlib import Path
repo, name, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
sys.path.insert(0, str(repo))
try:
    from grading import classroom, gradebook
    course_dir, prepare = gradebook.COURSE, gradebook.prepare
    def autograde(root): classroom.autograde([name], root, jobs=1)
except ImportError:
    from grading import course
    course_dir, prepare = course.COURSE, course.prepare
    def autograde(root): course.autograde([name], root, jobs=1)
with tempfile.TemporaryDirectory(prefix="cs336-bench-baseline-") as tmp:
    root = Path(tmp)
    shutil.copytree(course_dir / "source" / name, root / "source" / name)
    versions = [course_dir / "source" / name / f"{name}.ipynb", repo / "notebooks" / f"{name}.ipynb"]
    for i in range(n):
        folder = root / "submitted" / f"student{i:02d}" / name
        folder.mkdir(parents=True)
        shutil.copy(versions[i % 2], folder / f"{name}.ipynb")
    prepare([name], root)
    start = time.perf_counter()
    autograde(root)
    print(time.perf_counter() - start)
"""


def _course(root: Path) -> None:
    """A course copy with SUBMISSIONS submissions: the master and the student version, alternating."""
    shutil.copytree(gradebook.COURSE / "source" / ASSIGNMENT, root / "source" / ASSIGNMENT)
    versions = [gradebook.COURSE / "source" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb",
                gradebook.REPO / "notebooks" / f"{ASSIGNMENT}.ipynb"]
    for i in range(SUBMISSIONS):
        folder = root / "submitted" / f"student{i:02d}" / ASSIGNMENT
        folder.mkdir(parents=True)
        shutil.copy(versions[i % len(versions)], folder / f"{ASSIGNMENT}.ipynb")


def _busy_seconds() -> float:
    """CPU seconds the whole machine has been busy since boot (Linux; 0 elsewhere)."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def _grade(jobs: int) -> tuple[float, float, dict]:
    """Seconds, busy cores on average, and the scores of grading a fresh copy with `jobs`."""
    with tempfile.TemporaryDirectory(prefix=f"cs336-bench-grading-{jobs}-") as tmp:
        root = Path(tmp)
        _course(root)
        gradebook.prepare([ASSIGNMENT], root)  # not timed: both runs start from a gradebook that knows the cells
        start, busy = time.perf_counter(), _busy_seconds()
        classroom.autograde([ASSIGNMENT], root, jobs=jobs)
        seconds = time.perf_counter() - start
        scores = {s: [(r.cell, r.score) for r in gradebook.scores(ASSIGNMENT, s, root)]
                  for s in sorted(p.name for p in (root / "submitted").iterdir())}
    return seconds, (_busy_seconds() - busy) / seconds, scores


def _baseline(checkout: Path) -> float:
    """Seconds the checkout's design takes for the same submissions, one at a time (in its own environment)."""
    python = checkout / ".venv" / "bin" / "python"
    done = subprocess.run([str(python), "-c", _SERIAL, str(checkout), ASSIGNMENT, str(SUBMISSIONS)], cwd=checkout,
                          capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m grading.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="a checkout of the design before the trust boundary, with "
                                                      "its own .venv, timed in the same run")
    args = parser.parse_args(argv)
    cores = classroom.cores()
    problem = sandbox.unavailable()
    print(f"{SUBMISSIONS} submissions of {ASSIGNMENT} on {cores} cores, isolation: "
          f"{'bubblewrap' if problem is None else f'none ({problem})'}")
    times, busy, scores = {}, {}, {}
    for jobs in (1, 2):
        times[jobs], busy[jobs], scores[jobs] = _grade(jobs)
        print(f"  --jobs {jobs}: {times[jobs]:6.1f} s  ({times[jobs] / SUBMISSIONS:.1f} s per notebook, "
              f"{busy[jobs]:.2f} cores busy on average)", flush=True)
    if args.baseline:
        before, source = _baseline(args.baseline.resolve()), f"{args.baseline}, measured in this run"
    else:
        before, source = RECORDED_BEFORE_S, "recorded on 2026-11-25 (commit 85373ed)"
    ratio = times[1] / before
    print(f"  the design before the boundary, one at a time: {before:.1f} s ({source})")
    print(f"  ratio boundary / before: {ratio:.2f}  (target <= 1.5: {'met' if ratio <= 1.5 else 'NOT met'})")
    parallel = times[2] / times[1]
    print(f"  ratio --jobs 2 / one at a time: {parallel:.2f}  (one at a time keeps {busy[1]:.2f} cores busy, so on "
          f"{min(2, cores)} cores it cannot go much below {busy[1] / min(2, cores):.2f})")
    same = scores[1] == scores[2]
    per_core_hour = SUBMISSIONS / (times[2] * min(2, cores) / 3600)
    print(f"  identical scores: {'yes' if same else 'NO'}")
    print(f"  throughput with --jobs 2: {per_core_hour:.0f} notebooks per core-hour; {CLASS} students x {NOTEBOOKS} "
          f"notebooks on {CORES} cores: {CLASS * NOTEBOOKS / (per_core_hour * CORES) * 60:.0f} min")
    if not same:
        sys.exit("the scores differ between the serial and the parallel run")


if __name__ == "__main__":
    main()

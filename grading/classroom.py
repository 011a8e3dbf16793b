"""Grading a class: every submission run in a sandbox of its own, N at a time, scored by the grader alone.

Two stages, so that only the instructor's process writes the gradebook:
1. **execute** (`grading/runner.py`): a submission's notebook runs in a sandbox under limits, its test cells in
   the grader's process (grading/grader.py); the executed notebook and run.json land in
   <course>/executed/<assignment>/<student>/. N run at once, each driven by a thread of the grader (the kernels
   and ranks are the sandboxes' processes). On Slurm, each task of a job array executes its share
   (`execute_shard`) into the same folder, on a shared file system.
2. **score** (`score`): nbgrader's autograde, in the grader's process: it takes the executed notebook in place of
   running it (`verdict.ExecutedNotebook`), scores each test cell by the grader's verdict (`verdict.SaveVerdicts`)
   and writes the gradebook.
A result is reused while its run.json has the same key (the master and the submitted files): a run that was
interrupted resumes where it stopped; `students=` or `force=` runs submissions again.
"""

from __future__ import annotations

import compileall
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from functools import cache
from pathlib import Path

from traitlets.config import Config

import cs336_parallel
from grading import cgroup, gradebook, report, runner, sandbox
from grading.gradebook import Submission, submissions
from grading.runner import Execution, Limits

# `%cluster start -n 4`, `checks.run(4, ...)`, `Cluster(4)`: the world sizes a notebook starts.
# What the notebooks may not read where they run as the unprivileged user, beside the class's folder: the masters,
# and in the course's own repository the tests' fixtures (answers, correct and wrong).
PRIVATE = (gradebook.COURSE / "source", gradebook.REPO / "tests")
WORLD_SIZE = re.compile(r"(?:%cluster start -n |checks\.run\(|Cluster\()\s*(\d+)")


class Interrupted(Exception):
    """Grading was stopped (Ctrl-C); what finished is kept, and the same command resumes."""


# -- how many at once --------------------------------------------------------------

@cache
def world_size(master: Path) -> int:
    """The most ranks the notebook starts at once (its largest `%cluster start -n`, `checks.run(N, ...)`)."""
    sizes = [int(n) for n in WORLD_SIZE.findall(master.read_text())] if master.exists() else []
    return max(sizes, default=4)


def cores() -> int:
    """The cores this process may use (under Slurm, those of its allocation)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def default_jobs(names: Iterable[str], root: Path) -> int:
    """As many notebooks at once as the cores allow, given the largest world size W among them: a notebook's
    ranks mostly take turns (a collective waits for all of them), so it keeps about W/2 cores busy on average
    (measured: 1.4 busy cores for a notebook of world size 4 on 2 cores); 2 * cores // W notebooks fill the
    machine without making a test wait for a core for long. At least 1."""
    widest = max((world_size(root / "source" / n / f"{n}.ipynb") for n in names), default=4)
    return max(1, 2 * cores() // widest)


# -- stage 1: execute ---------------------------------------------------------------------------------------

def executed(job: Submission, results: Path) -> Execution | None:
    """The finished run of this version of the submission, if there is one."""
    run = runner.load_execution(results, job.assignment, job.student)
    return run if run is not None and not run.error and run.key == job.key() else None


def gradebook_snapshot(root: Path, into: Path) -> str:
    """A copy of the gradebook for the runs to read the course's cells from (the grader writes the original)."""
    if not (root / "gradebook.db").exists():
        raise SystemExit(f"{root / 'gradebook.db'} does not exist: run `python -m grading prepare "
                         "ASSIGNMENT` first (nbgrader learns the assignment's cells)")
    shutil.copy(root / "gradebook.db", into / "gradebook.db")
    return f"sqlite:///{into / 'gradebook.db'}"


def check_sandbox(use_sandbox: bool) -> None:
    """Stop with a clear message where no sandbox can run, unless grading without one was asked for."""
    if use_sandbox and (problem := sandbox.unavailable()):
        raise SystemExit(f"Submissions cannot be isolated here: {problem}.\nInstall bubblewrap (`make sandbox`), "
                         "or grade without isolation, at your own risk: `python -m grading autograde --no-sandbox` "
                         "(classroom.autograde(..., use_sandbox=False)).")


def grading_user(use_sandbox: bool, root: Path) -> str | None:
    """Without a sandbox, root runs every notebook as the unprivileged user `sandbox.USER`, who may read neither
    the class (`root`: the gradebook, the submissions) nor the masters (`PRIVATE`): that user, or None (a sandbox;
    or a grader who is not root, and so has no privilege to drop). Stops with what to do where that is not
    possible."""
    if use_sandbox or os.geteuid() != 0:
        return None
    if problem := sandbox.user_unavailable():
        raise SystemExit(f"Without a sandbox, root grades only as an unprivileged user, and {problem}.")
    for private in (root, *PRIVATE):
        if exposed := sandbox.open_to_others(private):
            raise SystemExit(f"Without a sandbox, the notebooks run as {sandbox.USER}, who could read {exposed}: "
                             f"chmod o-rwx {exposed} first.")
    return sandbox.USER


@contextmanager
def ctrl_c(pressed: threading.Event | None = None) -> Iterator[threading.Event]:
    """While grading, Ctrl-C sets `pressed` (a new event if None) instead of raising wherever the grader happens
    to be (nbgrader's API turns a KeyboardInterrupt into an error of the submission it was scoring); the
    grader stops at its next check. Outside the main thread, Ctrl-C raises as usual."""
    pressed = pressed or threading.Event()
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.set())
    except ValueError:  # not the main thread
        yield pressed
        return
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def execute_class(jobs: list[Submission], root: Path, config: Config, *, parallel: int, limits: Limits,
                  use_sandbox: bool,
            results: Path, done: Callable[[Submission, Execution], None] = lambda job, run: None,
            pressed: threading.Event | None = None) -> None:
    """Run `jobs`, `parallel` at a time; `done(job, run)` is called in this thread as each one finishes.
    Ctrl-C (or `pressed` set) stops every running notebook, keeps nothing of theirs and raises `Interrupted`."""
    if not jobs:
        return
    check_sandbox(use_sandbox)
    user = grading_user(use_sandbox, root)
    if user:
        parallel = 1  # every process of the user is ended after each notebook
    if limits.memory_mb and (why := cgroup.unavailable()):
        print(f"Warning: {why}", file=sys.stderr, flush=True)
    # The package is read-only in the sandbox: compile it here, once, rather than in every kernel and rank.
    compileall.compile_dir(Path(cs336_parallel.__file__).parent, quiet=1)
    stop = threading.Event()
    with ctrl_c(pressed) as pressed, tempfile.TemporaryDirectory(prefix="cs336-grading-") as tmp:
        db_url = gradebook_snapshot(root, Path(tmp))
        pool = ThreadPoolExecutor(max_workers=max(1, min(parallel, len(jobs))), thread_name_prefix="grade")
        pending = {pool.submit(runner.execute_submission, job, results, config, db_url, limits, use_sandbox, stop,
                               user): job for job in jobs}
        try:
            while pending and not pressed.is_set():
                finished, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                for future in finished:
                    job = pending.pop(future)
                    done(job, future.result())
            if pending:
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            stop.set()
            runner.interrupt_all()
            pool.shutdown(wait=True, cancel_futures=True)
            raise Interrupted(f"stopped: {len(jobs) - len(pending)} of {len(jobs)} notebooks were executed; "
                              "run the same command again to go on from there") from None
        finally:
            pool.shutdown(wait=True)


def execute_shard(names: list[str], root: Path, config: Config, *, shard: int, shards: int, parallel: int | None,
                  limits: Limits, use_sandbox: bool, results: Path, force: bool = False) -> list[Execution]:
    """One task of a Slurm job array: execute submissions shard, shard + shards, ... of the sorted class
    (those without a finished result), into `results`. Writes no gradebook: `merge` scores them."""
    if not 0 <= shard < shards:
        raise SystemExit(f"--shard must be in 0..{shards - 1}, got {shard}")
    mine = submissions(names, root)[shard::shards]
    todo = [job for job in mine if force or executed(job, results) is None]
    runs: list[Execution] = []
    print(f"shard {shard}/{shards}: {len(mine)} submissions, {len(todo)} to execute", flush=True)

    def finished(job: Submission, run: Execution) -> None:
        runs.append(run)
        status = run.error or run.limit or "ok"
        print(f"shard {shard}: {job.student}/{job.assignment} in {run.seconds:g} s: {status}", flush=True)

    execute_class(todo, root, config, parallel=parallel or default_jobs(names, root), limits=limits,
                  use_sandbox=use_sandbox, results=results, done=finished)
    return runs


# -- stage 2: score -----------------------------------------------------------------------------------------

def scoring_config(results: Path) -> Config:
    """What scoring adds to the course's configuration: where the executed notebooks are (`ExecutedNotebook` takes
    them in place of executing), and no second sanitizing (the runner restored the course's cells before it ran)."""
    return Config({"Autograde": {"sanitize_preprocessors": []}, "ExecutedNotebook": {"results": str(results)}})


def is_scored(job: Submission, results: Path) -> bool:
    """Whether this version of the submission's run is already in the gradebook (its autograded notebook written)."""
    marker = runner.result_dir(results, job.assignment, job.student) / "scored"
    autograded = gradebook.autograded_notebook(Path(job.root), job.assignment, job.student)
    run = runner.load_execution(results, job.assignment, job.student)
    return run is not None and marker.exists() and marker.read_text() == run.key and autograded.exists()


def score(job: Submission, results: Path, grader) -> None:
    """nbgrader's autograde of one executed submission, in this process: the only writer of the gradebook."""
    gradebook.check(grader.autograde(job.assignment, job.student), f"score {job.student}/{job.assignment}")
    run = runner.load_execution(results, job.assignment, job.student)
    (runner.result_dir(results, job.assignment, job.student) / "scored").write_text(run.key)


# -- the whole class ------------------------------------------------------------------------------------------

def sandbox_wanted(use_sandbox: bool | None) -> bool:
    """None: as CS336_GRADING_SANDBOX says: `required` (the default), `auto` (where bwrap runs; the test
    suite's choice, so that it also passes where no sandbox can run) or `off`."""
    if use_sandbox is not None:
        return use_sandbox
    mode = os.environ.get("CS336_GRADING_SANDBOX", "required")
    return mode == "required" or (mode == "auto" and sandbox.unavailable() is None)


def autograde(names: list[str] | None = None, root: Path = gradebook.COURSE, *, jobs: int | None = None,
              students: Iterable[str] | None = None, force: bool = False, limits: Limits | None = None,
              use_sandbox: bool | None = None, results: Path | None = None) -> list[Execution]:
    """Grade every submission of `names` (all assignments by default), each in a sandbox of its own: execute what
    has no finished result (all of `students`' if given, everything with `force`), `jobs` at a time (default: what
    the cores allow), with a progress bar; score each in this process as it finishes; then write the class report.

    Every submission of every named assignment goes into one pool: `autograde(names, root, jobs=2)` grades the
    whole list in parallel. Returns the runs executed now. A submission that could not be run is reported, and
    the others are still graded. `use_sandbox=False` grades without isolation (None: as CS336_GRADING_SANDBOX
    says; `required` by default)."""
    from tqdm.auto import tqdm

    names = names or gradebook.assignments(root)
    results = results or root / runner.RESULTS
    grader = gradebook.prepare(names, root)
    everyone = submissions(names, root)
    if students and (unknown := set(students) - {job.student for job in everyone}):
        raise SystemExit(f"no submission of {', '.join(sorted(names))} from {', '.join(sorted(unknown))}")
    again = set(students or ())
    to_execute = [j for j in everyone if force or j.student in again or executed(j, results) is None]
    to_score = [j for j in everyone if j not in to_execute and not is_scored(j, results)]
    scorer = gradebook.api(root, scoring_config(results))
    problems: list[str] = []
    runs: list[Execution] = []
    bar = tqdm(total=len(everyone), initial=len(everyone) - len(to_execute) - len(to_score), desc="autograding",
               unit="notebook")

    def score_one(job: Submission) -> None:
        try:
            score(job, results, scorer)
        except Exception as e:  # noqa: BLE001 - reported below; the class goes on
            problems.append(f"{job.student}/{job.assignment}: {e}")
        bar.update()

    def done(job: Submission, run: Execution | None) -> None:
        if run is None:
            return
        runs.append(run)
        if run.error:
            problems.append(f"{job.student}/{job.assignment} could not be run: {run.error}")
            bar.update()
        else:
            score_one(job)

    try:
        with ctrl_c() as pressed:
            for job in to_score:
                if pressed.is_set():
                    raise Interrupted("stopped while scoring: run the same command again to go on from there")
                score_one(job)
            execute_class(to_execute, root, grader.config, parallel=jobs or default_jobs(names, root),
                    limits=limits or Limits(), use_sandbox=sandbox_wanted(use_sandbox), results=results, done=done,
                    pressed=pressed)
    finally:
        bar.close()
    report.write(names, root, results=results)
    if problems:
        raise RuntimeError("some submissions were not graded:\n" + "\n".join(problems))
    return runs


def merge(names: list[str], root: Path, results: Path | None = None) -> int:
    """Score every executed submission of `names` not scored yet (the shards' results) into the gradebook, then
    write the class report. Returns how many were scored; lists the submissions that have no result yet."""
    from tqdm.auto import tqdm

    results = results or root / runner.RESULTS
    gradebook.prepare(names, root)
    everyone = submissions(names, root)
    ran = [(j, executed(j, results) is not None) for j in everyone]
    missing = [f"{j.student}/{j.assignment}" for j, ok in ran if not ok]
    todo = [j for j, ok in ran if ok and not is_scored(j, results)]
    scorer = gradebook.api(root, scoring_config(results))
    for job in tqdm(todo, desc="scoring", unit="notebook"):
        score(job, results, scorer)
    report.write(names, root, results=results)
    if missing:
        print(f"{len(missing)} submissions have no result yet (a shard did not finish?): {', '.join(missing[:20])}")
    return len(todo)


def grade_alone(notebook: Path, name: str, *, use_sandbox: bool) -> tuple[list[gradebook.Score], Execution | None]:
    """Grade one notebook as assignment `name`, in a throwaway copy of the course, as a class is graded (the tests
    in this process, the kernel isolated when `use_sandbox`): one score per test, and the run (its limit, if one
    stopped it). Raises RuntimeError when the notebook could not be run at all."""
    with tempfile.TemporaryDirectory(prefix="cs336-alone-") as tmp:
        root = Path(tmp)
        shutil.copytree(gradebook.COURSE / "source" / name, root / "source" / name)
        target = root / "submitted" / "me" / name
        target.mkdir(parents=True)
        shutil.copy(notebook, target / f"{name}.ipynb")
        autograde([name], root, use_sandbox=use_sandbox)
        return gradebook.scores(name, "me", root), runner.load_execution(root / runner.RESULTS, name, "me")


def selfgrade(notebook: Path) -> list[gradebook.Score]:
    """Grade a learner's own notebook against the hidden tests (`grade_alone`), isolated where a sandbox runs."""
    name = notebook.stem
    if name not in gradebook.assignments():
        raise SystemExit(f"{notebook} is not one of the course's notebooks ({', '.join(gradebook.assignments())})")
    print(f"Running {notebook} with the hidden tests (about as long as running it top to bottom)...")
    return grade_alone(notebook, name, use_sandbox=sandbox.unavailable() is None)[0]

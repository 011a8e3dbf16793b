"""Grading a class: each submission in a sandbox, under limits, N at a time, on one machine or many.

A mixed class of 00_setup (tests/fixtures/attacks.py: a correct answer, a blank one, four attacks on the
grader, two notebooks over a limit) is graded one at a time and with two at once; the scores must agree, the
attacks must change nothing outside their sandbox and leave no process, and the limits must cost only what
did not finish. The same attacks in a plain kernel show that they are real; graded by root without a sandbox,
they run as an unprivileged user, and fail as they do in one. The Slurm path runs its shards
as separate processes, then merges them into the gradebook.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

from common import ROOT, wait_until
from fixtures import attacks
from grading import cgroup, classroom, gradebook, runner

NAME = attacks.NAME
LIMITS = runner.Limits(wall_s=180, memory_mb=2048, output_mb=5)
# Where no memory cgroup can be written (not root, nothing delegated), nothing would stop the memory hog.
MEMORY_LIMITED = cgroup.unavailable() is None
CLASS = [s for s in attacks.STUDENTS if s != "meg_memory" or MEMORY_LIMITED]
# `sandbox`: skipped, saying why, where no sandbox runs (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.sandbox]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def left_behind() -> list[str]:
    """Processes on this machine that an attack started (their command line carries the marker)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if attacks.MARKER.encode() in cmdline and int(pid) != os.getpid():
            found.append(pid)
    return found


def kill_left_behind() -> None:
    for pid in left_behind():
        try:
            os.kill(int(pid), 9)
        except OSError:
            pass


def make_class(root: Path, students: list[str] = CLASS) -> Path:
    """A course with the mixed class (or some of it) submitted; a config copy an attack may reach."""
    shutil.copytree(gradebook.COURSE / "source" / NAME, root / "source" / NAME)
    shutil.copy(gradebook.COURSE / "nbgrader_config.py", root / "nbgrader_config.py")
    master = nbformat.read(root / "source" / NAME / f"{NAME}.ipynb", 4)
    for student, nb in attacks.submissions(master, root, gradebook.COURSE).items():
        if student in students:
            (root / "submitted" / student / NAME).mkdir(parents=True)
            nbformat.write(nb, root / "submitted" / student / NAME / f"{NAME}.ipynb")
    return root


@dataclass
class Graded:
    root: Path
    scores: dict[str, list]
    runs: list
    before: dict[str, str]  # file -> digest, taken before grading
    left: list[str]  # processes of attacks alive right after grading

    def total(self, student: str) -> float:
        return sum(s.score for s in self.scores[student])

    def output(self, student: str) -> str:
        nb = nbformat.read(self.root / "autograded" / student / NAME / f"{NAME}.ipynb", 4)
        return "\n".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))


def attacks_acted(root: Path, before: dict[str, str]) -> bool:
    """Whether the processes the attacks leave behind have done what they came for: mallory's scores raised in
    the gradebook, every other submission overwritten (for those of the two in the class)."""
    students = {p.name for p in (root / "submitted").iterdir()}
    others = [path for path in before if "/submitted/" in path and "/oscar_others/" not in path]
    return ("mallory_gradebook" not in students
            or any(s.score > 0 for s in gradebook.scores(NAME, "mallory_gradebook", root))) and (
        "oscar_others" not in students or all(digest(Path(path)) != before[path] for path in others))


def grade(root: Path, limits: runner.Limits = LIMITS, **options) -> Graded:
    watched = [gradebook.COURSE / "nbgrader_config.py", root / "nbgrader_config.py",
               *sorted((root / "submitted").rglob("*.ipynb"))]
    before = {str(p): digest(p) for p in watched}
    try:
        runs = classroom.autograde([NAME], root, limits=limits, **options)
        left = left_behind()
        if left:  # let them act (without a sandbox they must be seen to), then read the scores
            with contextlib.suppress(AssertionError):  # whether they did is for the tests to say
                wait_until(lambda: attacks_acted(root, before), "the attacks' processes to act", interval=0.2)
        students = sorted(p.name for p in (root / "submitted").iterdir())
        return Graded(root, {s: gradebook.scores(NAME, s, root) for s in students}, runs, before, left)
    finally:
        kill_left_behind()


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory) -> Graded:
    return grade(make_class(tmp_path_factory.mktemp("serial")), jobs=1, use_sandbox=True)


@pytest.fixture(scope="module")
def two_at_once(tmp_path_factory) -> Graded:
    return grade(make_class(tmp_path_factory.mktemp("parallel")), jobs=2, use_sandbox=True)


# -- the same scores, whatever the order -------------------------------------------------------------------

def test_a_mixed_class_gets_the_same_scores_two_at_once_as_one_at_a_time(one_at_a_time, two_at_once):
    assert len(two_at_once.runs) == len(two_at_once.scores) == len(CLASS)
    table = {s: [(r.cell, r.score) for r in rows] for s, rows in two_at_once.scores.items()}
    assert table == {s: [(r.cell, r.score) for r in rows] for s, rows in one_at_a_time.scores.items()}
    assert two_at_once.total("ada_correct") == 2.5 and two_at_once.total("bo_blank") == 0


# -- the attacks -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("graded", ["one_at_a_time", "two_at_once"])
def test_no_attack_leaves_a_process_behind(graded, request):
    assert request.getfixturevalue(graded).left == []


def test_a_submission_cannot_read_the_sources_or_reach_the_network(two_at_once):
    assert two_at_once.total("eve_sources") == 0
    out = two_at_once.output("eve_sources")
    assert "ATTACK sources: 0 master notebooks found" in out, out
    assert "ATTACK network: [Errno 101] Network is unreachable" in out, out


def test_a_process_left_behind_cannot_write_the_gradebook(two_at_once):
    assert "ATTACK gradebook: a process was left behind" in two_at_once.output("mallory_gradebook")
    rescored = gradebook.scores(NAME, "mallory_gradebook", two_at_once.root)  # after the process would have acted
    assert all(s.score == 0 for s in rescored), rescored


def test_a_submission_cannot_touch_another_submission(two_at_once):
    assert "ATTACK others: 0 submissions found" in two_at_once.output("oscar_others")
    for path, before in two_at_once.before.items():
        if "/submitted/" in path:
            assert digest(Path(path)) == before, f"{path} was changed"
    assert two_at_once.total("ada_correct") == 2.5


def test_a_submission_cannot_touch_the_config(two_at_once):
    out = two_at_once.output("trudy_config")
    assert "appended" not in out and out.count("ATTACK config: [Errno") == 3, out  # not there, or read-only
    for path, before in two_at_once.before.items():
        if path.endswith("nbgrader_config.py"):
            assert digest(Path(path)) == before, f"{path} was changed"


@pytest.fixture(scope="module")
def unsandboxed(tmp_path_factory, unprivileged_user) -> Graded:
    """The attacks graded without a sandbox, by root (in a throwaway course: the real config is not a target), and
    without a memory limit (its cgroup would end the processes left behind): the notebooks run as the
    unprivileged user."""
    root = make_class(tmp_path_factory.mktemp("unsandboxed"),
                      ["ada_correct", "eve_sources", "mallory_gradebook", "oscar_others"])
    with closed_to_others(classroom.PRIVATE):  # as an instructor would close them: the grader refuses otherwise
        return grade(root, jobs=1, use_sandbox=False, limits=runner.Limits(wall_s=180, memory_mb=0))


@contextlib.contextmanager
def closed_to_others(paths) -> Iterator[None]:
    """For the duration, users other than the owner and group may not enter or read `paths`."""
    modes = {path: path.stat().st_mode for path in paths}
    try:
        for path, mode in modes.items():
            path.chmod(mode & ~0o007)
        yield
    finally:
        for path, mode in modes.items():
            path.chmod(mode)


def test_without_a_sandbox_root_refuses_to_grade_where_the_user_could_read_the_masters(tmp_path, unprivileged_user):
    """The unprivileged user must not reach the masters (nor the tests' answers): root says what to close first."""
    tmp_path.chmod(0o700)
    with closed_to_others(classroom.PRIVATE[1:]), pytest.raises(SystemExit, match="chmod o-rwx .*grading/source"):
        classroom.grading_user(False, tmp_path)
    with closed_to_others(classroom.PRIVATE):
        assert classroom.grading_user(False, tmp_path) == unprivileged_user


def test_the_attacks_are_real(tmp_path):
    """The same notebooks, run in a plain kernel with the grader's rights, do what they try."""
    from nbclient import NotebookClient

    root = make_class(tmp_path, ["ada_correct", "eve_sources", "mallory_gradebook", "oscar_others"])
    ada = root / "submitted" / "ada_correct" / NAME / f"{NAME}.ipynb"
    before = digest(ada)
    outputs = {}
    try:
        for student in ("eve_sources", "mallory_gradebook", "oscar_others"):
            folder = root / "submitted" / student / NAME
            nb = nbformat.read(folder / f"{NAME}.ipynb", 4)
            NotebookClient(nb, timeout=120, allow_errors=True, resources={"metadata": {"path": str(folder)}}).execute()
            outputs[student] = "\n".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
        assert "the tests now grade the master's shard_range" in outputs["eve_sources"], outputs["eve_sources"]
        assert left_behind(), "the attacks left no process behind"
        wait_until(lambda: digest(ada) != before, "another student's submission to be overwritten", interval=0.2)
    finally:
        kill_left_behind()


def test_without_a_sandbox_root_grades_as_a_user_who_can_do_none_of_it(unsandboxed):
    """As root without a sandbox, each notebook runs as the unprivileged user: it reads no master, leaves nothing
    running, and touches no other file; the honest answer keeps its marks."""
    assert unsandboxed.total("ada_correct") == 2.5, unsandboxed.scores["ada_correct"]
    assert unsandboxed.total("eve_sources") == 0 and "0 master notebooks found" in unsandboxed.output("eve_sources")
    assert not unsandboxed.left, unsandboxed.left
    assert all(s.score == 0 for s in gradebook.scores(NAME, "mallory_gradebook", unsandboxed.root))
    for path, before in unsandboxed.before.items():
        assert digest(Path(path)) == before, f"{path} was changed"
    assert all(run.sandbox == "user cs336-student" for run in unsandboxed.runs), unsandboxed.runs


# -- limits ----------------------------------------------------------------------------------------------------

def test_a_notebook_over_a_limit_scores_0_for_what_did_not_finish_and_is_reported(two_at_once):
    flood = {s.cell: s for s in two_at_once.scores["flo_output"]}
    assert flood["test_shard_range"].score == 1, "a test that finished before the limit keeps its points"
    assert flood["test_shard_range_uneven"].score == flood["test_shard_range_arguments"].score == 0
    assert "not run: the notebook's output passed its limit of 5 MB" in flood["test_shard_range_arguments"].reason
    reasons = two_at_once.root / "report" / "reasons"
    assert "stopped early: the notebook's output passed its limit" in (reasons / "flo_output.txt").read_text()
    if MEMORY_LIMITED:
        assert all(s.score == 0 for s in two_at_once.scores["meg_memory"])
        assert "memory limit of 2048 MB" in (reasons / "meg_memory.txt").read_text()
    assert (reasons / "ada_correct.txt").read_text() == "Every test passed.\n"


def test_the_wall_clock_limit_stops_the_cell_running_and_every_later_one(tmp_path, monkeypatch):
    monkeypatch.setenv("CS336_TEST_TIMEOUT_S", "10")  # the course's settings reach the kernel, nothing else
    monkeypatch.setenv("GRADER_TOKEN", "secret")
    kernel = {"name": "cs336-parallel", "language": "python", "display_name": "Python 3 (cs336-parallel)"}
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": kernel})
    first = "import os; print(os.environ.get('CS336_TEST_TIMEOUT_S'), os.environ.get('GRADER_TOKEN'))"
    nb.cells = [nbformat.v4.new_code_cell(s) for s in (first, "while True:\n    pass", "print('x')")]
    (tmp_path / "work").mkdir()
    ran, limit = runner.execute_notebook(nb, {}, tmp_path, gradebook.api().config, runner.Limits(wall_s=8),
                                         use_sandbox=True)
    assert limit == "the notebook used its wall-clock limit of 8 s, and it was stopped"
    assert ran.cells[0].outputs[0].text == "10 None\n"
    assert [o.evalue for o in ran.cells[1].outputs] == [limit]
    assert [o.evalue for o in ran.cells[2].outputs] == [f"not run: {limit}"]


# -- the report, regrading, resuming ----------------------------------------------------------------------------

def test_the_report_has_every_score_and_each_failure_in_one_line(two_at_once):
    rows = (two_at_once.root / "report" / "scores.csv").read_text().splitlines()
    assert rows[0] == "student,assignment,test,score,max_score,review" and len(rows) == 1 + len(CLASS) * 3
    assert "ada_correct,00_setup,test_shard_range_uneven,1,1," in rows
    blank = (two_at_once.root / "report" / "reasons" / "bo_blank.txt").read_text().splitlines()
    assert blank == [f"00_setup  {t}  0 / {m}  `shard_range` is not implemented yet (its cell still raises "
                     "NotImplementedError)." for t, m in [("shard_range", 1), ("shard_range_uneven", 1),
                                                         ("shard_range_arguments", 0.5)]]


def test_a_second_run_resumes_and_one_student_can_be_regraded(two_at_once):
    assert classroom.autograde([NAME], two_at_once.root, limits=LIMITS, use_sandbox=True) == []
    again = classroom.autograde([NAME], two_at_once.root, limits=LIMITS, use_sandbox=True, students=["bo_blank"])
    assert [r.student for r in again] == ["bo_blank"]
    assert gradebook.scores(NAME, "bo_blank", two_at_once.root) == two_at_once.scores["bo_blank"]


def test_an_interrupted_run_keeps_what_finished_and_resumes(tmp_path):
    """Ctrl-C while nbgrader scores the first notebook (it would make that an error) and the second one runs."""
    root = make_class(tmp_path, ["ada_correct", "bo_blank", "flo_output"])
    script = textwrap.dedent(f"""
        import os, signal, sys; sys.path.insert(0, {str(ROOT)!r})
        from grading import cli, verdict
        executed = verdict.ExecutedNotebook.preprocess
        def ctrl_c_while_scoring(self, nb, resources):
            os.kill(os.getpid(), signal.SIGINT)
            return executed(self, nb, resources)
        verdict.ExecutedNotebook.preprocess = ctrl_c_while_scoring
        cli.main(["--course", {str(root)!r}, "autograde", "--jobs", "1"])
    """)
    grader = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert grader.returncode == 1 and "run the same command again" in grader.stderr, grader.stdout + grader.stderr
    results = root / "executed" / NAME
    finished = [p.parent.name for p in results.glob("*/run.json")]
    assert len(finished) == 1 and (results / finished[0] / "scored").exists(), finished  # its scoring completed
    runs = classroom.autograde([NAME], root, limits=LIMITS, use_sandbox=True)
    assert sorted(r.student for r in runs) == sorted({"ada_correct", "bo_blank", "flo_output"} - set(finished))


# -- many machines ------------------------------------------------------------------------------------------------

def test_slurm_shards_run_as_separate_processes_then_merge_into_the_gradebook(tmp_path, one_at_a_time):
    students = ["ada_correct", "bo_blank", "flo_output"]
    root = make_class(tmp_path, students)
    cli = [sys.executable, "-m", "grading", "--course", str(root)]
    subprocess.run([*cli, "prepare", NAME], cwd=ROOT, check=True, capture_output=True)
    env = {**os.environ, "COURSE": str(root), "PYTHON": sys.executable, "SLURM_SUBMIT_DIR": str(ROOT),
           "SLURM_ARRAY_TASK_COUNT": "2"}
    shards = [subprocess.Popen(["bash", "grading/slurm/autograde.sbatch", NAME, "--jobs", "1", "--memory-limit",
                                str(LIMITS.memory_mb)], cwd=ROOT, env={**env, "SLURM_ARRAY_TASK_ID": str(i)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [shard.communicate(timeout=1200)[0] for shard in shards]
    assert all(shard.returncode == 0 for shard in shards), logs
    assert not (root / "gradebook.db").read_bytes() == b"" and not (root / "autograded").exists()  # shards only ran
    merged = subprocess.run([*cli, "merge", NAME], cwd=ROOT, capture_output=True, text=True)
    assert merged.returncode == 0 and "scored 3 notebooks" in merged.stdout, merged.stdout + merged.stderr
    for student in students:
        assert gradebook.scores(NAME, student, root) == one_at_a_time.scores[student]
    assert "stopped early" in (root / "report" / "reasons" / "flo_output.txt").read_text()


@pytest.mark.skipif(not MEMORY_LIMITED, reason="no memory cgroup this process may create")
def test_a_process_killed_for_memory_in_a_leaf_counts_as_the_limit_hit():
    """The OOM killer's count lands in the victim's leaf (the kernel's); the limit is on the cgroup above it."""
    limit = cgroup.MemoryLimit.create(64 << 20)
    try:
        join = f"import os; open({str(limit.procs)!r}, 'w').write(str(os.getpid()))"
        grow = "\nx = bytearray(256 << 20)\nx[::4096] = b'x' * len(x[::4096])"
        hog = subprocess.run([sys.executable, "-c", join + grow])
        assert hog.returncode == -9 and limit.hit()
    finally:
        limit.close()

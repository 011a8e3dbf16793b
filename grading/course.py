"""The course's nbgrader workflow, one subcommand per step (run from the repository root):

    python grading/course.py release [ASSIGNMENT ...]   # student notebooks -> notebooks/ (from grading/source)
    python grading/course.py collect SUBMISSIONS        # SUBMISSIONS/<student>/<assignment>.ipynb -> grading/submitted
    python grading/course.py autograde [ASSIGNMENT ...] # every submission in a sandbox, --jobs N at a time;
                                                        # --student S regrades one; scores + report/
    python grading/course.py feedback [ASSIGNMENT ...]  # one HTML report per student and notebook
    python grading/course.py export [grades.csv]        # every score, one row per student and assignment
    python grading/course.py selfgrade notebooks/01_collectives.ipynb   # a learner grades their own work

On a cluster (grading/slurm/autograde.sbatch): `prepare`, then one `execute --shard I --shards N` per task of a
Slurm job array, then `merge`, which scores every result into the gradebook and writes the report.

nbgrader keeps its working folders (release/, submitted/, autograded/, feedback/, gradebook.db) next to
this file; the executed notebooks go to executed/, the class report to report/ (grading/README.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import nbformat
from nbgrader.api import Gradebook
from nbgrader.apps import NbGraderAPI
from nbgrader.plugins import CsvExportPlugin
from traitlets.config import Config, PyFileConfigLoader

COURSE = Path(__file__).resolve().parent
REPO = COURSE.parent
sys.path.insert(0, str(REPO))  # `grading.verdict` and the package, also when this file runs as a script
from grading import classroom, report, sandbox, verdict  # noqa: E402
from grading.runner import Limits, Run  # noqa: E402

warnings.filterwarnings("ignore", module="nbgrader.api")  # SQLAlchemy notices from nbgrader's own queries
# nbgrader runs tools of its environment (alembic) by name: find them even in a venv that is not activated.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def assignments(root: Path = COURSE) -> list[str]:
    """Every assignment of the course, in order (00_setup, 01_collectives, ...)."""
    return sorted(p.name for p in (root / "source").iterdir() if (p / f"{p.name}.ipynb").exists())


def api(root: Path = COURSE, extra: Config | None = None) -> NbGraderAPI:
    """nbgrader's API on the course folder `root`, configured by nbgrader_config.py (and `extra`)."""
    config = PyFileConfigLoader("nbgrader_config.py", path=str(COURSE)).load_config()
    config.merge(Config({"CourseDirectory": {"root": str(root)}, "NbGraderAPI": {"log_level": "ERROR"}}))
    config.merge(extra or Config())
    return NbGraderAPI(config=config)


def _check(result: dict, what: str) -> None:
    if not result["success"]:
        raise RuntimeError(f"nbgrader could not {what}:\n{result.get('error') or result.get('log')}")


class LearnerChanges(Exception):
    """Releasing would overwrite notebooks that someone changed; they were left as they are."""

    def __init__(self, kept: list[Path], written: list[Path], root: Path):
        self.kept, self.written = kept, written
        lines = [f"{os.path.relpath(path)} has changes that the release would overwrite: it was left as it is (the "
                 f"new version is {os.path.relpath(root / 'release' / path.stem / path.name)})." for path in kept]
        super().__init__("\n".join([*lines, "Save your work elsewhere (commit it to a branch of your own, or copy "
                                     "the notebook), then run `make notebooks FORCE=1` to overwrite."]))


def _committed(path: Path) -> bytes | None:
    """`path` as the repository's last commit has it (None outside a git checkout, or if it is not committed)."""
    try:
        relative = path.resolve().relative_to(REPO)
        done = subprocess.run(["git", "show", f"HEAD:{relative.as_posix()}"], cwd=REPO, capture_output=True)
    except (ValueError, OSError):
        return None
    return done.stdout if done.returncode == 0 else None


def release(root: Path = COURSE, into: Path = REPO / "notebooks", names: list[str] | None = None, *,
            force: bool = False) -> list[Path]:
    """Generate the student versions (solutions and hidden tests removed) of `names` (default: all)
    and copy them into `into`. A notebook there that someone changed (it is neither the committed version,
    nor what the previous release wrote, nor the new one) is kept, and LearnerChanges raised, unless `force`."""
    grader = api(root)
    into.mkdir(parents=True, exist_ok=True)
    written, kept = [], []
    for name in names or assignments(root):
        generated, target = root / "release" / name / f"{name}.ipynb", into / f"{name}.ipynb"
        pristine = {generated.read_bytes() if generated.exists() else None, _committed(target)}
        _check(grader.generate_assignment(name), f"generate {name}")
        if force or not target.exists() or target.read_bytes() in pristine | {generated.read_bytes()}:
            written.append(Path(shutil.copy(generated, target)))
        else:
            kept.append(target)
    if kept:
        raise LearnerChanges(kept, written, root)
    return written


def collect(submissions: Path, root: Path = COURSE) -> list[tuple[str, str]]:
    """Copy SUBMISSIONS/<student>/<assignment>.ipynb into nbgrader's submitted/ layout."""
    known = set(assignments(root))
    collected = []
    for path in sorted(submissions.glob("*/*.ipynb")):
        student, assignment = path.parent.name, path.stem
        if assignment not in known:
            print(f"skipped {path}: {assignment!r} is not an assignment ({', '.join(sorted(known))})")
            continue
        target = root / "submitted" / student / assignment
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target / path.name)
        (target / "timestamp.txt").write_text(datetime.now(timezone.utc).isoformat())
        collected.append((student, assignment))
    return collected


def prepare(names: list[str] | None = None, root: Path = COURSE) -> NbGraderAPI:
    """Teach the gradebook each assignment's cells (nbgrader generate_assignment), before any is executed or
    scored. Returns the API it used."""
    grader = api(root)
    for name in names or assignments(root):
        _check(grader.generate_assignment(name), f"generate {name}")
    return grader


def autograde(names: list[str] | None = None, root: Path = COURSE, *, jobs: int | None = None,
              students: list[str] | None = None, force: bool = False, limits: Limits | None = None,
              sandbox: bool | None = None) -> list[Run]:
    """Grade every submission of the given assignments (all by default), each in a sandbox of its own,
    `jobs` at a time (default: what the cores allow), with a progress bar; then write the class report.

    Every submission of every named assignment goes into one pool: `autograde(names, root, jobs=2)` grades
    the whole list in parallel. Submissions already graded in this version are not run again (an
    interrupted run resumes), except those of `students` (regrade) or all with `force`. `sandbox=False`
    grades without isolation (None: as CS336_GRADING_SANDBOX says; `required` by default)."""
    names = names or assignments(root)
    runs = classroom.autograde(names, root, jobs=jobs, students=students, force=force, limits=limits,
                               use_sandbox=sandbox)
    report.write(names, root)
    return runs


def feedback(names: list[str] | None = None, root: Path = COURSE) -> None:
    grader = api(root)
    for name in names or assignments(root):
        _check(grader.generate_feedback(name), f"generate feedback for {name}")


def export(to: Path = COURSE / "grades.csv", root: Path = COURSE) -> Path:
    plugin = CsvExportPlugin(to=str(to))
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        plugin.export(gb)
    return to


@dataclass
class Score:
    cell: str  # the test cell's grade_id, test_<exercise>[_<concern>]
    score: float
    max_score: float
    reason: str = ""  # why it failed, in one line (empty when it passed)


def scores(name: str, student: str, root: Path = COURSE) -> list[Score]:
    """Points per autograded test cell of one student's notebook, in notebook order, with the reason of
    each failure (read from the autograded notebook)."""
    autograded = root / "autograded" / student / name / f"{name}.ipynb"
    why = verdict.reasons(nbformat.read(autograded, 4)) if autograded.exists() else {}
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        notebook = gb.find_submission_notebook(name, name, student)
        order = {cell.name: i for i, cell in enumerate(gb.find_notebook(name, name).grade_cells)}
        grades = sorted(notebook.grades, key=lambda g: order.get(g.name, len(order)))
        return [Score(g.name, g.score, g.max_score, "" if g.score == g.max_score else why.get(g.name, "missing"))
                for g in grades]


def selfgrade(notebook: Path) -> list[Score]:
    """Grade a learner's own notebook against the hidden tests, in a throwaway copy of the course."""
    name = notebook.stem
    if name not in assignments():
        raise SystemExit(f"{notebook} is not one of the course's notebooks ({', '.join(assignments())})")
    with tempfile.TemporaryDirectory(prefix="cs336-selfgrade-") as tmp:
        root = Path(tmp)
        shutil.copytree(COURSE / "source" / name, root / "source" / name)
        target = root / "submitted" / "me" / name
        target.mkdir(parents=True)
        shutil.copy(notebook, target / f"{name}.ipynb")
        print(f"Running {notebook} with the hidden tests (about as long as running it top to bottom)...")
        # A learner's own code on their own machine: isolated where a sandbox runs, else as it is.
        autograde([name], root, sandbox=sandbox.problem() is None)
        return scores(name, "me", root)


def print_table(results: list[Score]) -> None:
    """One line per test: ok or --, its name, its points, and why it failed."""
    width = max(len(r.cell) for r in results)
    for r in results:
        mark = "ok" if r.score == r.max_score else "--"
        line = f"  {mark}  {r.cell.removeprefix('test_'):<{width}}  {r.score:g} / {r.max_score:g}"
        print(f"{line}   {r.reason}" if r.reason else line)
    total, best = sum(r.score for r in results), sum(r.max_score for r in results)
    print(f"  total {total:g} / {best:g}")


def _add_limits(parser: argparse.ArgumentParser) -> None:
    defaults = Limits()
    parser.add_argument("--jobs", type=int, default=None,
                        help="notebooks at once (default: 2 x the cores // the notebooks' largest world size)")
    parser.add_argument("--no-sandbox", action="store_true",
                        help="run submissions WITHOUT isolation (only where no sandbox can run; they can read "
                             "and write everything you can)")
    parser.add_argument("--time-limit", type=float, default=defaults.wall_s, help="seconds per notebook")
    parser.add_argument("--memory-limit", type=int, default=defaults.memory_mb, help="MB per notebook")
    parser.add_argument("--output-limit", type=float, default=defaults.output_mb, help="MB of output per notebook")


def _limits(args: argparse.Namespace) -> Limits:
    return Limits(wall_s=args.time_limit, memory_mb=args.memory_limit, output_mb=args.output_limit)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python grading/course.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--course", type=Path, default=COURSE, help="the course folder (default: grading/)")
    sub = parser.add_subparsers(dest="command", required=True)
    releasing = sub.add_parser("release")
    releasing.add_argument("assignments", nargs="*")
    releasing.add_argument("--force", action="store_true", help="overwrite notebooks that have changes")
    sub.add_parser("collect").add_argument("submissions", type=Path)
    sub.add_parser("prepare").add_argument("assignments", nargs="*")
    grade = sub.add_parser("autograde")
    grade.add_argument("assignments", nargs="*")
    grade.add_argument("--student", action="append", help="regrade this student only (repeatable)")
    grade.add_argument("--force", action="store_true", help="regrade every submission, even those already graded")
    _add_limits(grade)
    shard = sub.add_parser("execute", help="one task of a Slurm job array: execute a share, write no gradebook")
    shard.add_argument("assignments", nargs="*")
    shard.add_argument("--shard", type=int, required=True, help="this task's number, 0..shards-1")
    shard.add_argument("--shards", type=int, required=True, help="how many tasks share the class")
    shard.add_argument("--force", action="store_true", help="execute again what already has a result")
    _add_limits(shard)
    sub.add_parser("merge", help="score the shards' results into the gradebook").add_argument("assignments", nargs="*")
    sub.add_parser("report").add_argument("assignments", nargs="*")
    sub.add_parser("feedback").add_argument("assignments", nargs="*")
    sub.add_parser("export").add_argument("to", nargs="?", type=Path, default=COURSE / "grades.csv")
    sub.add_parser("selfgrade").add_argument("notebook", type=Path)
    args = parser.parse_args(argv)
    root = args.course.resolve()
    names = getattr(args, "assignments", None) or assignments(root)
    if args.command == "release":
        try:
            written = release(root, names=args.assignments, force=args.force)
        except LearnerChanges as e:
            written, refusal = e.written, str(e)
        else:
            refusal = None
        for path in written:
            print(f"wrote {path.relative_to(REPO)}")
        if refusal:
            sys.exit(refusal)
    elif args.command == "collect":
        collected = collect(args.submissions, root)
        print(f"collected {len(collected)} notebooks from {len({s for s, _ in collected})} students")
    elif args.command == "prepare":
        prepare(names, root)
    elif args.command == "autograde":
        try:
            autograde(names, root, jobs=args.jobs, students=args.student, force=args.force, limits=_limits(args),
                      sandbox=False if args.no_sandbox else None)
        except classroom.Interrupted as e:
            raise SystemExit(str(e)) from None
        print(f"report in {root / 'report'}")
    elif args.command == "execute":
        try:
            classroom.execute_shard(names, root, api(root).config, shard=args.shard, shards=args.shards,
                                    parallel=args.jobs, limits=_limits(args),
                                    use_sandbox=classroom._sandbox_wanted(False if args.no_sandbox else None),
                                    results=root / classroom.RESULTS, force=args.force)
        except classroom.Interrupted as e:
            raise SystemExit(str(e)) from None
    elif args.command == "merge":
        print(f"scored {classroom.merge(names, root)} notebooks; report in {report.write(names, root)}")
    elif args.command == "report":
        print(f"report in {report.write(names, root)}")
    elif args.command == "feedback":
        feedback(args.assignments, root)
        print(f"feedback in {root / 'feedback'}")
    elif args.command == "export":
        print(f"wrote {export(args.to, root)}")
    else:
        print_table(selfgrade(args.notebook))


if __name__ == "__main__":
    sys.exit(main())

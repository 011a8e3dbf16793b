"""The course's nbgrader workflow, one subcommand per step (run from the repository root):

    python grading/course.py release [ASSIGNMENT ...]   # student notebooks -> notebooks/ (from grading/source)
    python grading/course.py collect SUBMISSIONS        # SUBMISSIONS/<student>/<assignment>.ipynb -> grading/submitted
    python grading/course.py autograde [ASSIGNMENT ...] # run the hidden tests on every submission
    python grading/course.py feedback [ASSIGNMENT ...]  # one HTML report per student and notebook
    python grading/course.py export [grades.csv]        # every score, one row per student and assignment
    python grading/course.py selfgrade notebooks/01_collectives.ipynb   # a learner grades their own work

nbgrader keeps its working folders (release/, submitted/, autograded/, feedback/, gradebook.db) next to
this file.
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
from grading import verdict  # noqa: E402

warnings.filterwarnings("ignore", module="nbgrader.api")  # SQLAlchemy notices from nbgrader's own queries
# nbgrader runs tools of its environment (alembic) by name: find them even in a venv that is not activated.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def assignments(root: Path = COURSE) -> list[str]:
    """Every assignment of the course, in order (00_setup, 01_collectives, ...)."""
    return sorted(p.name for p in (root / "source").iterdir() if (p / f"{p.name}.ipynb").exists())


def api(root: Path = COURSE) -> NbGraderAPI:
    """nbgrader's API on the course folder `root`, configured by nbgrader_config.py."""
    config = PyFileConfigLoader("nbgrader_config.py", path=str(COURSE)).load_config()
    config.merge(Config({"CourseDirectory": {"root": str(root)}, "NbGraderAPI": {"log_level": "ERROR"}}))
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


def _submissions(root: Path, names: list[str]) -> list[tuple[str, str]]:
    return [(student.name, name) for name in names
            for student in sorted((root / "submitted").glob("*")) if (student / name).is_dir()]


def autograde(names: list[str] | None = None, root: Path = COURSE) -> None:
    """Run every submission of the given assignments (all by default), with a progress bar."""
    from tqdm.auto import tqdm

    grader = api(root)
    for name in names or assignments(root):  # the gradebook must know the assignment's cells
        _check(grader.generate_assignment(name), f"generate {name}")
    for student, name in tqdm(_submissions(root, names or assignments(root)), desc="autograding", unit="notebook"):
        _check(grader.autograde(name, student), f"autograde {student}/{name}")


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
        autograde([name], root)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python grading/course.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    releasing = sub.add_parser("release")
    releasing.add_argument("assignments", nargs="*")
    releasing.add_argument("--force", action="store_true", help="overwrite notebooks that have changes")
    sub.add_parser("collect").add_argument("submissions", type=Path)
    sub.add_parser("autograde").add_argument("assignments", nargs="*")
    sub.add_parser("feedback").add_argument("assignments", nargs="*")
    sub.add_parser("export").add_argument("to", nargs="?", type=Path, default=COURSE / "grades.csv")
    sub.add_parser("selfgrade").add_argument("notebook", type=Path)
    args = parser.parse_args(argv)
    if args.command == "release":
        try:
            written = release(names=args.assignments, force=args.force)
        except LearnerChanges as e:
            written, refusal = e.written, str(e)
        else:
            refusal = None
        for path in written:
            print(f"wrote {path.relative_to(REPO)}")
        if refusal:
            sys.exit(refusal)
    elif args.command == "collect":
        collected = collect(args.submissions)
        print(f"collected {len(collected)} notebooks from {len({s for s, _ in collected})} students")
    elif args.command == "autograde":
        autograde(args.assignments)
    elif args.command == "feedback":
        feedback(args.assignments)
        print(f"feedback in {COURSE / 'feedback'}")
    elif args.command == "export":
        print(f"wrote {export(args.to)}")
    else:
        print_table(selfgrade(args.notebook))


if __name__ == "__main__":
    sys.exit(main())

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
import sys
import tempfile
import warnings
from dataclasses import dataclass
from datetime import UTC, datetime
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


def release(root: Path = COURSE, into: Path = REPO / "notebooks", names: list[str] | None = None) -> list[Path]:
    """Generate the student versions (solutions and hidden tests removed) of `names` (default: all)
    and copy them into `into`."""
    grader = api(root)
    into.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names or assignments(root):
        _check(grader.generate_assignment(name), f"generate {name}")
        written.append(Path(shutil.copy(root / "release" / name / f"{name}.ipynb", into / f"{name}.ipynb")))
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
        (target / "timestamp.txt").write_text(datetime.now(UTC).isoformat())
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
    sub.add_parser("release").add_argument("assignments", nargs="*")
    sub.add_parser("collect").add_argument("submissions", type=Path)
    sub.add_parser("autograde").add_argument("assignments", nargs="*")
    sub.add_parser("feedback").add_argument("assignments", nargs="*")
    sub.add_parser("export").add_argument("to", nargs="?", type=Path, default=COURSE / "grades.csv")
    sub.add_parser("selfgrade").add_argument("notebook", type=Path)
    args = parser.parse_args(argv)
    if args.command == "release":
        for path in release(names=args.assignments):
            print(f"wrote {path.relative_to(REPO)}")
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

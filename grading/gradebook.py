"""The course folder and nbgrader's calls on it: the bottom layer of grading/, which imports nothing above it.

A course folder (grading/ by default; a copy for self-grading and tests) holds `source/<assignment>/<assignment>.ipynb`
(the masters, with solutions and hidden tests) and nbgrader's working folders beside them: release/, submitted/,
autograded/, feedback/ and gradebook.db. The configuration is always this package's nbgrader_config.py, whatever
the folder: a course copied elsewhere grades with every defence, or not at all.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import nbformat
import nbgrader.api
from alembic.config import Config as AlembicConfig
from alembic.script import ScriptDirectory
from nbgrader import dbutil
from nbgrader.api import Gradebook
from nbgrader.apps import NbGraderAPI
from nbgrader.plugins import CsvExportPlugin
from traitlets.config import Config, PyFileConfigLoader

from cs336_parallel.selfcheck import Score
from grading import verdict

COURSE = Path(__file__).resolve().parent
REPO = COURSE.parent
CONFIG = "nbgrader_config.py"



@functools.cache
def _schema_version() -> str:
    """The gradebook schema's version (the head of nbgrader's alembic scripts), read in this process: nbgrader's own
    `get_alembic_version` starts `alembic heads`, found on PATH, for every new gradebook (3 s each)."""
    config = AlembicConfig()
    config.set_main_option("script_location", dbutil.ALEMBIC_DIR)
    return ScriptDirectory.from_config(config).get_current_head()


class ConfigurationError(SystemExit):
    """The course's grading configuration did not load: nothing is graded (never with nbgrader's defaults)."""


def assignments(root: Path = COURSE) -> list[str]:
    """Every assignment of the course, in order (00_setup, 01_collectives, ...)."""
    return sorted(p.name for p in (root / "source").iterdir() if (p / f"{p.name}.ipynb").exists())


def config() -> Config:
    """The course's nbgrader configuration (this package's nbgrader_config.py), or ConfigurationError saying why
    it did not load."""
    try:
        loaded = PyFileConfigLoader(CONFIG, path=str(COURSE)).load_config()
    except BaseException as e:  # noqa: BLE001 - the config file raises SystemExit itself when its imports fail
        raise ConfigurationError(f"the course's grading configuration ({COURSE / CONFIG}) did not load, so "
                                 f"nothing is graded: {e}") from None
    steps = loaded.Autograde.get("autograde_preprocessors", [])
    if verdict.ExecutedNotebook not in steps or verdict.SaveVerdicts not in steps:
        raise ConfigurationError(f"{COURSE / CONFIG} does not configure the course's grader (its autograde "
                                 "preprocessors lack grading.verdict.ExecutedNotebook and SaveVerdicts): nothing is "
                                 "graded")
    return loaded


def api(root: Path = COURSE, extra: Config | None = None) -> NbGraderAPI:
    """nbgrader's API on the course folder `root`, configured by nbgrader_config.py (and `extra`)."""
    nbgrader.api.get_alembic_version = _schema_version
    warnings.filterwarnings("ignore", module="nbgrader.api")  # SQLAlchemy notices from nbgrader's own queries
    loaded = config()
    loaded.merge(Config({"CourseDirectory": {"root": str(root)}, "NbGraderAPI": {"log_level": "ERROR"}}))
    loaded.merge(extra or Config())
    return NbGraderAPI(config=loaded)


def check(result: dict, what: str) -> None:
    """Raise RuntimeError with nbgrader's own message when one of its API calls failed."""
    if not result["success"]:
        details = "\n".join(part for part in (result.get("log"), result.get("error")) if part)
        raise RuntimeError(f"nbgrader could not {what}:\n{details[-4000:]}")


def prepare(names: list[str] | None = None, root: Path = COURSE) -> NbGraderAPI:
    """Teach the gradebook each assignment's cells (nbgrader generate_assignment), before any is executed or
    scored. Returns the API it used."""
    grader = api(root)
    for name in names or assignments(root):
        check(grader.generate_assignment(name), f"generate {name}")
    return grader


# -- submissions ------------------------------------------------------------------------------------------------

@dataclass
class Submission:
    """One student's notebook: submitted/<student>/<assignment>/<assignment>.ipynb of the course at `root`."""
    assignment: str
    student: str
    root: str

    @property
    def folder(self) -> Path:
        return Path(self.root) / "submitted" / self.student / self.assignment

    @property
    def master(self) -> Path:
        """The course's own version of the notebook: its test cells are the only ones the grader runs."""
        return Path(self.root) / "source" / self.assignment / f"{self.assignment}.ipynb"

    def key(self) -> str:
        """A hash of the master notebook and the submitted files: a result for another version is not reused."""
        digest = hashlib.sha256()
        for path in [self.master, *sorted(p for p in self.folder.rglob("*") if p.is_file())]:
            digest.update(str(path.relative_to(self.root)).encode() + b"\0" + path.read_bytes() + b"\0")
        return digest.hexdigest()[:16]


def submissions(names: list[str], root: Path, students: list[str] | None = None) -> list[Submission]:
    """Every submitted/<student>/<assignment>/ of the named assignments (of `students` only, if given)."""
    wanted = set(students) if students else None
    return [Submission(name, folder.name, str(root)) for name in names
            for folder in sorted((root / "submitted").glob("*"))
            if (folder / name).is_dir() and (wanted is None or folder.name in wanted)]


def collect(downloads: Path, root: Path = COURSE) -> list[tuple[str, str]]:
    """Copy DOWNLOADS/<student>/<assignment>.ipynb into nbgrader's submitted/ layout."""
    known = set(assignments(root))
    collected = []
    for path in sorted(downloads.glob("*/*.ipynb")):
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


# -- the release -----------------------------------------------------------------------------------------------

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
        check(grader.generate_assignment(name), f"generate {name}")
        if force or not target.exists() or target.read_bytes() in pristine | {generated.read_bytes()}:
            written.append(Path(shutil.copy(generated, target)))
        else:
            kept.append(target)
    if kept:
        raise LearnerChanges(kept, written, root)
    return written


# -- scores, feedback, export ------------------------------------------------------------------------------------

def autograded_notebook(root: Path, name: str, student: str) -> Path:
    return root / "autograded" / student / name / f"{name}.ipynb"


def scores(name: str, student: str, root: Path = COURSE) -> list[Score]:
    """Points per autograded test cell of one student's notebook, in notebook order, with the reason of
    each failure (read from the autograded notebook)."""
    autograded = autograded_notebook(root, name, student)
    why = verdict.reasons(nbformat.read(autograded, 4)) if autograded.exists() else {}
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        notebook = gb.find_submission_notebook(name, name, student)
        order = {cell.name: i for i, cell in enumerate(gb.find_notebook(name, name).grade_cells)}
        grades = sorted(notebook.grades, key=lambda g: order.get(g.name, len(order)))
        return [Score(g.name, g.score, g.max_score, "" if g.score == g.max_score else why.get(g.name, "missing"))
                for g in grades]


def feedback(names: list[str] | None = None, root: Path = COURSE) -> None:
    """One HTML report per student and notebook (what the submission displayed as HTML is sanitized first)."""
    grader = api(root)
    for name in names or assignments(root):
        check(grader.generate_feedback(name), f"generate feedback for {name}")


def totals(root: Path = COURSE, names: list[str] | None = None) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """({student: {assignment: total score}}, {assignment: points possible}) of the assignments `names` (default:
    every one the gradebook knows), in order. A student appears with every assignment they submitted."""
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        known = sorted((a for a in gb.assignments if names is None or a.name in names), key=lambda a: a.name)
        possible = {a.name: a.max_score for a in known}
        scores: dict[str, dict[str, float]] = {s.id: {} for s in gb.students}
        for assignment in known:
            for submission in assignment.submissions:
                scores[submission.student_id][assignment.name] = submission.score
    return scores, possible


def export(to: Path = COURSE / "grades.csv", root: Path = COURSE) -> Path:
    """Every score, one row per student and assignment (nbgrader's CSV)."""
    plugin = CsvExportPlugin(to=str(to))
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        plugin.export(gb)
    return to

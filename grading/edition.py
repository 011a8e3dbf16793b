"""The student edition: the repository a graded class is given, with nothing of grading/source/ in it.

The course's repository holds every solution and hidden test (grading/source/), so a class must not be given it.
`python -m grading student-edition DIR` writes, into DIR:
- notebooks/: the student versions, generated from the masters now (solutions replaced by stubs, hidden tests
  removed: nbgrader's release), and notebooks/Makefile (`make grade` from JupyterLab's terminal);
- cs336_parallel/: the package (it ships no solutions);
- README.md and Makefile: the course's own, without their `course only` parts (`edition_text`): the learner's
  commands (`make lab`, `make lab TORCH=cpu`, `make grade`, the locked install); there `make grade` and `%grade`
  run the visible tests (cs336_parallel/selfcheck.py) and say that the hidden tests run when the work is submitted;
- what those need: pyproject.toml, environment.yml, requirements/lock.txt, .gitignore, LICENSE if there is one,
  and the pictures the README shows.
No grading/ and no tests/ (their fixtures hold answers). Before it returns, every file written is searched for
each telling line of the masters' solutions and hidden tests (`secret_lines`, `leaks`); one found is an error.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import nbformat

from grading import gradebook
from grading.gradebook import COURSE, REPO

FILES = ("pyproject.toml", "environment.yml", "requirements/lock.txt", ".gitignore", "LICENSE")
WITHOUT_COURSE_PARTS = ("README.md", "Makefile")
# `# course only` / `<!-- course only -->` ... `# end course only` / `<!-- end course only -->`: left out, markers
# included. A line that ends with `<!-- course only -->` (a table row) is left out alone.
BEGIN = re.compile(r"\s*(#|<!--)\s*course only\s*(-->)?\s*")
END = re.compile(r"\s*(#|<!--)\s*end course only\s*(-->)?\s*")
ROW = "<!-- course only -->"
# `<!-- edition only` ... `-->`: hidden in the course's README (a comment), shown in the edition's.
SHOW_BEGIN, SHOW_END = "<!-- edition only", "-->"
# The masters' secret blocks; a line of one is telling when it has at least this many characters, stripped.
SECRET = re.compile(r"### BEGIN (?:SOLUTION|HIDDEN TESTS)\n(.*?)### END (?:SOLUTION|HIDDEN TESTS)", re.S)
MIN_CHARS = 12


class Leak(Exception):
    """The edition holds a line of a solution or of a hidden test."""


def edition_text(text: str) -> str:
    """The README's or the Makefile's text as the edition has it: `course only` parts left out, `edition only` parts
    shown. Raises ValueError where a part is not closed."""
    kept: list[str] = []
    part = None  # "course" or "edition" while inside one
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if part is None and BEGIN.fullmatch(line.rstrip("\n")):
            part = "course"
        elif part == "course" and END.fullmatch(line.rstrip("\n")):
            part = None
        elif part is None and stripped == SHOW_BEGIN:
            part = "edition"
        elif part == "edition" and stripped == SHOW_END:
            part = None
        elif part != "course" and not stripped.endswith(ROW):
            kept.append(line)
    if part is not None:
        raise ValueError(f"a `{part} only` part is not closed")
    return re.sub(r"\n{3,}", "\n\n", "".join(kept))


def pictures(readme: str) -> list[str]:
    """The repository's files a README shows: `![...](docs/x.png)`."""
    return re.findall(r"!\[[^\]]*\]\((docs/[^)\s]+)\)", readme)


def check_target(into: Path) -> None:
    """Refuse a folder that holds something other than an earlier edition (a clone of one: its .git is kept)."""
    if into.exists() and any(p.name != ".git" for p in into.iterdir()):
        if (into / "grading").exists() or not (into / "cs336_parallel").is_dir():
            raise SystemExit(f"{into} is neither empty nor an earlier student edition: choose another folder")


def replace(into: Path, built: Path) -> None:
    """Put what is in `built` in place of what `into` holds, its .git aside."""
    into.mkdir(parents=True, exist_ok=True)
    for path in into.iterdir():
        if path.name != ".git":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    for path in built.iterdir():
        shutil.move(path, into / path.name)


def copy(relative: str, into: Path) -> None:
    """Copy REPO/relative (a file or a folder, caches left out) to into/relative, if it exists."""
    source = REPO / relative
    if source.is_dir():
        shutil.copytree(source, into / relative, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    elif source.exists():
        (into / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, into / relative)


def write(into: Path, course: Path = COURSE) -> list[Path]:
    """Write the student edition of `course` (its masters; the rest comes from this repository) into `into`;
    returns the files written. Raises Leak, and changes nothing, if any would hold a secret line."""
    check_target(into)
    with tempfile.TemporaryDirectory(prefix="cs336-edition-") as tmp:
        built = Path(tmp)
        gradebook.release(course, built / "notebooks", force=True)
        for path in (REPO / "notebooks").iterdir():
            if path.suffix != ".ipynb" and path.is_file():
                copy(f"notebooks/{path.name}", built)
        copy("cs336_parallel", built)
        for name in WITHOUT_COURSE_PARTS:
            (built / name).write_text(edition_text((REPO / name).read_text()))
        for relative in [*FILES, *pictures((built / "README.md").read_text())]:
            copy(relative, built)
        if found := leaks(built, secret_lines(course)):
            raise Leak("the student edition would hold lines of the solutions or hidden tests; nothing was "
                       "written:\n" + "\n".join(found[:20]))
        replace(into, built)
    return sorted(p for p in into.rglob("*") if p.is_file() and ".git" not in p.relative_to(into).parts)


# -- the search for secrets -------------------------------------------------------------------------------------

def masters(course: Path) -> dict[str, nbformat.NotebookNode]:
    return {name: nbformat.read(course / "source" / name / f"{name}.ipynb", as_version=4)
            for name in gradebook.assignments(course)}


def public_text(nbs: dict[str, nbformat.NotebookNode], package: Path = REPO / "cs336_parallel") -> str:
    """What every learner has anyway: the masters' cells outside their secret blocks (what a student version
    shows), and the package's Python files (common code: its reference models and formulas, its argument checks)."""
    shown = [SECRET.sub("", cell.source) for nb in nbs.values() for cell in nb.cells]
    return "\n".join([*shown, *(path.read_text() for path in package.rglob("*.py"))])


def secret_lines(course: Path) -> dict[str, str]:
    """Every telling line of the masters' solutions and hidden tests, {line: its assignment}: at least MIN_CHARS
    characters once stripped, and nowhere in the `public_text` (a line there, or part of one, tells nothing)."""
    nbs = masters(course)
    public = public_text(nbs)
    found = {}
    for name, nb in nbs.items():
        for block in (block for cell in nb.cells for block in SECRET.findall(cell.source)):
            found.update({line.strip(): name for line in block.splitlines()
                          if len(line.strip()) >= MIN_CHARS and line.strip() not in public})
    return found


def readable_text(path: Path) -> str:
    """What a file says: a notebook's strings (sources, outputs, metadata), unescaped from its JSON; any other
    file's bytes as text."""
    raw = path.read_bytes().decode("utf-8", errors="ignore")
    if path.suffix != ".ipynb":
        return raw
    strings: list[str] = []

    def walk(value) -> None:
        if isinstance(value, str):
            strings.append(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                strings.append(key)
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(json.loads(raw))
    return "\n".join(strings)


def leaks(folder: Path, secrets: dict[str, str]) -> list[str]:
    """`file: line (assignment)` for each secret line found anywhere in a file under `folder` (.git aside)."""
    found = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if ".git" in path.relative_to(folder).parts:
            continue
        text = readable_text(path)
        found += [f"{path.relative_to(folder)}: {line} ({name})" for line, name in secrets.items() if line in text]
    return found

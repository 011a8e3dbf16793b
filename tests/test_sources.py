"""Every notebook code cell and every fixture answer is valid Python (magics as IPython reads them): a typo shows
up here in a second, not minutes into an autograde run."""

from __future__ import annotations

import importlib
from pathlib import Path

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager

from common import ROOT
from fixtures import cheats
from fixtures.variants import Correct, Tamper, Wrong
from grading import gradebook

# Cell magics whose body is Python (it runs in the kernel, on the ranks or in the grader).
PYTHON_BODIES = ("%%ranks", "%%test", "%%test_helpers", "%%time")
NOTEBOOKS = sorted([*ROOT.glob("grading/source/*/*.ipynb"), *ROOT.glob("notebooks/*.ipynb")])


def check_source(source: str, where: str) -> None:
    """Compile `source` as IPython would run it; for the magics above, their bodies too."""
    first, _, body = source.partition("\n")
    if first.split()[:1] and first.split()[0] in PYTHON_BODIES:
        check_source(body, where)
        return
    python = TransformerManager().transform_cell(source)
    try:
        compile(python, where, "exec")
    except SyntaxError as e:
        raise AssertionError(f"{where}: line {e.lineno}: {e.msg}") from None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_cell_is_python(path: Path):
    for i, cell in enumerate(nbformat.read(path, 4).cells):
        if cell.cell_type == "code":
            check_source(cell.source, f"{path.name}, cell {i}")


@pytest.mark.parametrize("name", gradebook.assignments())
def test_every_fixture_answer_is_python(name: str):
    variants = importlib.import_module(f"fixtures.variants.{name}").VARIANTS
    for exercise, fixtures in variants.items():
        for fixture in fixtures:
            assert isinstance(fixture, Correct | Wrong | Tamper)
            check_source(fixture.source.strip("\n"), f"{name} {exercise}: {fixture.why}")


def test_every_trust_fixture_is_python():
    for submission in [*cheats.CHEATS, *cheats.LEAKS, *cheats.HONEST]:
        for grade_id, source in submission.answers.items():
            check_source(source.strip("\n"), f"{submission.name} {grade_id}")
        for extra in (submission.before, submission.after):
            if extra:
                check_source(extra.strip("\n"), f"{submission.name}")

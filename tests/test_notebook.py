"""Loading a notebook's definitions (for benchmarks and torchrun) without running its demonstrations."""

import nbformat
import pytest

from cs336_parallel.notebook import load_definitions
from cs336_parallel.run import load_target


@pytest.fixture
def notebook(tmp_path):
    answer = nbformat.v4.new_code_cell("SCALE = float(3)  # a call, but in an answer cell\n"
                                       "def scaled(x):\n    return SCALE * x")
    answer.metadata["nbgrader"] = {"solution": True, "grade": False, "grade_id": "scaled"}
    cells = [
        nbformat.v4.new_code_cell("import math\n%load_ext cs336_parallel\n%cluster start -n 4"),
        nbformat.v4.new_code_cell("def area(r):\n    return math.pi * r**2"),
        nbformat.v4.new_code_cell("from __future__ import annotations\nfrom dataclasses import dataclass\n\n\n"
                                  "@dataclass\nclass Shard:\n    start: int\n    stop: int"),
        nbformat.v4.new_code_cell("print('a demonstration')\nraise RuntimeError('must not run')"),
        nbformat.v4.new_code_cell("%%ranks\nraise RuntimeError('must not run either')"),
        answer,
    ]
    path = tmp_path / "lesson.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    return path


def test_definitions_and_answer_cells_run_demonstrations_do_not(notebook):
    ns = load_definitions(notebook, ["area", "scaled"])
    assert ns["area"](1) == pytest.approx(3.14159, rel=1e-5) and ns["scaled"](2) == 6.0


def test_a_missing_name_is_a_clear_error(notebook):
    with pytest.raises(LookupError, match="defines no volume"):
        load_definitions(notebook, ["volume"])


def test_run_targets_a_notebook_function(notebook):
    assert load_target(f"{notebook}:scaled")(1) == 3.0
    with pytest.raises(ValueError, match="path.py:function"):
        load_target("no-colon")


def test_a_notebook_dataclass_works_and_travels_to_ranks(notebook):
    from cs336_parallel import Cluster

    ns = load_definitions(notebook, ["Shard", "area"])
    assert ns["Shard"](1, 2).stop == 2
    with Cluster(2, backend="gloo") as cluster:
        got = cluster.run(lambda shard, area: (shard.start, round(area(1), 2)), ns["Shard"](3, 4), ns["area"])
    assert got == [(3, 3.14), (3, 3.14)]

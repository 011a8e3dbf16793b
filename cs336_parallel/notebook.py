"""Load the functions and classes a notebook defines, without running its demonstrations.

Benchmarks compare a learner's implementation (or the master solution in `grading/source/`) with
PyTorch's, and `python -m cs336_parallel.run` can launch a notebook's function under torchrun: both
need the notebook's definitions, not its side effects.
"""

from __future__ import annotations

import ast
import json
import sys
import types
import uuid
from pathlib import Path

import cloudpickle

_DEFINITIONS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _is_definition(stmt: ast.stmt) -> bool:
    """Imports, functions, classes, docstrings, and assignments that call nothing (constants)."""
    if isinstance(stmt, _DEFINITIONS):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
        return True
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
        return not any(isinstance(node, ast.Call) for node in ast.walk(stmt))
    return False


def _without_magics(source: str) -> str:
    """The cell with its `%line magic` and `!shell` lines removed (a `%%cell magic` cell becomes empty)."""
    if source.lstrip().startswith("%%"):
        return ""
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))


def definition_cells(path: str | Path) -> list[str]:
    """The sources of the code cells that only define things, and of every answer cell (nbgrader's
    solution cells: they are definitions, even where they also compute a constant), magics removed."""
    cells = json.loads(Path(path).read_text())["cells"]
    sources = []
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        source = _without_magics("".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"])
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        answer = cell.get("metadata", {}).get("nbgrader", {}).get("solution", False)
        if tree.body and (answer or all(_is_definition(stmt) for stmt in tree.body)):
            sources.append(source)
    return sources


def load_definitions(path: str | Path, names: list[str] | None = None) -> dict:
    """Execute a notebook's definition cells; return the namespace (checked to hold `names`).

    The cells run in a module of their own (dataclasses need one), which cloudpickle ships to ranks
    by value: ranks cannot import it."""
    path = Path(path)
    module = types.ModuleType(f"notebook_{path.stem}_{uuid.uuid4().hex[:8]}")
    sys.modules[module.__name__] = module
    cloudpickle.register_pickle_by_value(module)
    for i, source in enumerate(definition_cells(path)):
        code = compile(source, f"{path.name} (definition cell {i + 1})", "exec", dont_inherit=True)
        exec(code, module.__dict__)
    missing = [n for n in names or [] if n not in module.__dict__]
    if missing:
        raise LookupError(f"{path} defines no {', '.join(missing)} (looked in cells that only define things)")
    return module.__dict__

"""Load the functions and classes a notebook defines, without running its demonstrations.

Benchmarks compare a learner's implementation (or the master solution in `grading/source/`) with
PyTorch's, and `python -m cs336_parallel.run` can launch a notebook's function under torchrun: both
need the notebook's definitions, not its side effects.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

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

    The namespace is not an importable module, so cloudpickle ships its functions to ranks by value."""
    path = Path(path)
    namespace: dict = {"__name__": f"notebook:{path.stem}"}
    for i, source in enumerate(definition_cells(path)):
        exec(compile(source, f"{path.name} (definition cell {i + 1})", "exec"), namespace)
    missing = [n for n in names or [] if n not in namespace]
    if missing:
        raise LookupError(f"{path} defines no {', '.join(missing)} (looked in cells that only define things)")
    return namespace

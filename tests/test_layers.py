"""The code's layers: no import cycle among the package's and grading's modules, and no module reaching for a
private (underscore) name of another."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from common import ROOT

PACKAGES = ("cs336_parallel", "grading")


def modules() -> dict[str, Path]:
    """Every module of the two packages, by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "source" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def resolve(name: str, level: int, current: str, is_package: bool) -> str:
    """The absolute name of an import of `name` at relative `level` in module `current`."""
    if not level:
        return name
    base = current.split(".")[: len(current.split(".")) - level + (1 if is_package else 0)]
    return ".".join([*base, name] if name else base)


def imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, name imported from it or None, line) for every import in `module`, wherever it is."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = resolve(node.module or "", node.level, module, path.name == "__init__.py")
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.append((submodule, None, node.lineno) if submodule in MODULES else
                             (source, alias.name, node.lineno))
    return [(m, n, line) for m, n, line in found if m.split(".")[0] in PACKAGES]


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for target, _, _ in imports(module):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != module and not module.startswith(f"{target}."):  # a package's own children
                edges[module].add(target)
    return edges


def test_the_import_graph_has_no_cycle():
    edges, state, path = graph(), {}, []

    def visit(module: str) -> None:
        state[module] = "open"
        path.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                cycle = path[path.index(target):] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = "done"

    for module in sorted(MODULES):
        if module not in state:
            visit(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_uses_a_private_name_of_another(module):
    tree = ast.parse(MODULES[module].read_text())
    private = [f"line {line}: from {source} import {name}" for source, name, line in imports(module)
               if name and name.startswith("_") and not name.startswith("__")]
    aliases = {(a.asname or a.name).split(".")[0]: a.name for node in ast.walk(tree)
               if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}
    project = {alias for alias, name in aliases.items()
               if any(f"{m}".endswith(name) or m.split(".")[-1] == name for m in MODULES)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in project
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            private.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    assert not private, f"{module} uses private names of other modules: {private}"


# The rank runtime: what starts and serves ranks. The grader has its own test ranks in another process
# (grading/rank_box.py runs cs336_parallel.rank_host), so none of this is ever loaded in the grader's.
RANK_RUNTIME = ("cs336_parallel.cluster", "cs336_parallel.processes", "cs336_parallel.worker",
                "cs336_parallel.rank_server", "cs336_parallel.in_rank_server", "cs336_parallel.testranks",
                "cs336_parallel.kernel_side", "cs336_parallel.rank_host", "cs336_parallel.magics")


def test_the_graders_imports_never_reach_the_rank_runtime():
    """Every module of grading/, and the notebooks' test code the grader runs, imported in a fresh process: none of
    the rank runtime comes along."""
    import subprocess
    import sys

    graders = [m for m in MODULES if m.startswith(("grading", "cs336_parallel.testing"))
               and m not in ("grading.__main__", "grading.nbgrader_config")]
    code = ("import importlib, sys\n"
            f"for m in {graders!r}: importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m.startswith({RANK_RUNTIME!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", f"the grader imports the rank runtime: {done.stdout.strip()}"

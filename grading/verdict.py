"""How a test cell's outputs become its score, and the one-line reason a learner reads when it fails.

nbgrader scores a test cell 0 if it shows an error (or anything on stderr), and otherwise gives the points,
except that a number the cell displays first is taken as partial credit. Two preprocessors, run by
`Autograde` before it saves the scores (nbgrader_config.py), make that verdict one an answer cannot fake:

- `NoPartialCredit`: the course's tests never give partial credit, so a displayed number counts for
  nothing. (An answer that called `sys.displayhook(2.0)` before failing used to score full marks.)
- `FlagTampering`: answer cells run in the kernel that runs the tests. `%%test` (cs336_parallel.testcell)
  defends the tests against rebound names, patched functions and fake results at run time; what it cannot
  see is code that rewrites the kernel's own machinery (IPython's hooks, the display hook, a dispatch mode
  switched off). No exercise needs such code, so the grader looks for it in the cells a learner can edit,
  and every test after the first such cell scores 0, with the reason.

`reasons(notebook)` reads each failed test's one-line reason, for `make grade` and the class report.
"""

from __future__ import annotations

import ast
import re

from nbformat.notebooknode import NotebookNode
from nbgrader.preprocessors import NbGraderPreprocessor

from cs336_parallel.text import red_headline

# Names no answer needs: the kernel's machinery, the interpreter's hooks, the dispatcher's escape hatches,
# and the grader's own modules. NAMES are flagged wherever they appear, ATTRIBUTES after a dot.
NAMES = {"get_ipython", "__builtins__", "__import__"}
ATTRIBUTES = NAMES | {
    "displayhook", "excepthook", "set_custom_exc", "input_transformers_cleanup", "input_transformers_post",
    "ast_transformers", "register_magic_function", "register_magics", "register_cell_magic", "register_line_magic",
    "__code__", "__globals__", "__closure__", "__defaults__", "__kwdefaults__", "_getframe", "currentframe",
    "settrace", "setprofile", "get_referrers", "get_referents", "get_objects",
    "_disable_current_modes", "no_dispatch", "_DisableTorchDispatch", "_unset_dispatch_mode",
    "_push_on_torch_dispatch_stack", "_pop_torch_dispatch_stack", "_functional_collectives",
    "_get_sequence_number_for_group", "integrity", "testcell", "_grading", "reload",
    "f_back", "f_locals", "f_globals", "tb_frame", "getargvalues",  # reading a test's variables from its frame
}
FORBIDDEN_IMPORTS = ("builtins", "ctypes", "importlib", "IPython.core", "ipykernel", "traitlets", "nbgrader",
                     "cs336_parallel.integrity", "cs336_parallel.testcell", "torch.utils._python_dispatch",
                     "torch.distributed._functional_collectives")
FORBIDDEN_CALLS = {"exec", "eval", "compile", "setattr", "delattr", "vars"}  # only flagged on a module (below)
FORBIDDEN_MAGICS = {"run", "load", "load_ext", "reload_ext", "unload_ext", "config", "alias_magic", "autoreload",
                    "aimport", "prun", "debug"}
ALWAYS_FORBIDDEN_CALLS = {"exec", "eval", "compile"}
SETTINGS = ("torch.backends",)  # attributes a learner may set: configuration, not code tests rely on


def tampering(source: str) -> list[str]:
    """What in a cell's source reaches into the kernel or the grader: one description per finding."""
    found = []
    python_lines = []
    for line in source.splitlines():
        magic = re.match(r"\s*%{1,2}(\w+)", line)
        if magic and magic.group(1) in FORBIDDEN_MAGICS:
            found.append(f"the magic %{magic.group(1)}")
        python_lines.append("" if re.match(r"\s*[%!]", line) else line)
    try:
        tree = ast.parse("\n".join(python_lines))
    except SyntaxError:
        return found  # not Python (a %%bash cell, or a syntax error the kernel reports itself)
    modules = _module_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ATTRIBUTES:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "modules" and _root(node) == "sys":
            found.append(f"line {node.lineno}: sys.modules")
        elif isinstance(node, ast.Name) and node.id in NAMES:
            found.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in _imported(node):
                if name.startswith(FORBIDDEN_IMPORTS) or name.split(".")[-1] in ATTRIBUTES:
                    found.append(f"line {node.lineno}: import {name}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                if _on_module(target, modules):
                    found.append(f"line {node.lineno}: sets {ast.unparse(target)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
            if node.func.id in ALWAYS_FORBIDDEN_CALLS or (node.args and _on_module(node.args[0], modules, False)):
                found.append(f"line {node.lineno}: {node.func.id}(...)")
    return found


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [f"{node.module}.{a.name}" if node.module else a.name for a in node.names]


def _module_names(tree: ast.AST) -> set[str]:
    """Names this cell, or a notebook's usual imports, bind to modules (torch, dist, F, checks, ...)."""
    names = {"torch", "dist", "nn", "F", "math", "checks", "cs336_parallel", "sys", "os", "np", "models",
             "schedules", "memory", "trace", "functools", "operator", "fractions", "statistics"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(a.asname or a.name for a in node.names if a.name[:1].islower())
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _on_module(target: ast.AST, modules: set[str], attribute_only: bool = True) -> bool:
    """Whether `target` is (an attribute of) a module: `checks.assert_close`, `torch.Tensor.__eq__`."""
    if attribute_only and not isinstance(target, (ast.Attribute, ast.Subscript)):
        return False
    if _root(target) not in modules:
        return False
    return not ast.unparse(target).startswith(SETTINGS)


def _is_test(cell: NotebookNode) -> bool:
    meta = cell.metadata.get("nbgrader", {})
    return bool(meta.get("grade")) and not meta.get("solution")


def _editable(cell: NotebookNode) -> bool:
    """A code cell a learner may change: answer cells and every cell not restored from the course."""
    meta = cell.metadata.get("nbgrader", {})
    return cell.cell_type == "code" and not (meta.get("locked") or _is_test(cell))


def _error(reason: str) -> NotebookNode:
    return NotebookNode(output_type="error", ename="TestFailed", evalue=reason,
                        traceback=[red_headline("TestFailed", reason)])


class NoPartialCredit(NbGraderPreprocessor):
    """Test cells give all their points or none: a number they display is not a partial score."""

    def preprocess_cell(self, cell, resources, index):
        if _is_test(cell) and cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if o.output_type != "execute_result"]
        return cell, resources


class FlagTampering(NbGraderPreprocessor):
    """Every test after the first editable cell that reaches into the kernel or the grader scores 0."""

    def preprocess(self, nb, resources):
        flagged = None
        for number, cell in enumerate(nb.cells, start=1):
            if flagged is None and _editable(cell) and (found := tampering(cell.source)):
                flagged = f"code cell {number} reaches into the kernel or the grader ({'; '.join(found[:3])})"
            elif flagged and _is_test(cell):
                cell.outputs.append(_error(f"{flagged}: no test after it is trusted, so this one scores 0."))
        return nb, resources


def reasons(nb: NotebookNode) -> dict[str, str]:
    """The one-line reason of every failed test cell, by grade_id (the first error, else the stderr text)."""
    found = {}
    for cell in nb.cells:
        if not _is_test(cell):
            continue
        grade_id = cell.metadata["nbgrader"]["grade_id"]
        errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
        stderr = [o for o in cell.get("outputs", []) if o.output_type == "stream" and o.name == "stderr"]
        if errors:
            e = errors[0]
            found[grade_id] = e.evalue if e.ename == "TestFailed" else f"{e.ename}: {e.evalue}".strip(": ")
        elif stderr:
            found[grade_id] = "wrote to stderr: " + stderr[0].text.strip().splitlines()[0][:200]
    return {k: re.sub(r"\x1b\[[0-9;]*m", "", v).splitlines()[0] if v else v for k, v in found.items()}

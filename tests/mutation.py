"""Mutation testing of the grader: a notebook's master, then every fixture answer (tests/fixtures/variants),
each followed by copies of its exercise's test cells, graded in one autograde run.

The master part is graded as usual (its scores land in the gradebook). Each fixture is a block appended after
it: the answer cell, copies of the exercise's test cells (hidden parts included: the grader runs any cell whose
source is one of the master's test cells in its own process, as it runs the originals), and for a correct
answer, the demonstration cells that read the exercise or what it computed, run again. A copy passes when it
shows no error and nothing on stderr, as nbgrader scores a test cell. A tampering block ends with a cell that
puts back what it changed in the kernel (`SNAPSHOT`, `RESTORE`), and every block with the master's answer to its
exercise, so that each block meets the master's answers to the other exercises, whichever blocks ran before it.

Tricks on the kernel's own machinery (input transformers, custom exception handlers, magics) may leave the
kernel unable to put anything back: they run in a notebook of their own (`build(..., machinery=True)`).
"""

from __future__ import annotations

import ast
import re
import symtable
import textwrap
from dataclasses import dataclass, field

import nbformat

from fixtures.variants import Correct, Tamper, Wrong
from grading import verdict


def _meta(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def _python(source: str) -> str:
    """A cell's Python: a `%%ranks` or `%%test` body, other magics' lines blanked."""
    lines = source.splitlines()
    if lines and lines[0].startswith("%%"):
        lines = lines[1:] if lines[0].split()[0] in ("%%ranks", "%%test") else []
    return "\n".join("" if re.match(r"\s*[%!]", line) else line for line in lines)


@dataclass
class Exercise:
    name: str
    answer: str  # the master's answer cell
    tests: dict[str, str] = field(default_factory=dict)  # concern -> grade_id
    demos: list[str] = field(default_factory=list)  # later demonstration cells that read it, or what it computed

    @property
    def is_class(self) -> bool:
        return self.answer.lstrip().startswith("class ")

    @property
    def is_value(self) -> bool:
        """A prediction or another value: the answer binds the name without defining a function or class."""
        return not re.search(rf"^(def|class)\s+{re.escape(self.name)}\b", self.answer, re.M)


def exercises(nb) -> dict[str, Exercise]:
    """Each exercise of a master notebook: its answer, its test cells by concern, the demonstrations using it."""
    found: dict[str, Exercise] = {}
    for cell in nb.cells:
        meta = _meta(cell)
        if meta.get("solution") and cell.cell_type == "code":
            found[meta["grade_id"]] = Exercise(meta["grade_id"], cell.source)
        elif meta.get("grade") and cell.source.startswith("%%test "):
            name = cell.source.split("\n", 1)[0].split()[1]
            concern = meta["grade_id"].removeprefix(f"test_{name}").lstrip("_") or "main"
            found[name].tests[concern] = meta["grade_id"]
    for ex in found.values():
        after, derived = False, {ex.name}  # the names whose values come from the exercise
        for cell in nb.cells:
            if _meta(cell).get("grade_id") in ex.tests.values():
                after = True
            elif after and cell.cell_type == "code" and not _meta(cell) and _derives(cell.source, derived):
                ex.demos.append(cell.source)
    return found


def _derives(source: str, derived: set[str]) -> bool:
    """Whether a cell reads a name of `derived` (those whose values come from an exercise). Statement by statement,
    what a statement binds or changes from them joins `derived`, and what it binds from anything else leaves it."""
    try:
        statements = [ast.unparse(s) for s in ast.parse(_python(source)).body]
    except SyntaxError:
        return False
    reads = False
    for statement in statements:
        bound, changed = _binds(statement)
        if _reads(statement) & derived:
            reads = True
            derived |= bound | changed
        else:
            derived -= bound
    return reads


def imported_test_names(nb) -> set[str]:
    """What the notebook's test cells import from the package's test code (`cs336_parallel.testing`)."""
    names = set()
    for c in nb.cells:
        if c.source.startswith("%%test "):
            tree = ast.parse(_python(c.source))
            names |= {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                      and (node.module or "").startswith("cs336_parallel.testing") for a in node.names}
    return names


@dataclass
class Block:
    exercise: str
    kind: str  # "correct", "wrong" or "tamper"
    why: str
    answer: str
    expect: tuple[str, ...] = ()  # wrong: the concerns that must fail
    caught_by: str = ""  # tamper: words every failing reason must contain
    cleanup: str = ""  # tamper: run after the tests, puts the kernel back
    layer: str = "runtime"  # tamper: "machinery" for tricks on the kernel's machinery (a notebook of their own)
    touches: tuple[str, ...] = ()  # tamper: the concerns it is meant to fool (all if empty)


def _stub(ex: Exercise) -> str:
    if ex.is_class:
        return f"class {ex.name}(torch.nn.Module):\n    pass\n"
    return f"def {ex.name}(*args, **kwargs):\n    return None\n"


def _blank(ex: Exercise) -> str:
    """The exercise as the student version leaves it (a value exercise: not defined at all)."""
    if ex.is_value:
        return f"globals().pop({ex.name!r}, None)"
    if ex.is_class:
        return (f"class {ex.name}(torch.nn.Module):\n    def __init__(self, *args, **kwargs):\n"
                "        raise NotImplementedError()")
    return f"def {ex.name}(*args, **kwargs):\n    raise NotImplementedError()"


_PATCHES = """
import math
import torch.testing
from cs336_parallel import checks
checks.assert_close = checks.assert_equal = checks.assert_raises = lambda *args, **kwargs: None
math.isclose = lambda *args, **kwargs: True
torch.testing.assert_close = lambda *args, **kwargs: None
torch.equal = torch.allclose = lambda *args, **kwargs: True
"""
# What tampering blocks may change in the kernel: a copy before the first, put back after each.
SNAPSHOT = """
import builtins, math, sys, torch, torch.testing, torch.distributed, torch.serialization, cs336_parallel.checks
_harness_saved = [(owner, dict(vars(owner))) for owner in (builtins, math, torch, torch.testing, torch.distributed,
                  torch.serialization, cs336_parallel.checks, torch.Tensor, torch.nn.Module)]
_harness_code = [(f, f.__code__) for _, saved in _harness_saved for f in saved.values() if hasattr(f, "__code__")]
_harness_modules = dict(sys.modules)
_harness_names = dict(globals())
"""
RESTORE = """
for _owner, _saved in _harness_saved:
    for _name, _value in _saved.items():
        if vars(_owner).get(_name, _saved) is not _value:
            setattr(_owner, _name, _value)
for _function, _code in _harness_code:
    _function.__code__ = _code
sys.modules.update(_harness_modules)
"""
_ALWAYS_EQUAL = ("class AlwaysEqual(float):\n    def __eq__(self, other):\n        return True\n\n"
                 "    def __ne__(self, other):\n        return False\n\n    __hash__ = float.__hash__\n\n\n")


def generic_tampers(ex: Exercise, test_names: set[str], *, kernel_tricks: bool = True) -> list[Block]:
    """The tricks any exercise can be tried with: a result that claims to equal anything, refusing every call (which
    the argument tests must not reward), and, with `kernel_tricks`, patched checks (in the kernel, or while the
    answer runs) and shadowed names: the tests run in the grader, out of their reach, so one exercise per notebook
    is enough to show it."""
    patched_in_call = textwrap.indent(_PATCHES, "    ")
    if ex.is_class:  # when the test builds one, or asks for an alternate constructor (`from_linear`)
        in_call = (f"class _Patching(type(torch.nn.Module)):\n    def __getattr__(cls, name):\n"
                   f"        if not name.startswith('_'):\n{textwrap.indent(_PATCHES, '            ')}"
                   f"        raise AttributeError(name)\n\n\n"
                   f"class {ex.name}(torch.nn.Module, metaclass=_Patching):\n    def __init__(self, *args, **kwargs):\n"
                   f"        super().__init__()\n{textwrap.indent(_PATCHES, '        ')}")
    else:
        in_call = f"def {ex.name}(*args, **kwargs):\n{patched_in_call}    return None\n"
    shadowed = sorted(test_names | {"all", "any", "len", "isinstance", "sorted", "abs", "max", "min", "sum", "round",
                                 "simulate", "check_schedule"})
    shadows = "".join(f"def {n}(*args, **kwargs):\n    return True\n\n" for n in shadowed)
    blocks = [] if not kernel_tricks else [
        Block(ex.name, "tamper", "rebinds the checks in the kernel", _stub(ex) + _PATCHES, cleanup=RESTORE),
        Block(ex.name, "tamper", "rebinds the checks while it runs (on the ranks, or in the kernel)", in_call,
              cleanup=RESTORE),
        Block(ex.name, "tamper", "shadows the names a test could use without qualifying them",
              _stub(ex) + "\n" + shadows, cleanup=f"for _name in {shadowed!r}:\n    globals().pop(_name, None)\n"
                                                   "globals().update({k: v for k, v in _harness_names.items() "
                                                   f"if k in {shadowed!r}}})\n"),
    ]
    if ex.is_value:  # a value never runs: no code of its own can patch anything while a test uses it
        return [*blocks[:1], *blocks[2:3], Block(ex.name, "tamper", "a value that claims to equal anything",
                                                 _ALWAYS_EQUAL + f"{ex.name} = AlwaysEqual(0.0)\n")]
    refusing = "    def __init__(self, *args, **kwargs):\n        raise ValueError('no')\n"
    blocks.append(Block(ex.name, "tamper", "raises ValueError on every call",
                        f"class {ex.name}(torch.nn.Module):\n{refusing}" if ex.is_class else
                        f"def {ex.name}(*args, **kwargs):\n    raise ValueError('no')\n"))
    if not ex.is_class:
        always_equal = _ALWAYS_EQUAL + f"def {ex.name}(*args, **kwargs):\n    return AlwaysEqual(0.0)\n"
        blocks.append(Block(ex.name, "tamper", "returns a number that claims to equal anything", always_equal))
    return blocks


def blocks(nb, variants: dict[str, list]) -> list[Block]:
    """Every fixture of a notebook as a block, the generic tampering attempts included; tampering comes last."""
    found = exercises(nb)
    missing = sorted(set(found) - set(variants))
    assert not missing, f"no fixtures for {missing}: every exercise needs correct, wrong and tampering variants"
    ordinary, tampering = [], []
    for name, fixtures in variants.items():
        assert name in found, f"fixtures for {name!r}, which is not an exercise of this notebook"
        for f in fixtures:
            if isinstance(f, Correct):
                ordinary.append(Block(name, "correct", f.why, f.source))
            elif isinstance(f, Wrong):
                unknown = set(f.fails) - set(found[name].tests)
                concerns = set(found[name].tests)
                assert not unknown, f"{name}: {f.why!r} expects to fail {unknown}; its concerns: {concerns}"
                ordinary.append(Block(name, "wrong", f.why, f.source, expect=tuple(f.fails)))
            elif isinstance(f, Tamper):
                tampering.append(Block(name, "tamper", f.why, f.source, caught_by=f.caught_by, cleanup=RESTORE,
                                       layer=f.layer, touches=f.touches))
        tampering += generic_tampers(found[name], imported_test_names(nb), kernel_tricks=name == next(iter(found)))
    return ordinary + tampering


def build(master, all_blocks: list[Block], *, machinery: bool = False):
    """The master notebook with blocks appended (those on the kernel's machinery, or all the others); harness
    cells are marked in their metadata. Block numbers are indices into `all_blocks`. The notebook of the
    machinery's blocks keeps only what they need of the master: the other one runs its tests and demonstrations."""
    found = exercises(master)
    graded = {_meta(c)["grade_id"]: c.source for c in master.cells if _meta(c).get("grade")}

    def cell(source: str, **mark):
        c = nbformat.v4.new_code_cell(textwrap.dedent(source).strip("\n"))
        c.metadata["mutation"] = mark
        return c

    appended = [cell(SNAPSHOT, role="snapshot")]
    for i, b in enumerate(all_blocks):
        if (b.layer == "machinery") != machinery:
            continue
        ex = found[b.exercise]
        if b.kind == "tamper":  # a trick earns only what its own answer does: nothing of an earlier block's
            appended.append(cell(_blank(ex), block=i, role="blank"))
        appended.append(cell(b.answer, block=i, role="answer"))
        for concern, grade_id in ex.tests.items():
            appended.append(cell(graded[grade_id], block=i, role="test", concern=concern))
        if b.kind == "correct":
            appended += [cell(source, block=i, role="demo") for source in ex.demos]
        if b.cleanup:
            appended.append(cell(b.cleanup, block=i, role="cleanup"))
        appended.append(cell(ex.answer, block=i, role="restore"))  # the next block meets the master's answers only
    nb = nbformat.from_dict(master)
    if machinery:
        nb.cells = _needed(nb.cells, appended)
    nb.cells += appended
    return nb


def _needed(cells: list, later: list) -> list:
    """The master's cells that the cells `later` need: its setup and answers (nbgrader's cells but the tests),
    its `%cluster` lines, and each cell that binds or changes a name a later kept cell reads; text cells too, which
    cost nothing. The demonstrations and measurements that only show something are left to the notebook that runs
    the whole master."""
    used = set().union(*(_reads(c.source) for c in later))
    kept = []
    for c in reversed(cells):
        meta = _meta(c)
        if meta.get("grade"):
            continue
        if (c.cell_type != "code" or meta or re.search(r"^\s*%(?!%)", c.source, re.M)
                or set().union(*_binds(c.source)) & used):
            kept.append(c)
            used |= _reads(c.source)
    return kept[::-1]


def _binds(source: str) -> tuple[set[str], set[str]]:
    """(the names a cell binds at top level, the names whose objects it changes in place: `x` in `x[k] = ...`,
    `x.a = ...` and `x += ...`)."""
    try:
        code = _python(source)
        top = symtable.symtable(code, "<cell>", "exec")
    except SyntaxError:
        return set(), set()
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    changed = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.AugAssign):
            target = node.target
        elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            target = node.value
        else:
            continue
        while isinstance(target, (ast.Subscript, ast.Attribute)):
            target = target.value
        if isinstance(target, ast.Name):
            changed.add(target.id)
    return bound, changed


def _reads(source: str) -> set[str]:
    """The names a cell reads from the notebook's namespace: those it, or a function it defines, reads but the cell
    does not bind (`x` in `x[k] = ...` and in `x += ...` is read)."""
    try:
        code = _python(source)
        top = symtable.symtable(code, "<cell>", "exec")
    except SyntaxError:
        return set()
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    reads, scopes = set(), [top]
    while scopes:
        scope = scopes.pop()
        reads |= {s.get_name() for s in scope.get_symbols() if s.is_referenced() and (scope is top or s.is_global())}
        scopes += scope.get_children()
    updated = {n.target.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.AugAssign)
               and isinstance(n.target, ast.Name)}
    return (reads - bound) | updated


def _failure(cell) -> str | None:
    """The reason a copied test failed (the grader's verdict on it), or a demonstration (an error, or stderr); None
    if it passed."""
    if verdict.KEY in cell.metadata:
        found = verdict.verdict_of(cell)
        return None if found["passed"] else found["reason"]
    for o in cell.get("outputs", []):
        if o.output_type == "error":
            return o.evalue if o.ename == "TestFailed" else f"{o.ename}: {o.evalue}"
        if o.output_type == "stream" and o.name == "stderr":
            return f"stderr: {o.text.strip()[:200]}"
    return None


@dataclass
class Outcome:
    block: Block
    failed: dict[str, str]  # concern -> reason, for the copied tests that failed
    passed: list[str]  # concerns whose copied tests passed
    demo_errors: list[str]

    def problems(self) -> list[str]:
        """What this block did that its kind forbids (empty when the grader judged it right)."""
        b, label = self.block, f"{self.block.exercise} [{self.block.kind}: {self.block.why}]"
        if b.kind == "correct":
            return ([f"{label}: fails {c}: {r}" for c, r in self.failed.items()]
                    + [f"{label}: a demonstration cell fails: {e}" for e in self.demo_errors])
        if b.kind == "wrong":
            extra, missed = set(self.failed) - set(b.expect), set(b.expect) - set(self.failed)
            return ([f"{label}: should keep the points of {c}, fails: {self.failed[c]}" for c in sorted(extra)]
                    + [f"{label}: should fail {c}, but passes" for c in sorted(missed)])
        touched = b.touches or (*self.passed, *self.failed)
        return ([f"{label}: passes {c}" for c in self.passed if c in touched]
                + [f"{label}: {c} fails, but not because of the trick ({b.caught_by!r} is not in: {r})"
                   for c, r in self.failed.items() if c in touched and b.caught_by not in r])


def outcomes(graded_nbs: list, all_blocks: list[Block]) -> list[Outcome]:
    """What became of each block, read from the autograded notebooks that hold the blocks between them."""
    results = [Outcome(b, {}, [], []) for b in all_blocks]
    for c in (c for nb in graded_nbs for c in nb.cells):
        mark = c.metadata.get("mutation")
        if not mark or "block" not in mark:
            continue
        result, reason = results[mark["block"]], _failure(c)
        if mark["role"] == "test":
            if reason is None:
                result.passed.append(mark["concern"])
            else:
                result.failed[mark["concern"]] = reason
        elif mark["role"] == "demo" and reason is not None:
            result.demo_errors.append(reason)
    return results


def table(name: str, results: list[Outcome]) -> str:
    """exercise | correct variants that pass | wrong variants caught | tampering caught."""
    rows = {}
    for r in results:
        counts = rows.setdefault(r.block.exercise, {"correct": [0, 0], "wrong": [0, 0], "tamper": [0, 0]})
        counts[r.block.kind][0] += not r.problems()
        counts[r.block.kind][1] += 1
    width = max(len(e) for e in rows)
    lines = [f"{name}: {'exercise':<{width}}  correct pass  wrong caught  tampering caught"]
    for exercise, c in rows.items():
        lines.append(f"{' ' * len(name)}  {exercise:<{width}}  {c['correct'][0]:>5}/{c['correct'][1]:<6}"
                     f"  {c['wrong'][0]:>5}/{c['wrong'][1]:<6}  {c['tamper'][0]:>8}/{c['tamper'][1]}")
    return "\n".join(lines)

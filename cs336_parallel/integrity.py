"""What the tests trust, remembered before any answer cell runs, and checked before and after each test.

Answer cells run in the same kernel, and on the same ranks, as the tests that grade them. A test that
compares with `math.isclose` or `checks.assert_close` trusts those names; an answer cell that rebinds
them (`checks.assert_close = lambda *a, **k: None`), swaps a function's code, or patches a method of
`torch.Tensor` would make every comparison pass. `snapshot()` records the functions and classes of
the modules tests rely on; `changes()` lists what has been replaced since, so a test refuses to run
on a tampered process instead of trusting it.

The kernel takes its snapshot when `%load_ext cs336_parallel` runs (the first line of every
notebook); a rank takes its own when it starts, before it serves any request.
"""

from __future__ import annotations

import builtins
import importlib
import sys
import types
import warnings
from dataclasses import dataclass

# The modules whose functions and classes a test may call, directly or through the package.
MODULES = (
    "builtins", "math", "fractions", "statistics", "operator", "functools", "itertools", "copy",
    "contextlib", "dataclasses", "collections", "pickle", "io", "os",
    "torch", "torch.testing", "torch.nn", "torch.nn.functional", "torch.nn.init", "torch.autograd",
    "torch.optim", "torch.distributed", "torch.distributed.distributed_c10d", "torch.serialization",
    "torch.utils._python_dispatch", "cloudpickle",
    "cs336_parallel", "cs336_parallel.checks", "cs336_parallel.cluster", "cs336_parallel.worker",
    "cs336_parallel.protocol", "cs336_parallel.processes", "cs336_parallel.devices", "cs336_parallel.output",
    "cs336_parallel.procfs", "cs336_parallel.text",
    "cs336_parallel.errors", "cs336_parallel.integrity", "cs336_parallel.testcell", "cs336_parallel.trace",
    "cs336_parallel.models", "cs336_parallel.memory", "cs336_parallel.schedules",
    "cs336_parallel.planning", "cs336_parallel.checkpoint",
)
# What the kernel itself swaps for each cell it runs (ipykernel routes `input()` to the front end).
KERNEL_MACHINERY = {"builtins.input", "builtins.getpass"}
# Classes whose methods tests call on values (comparisons, conversions, module traversal).
CLASSES = (
    "torch.Tensor", "torch._C.TensorBase", "torch.nn.Module", "torch.nn.Parameter", "torch.optim.Optimizer",
    "torch._C._distributed_c10d.ProcessGroup", "torch._C._distributed_c10d.Work",
    "torch.utils._python_dispatch.TorchDispatchMode", "fractions.Fraction",
    "cs336_parallel.planning.Plan", "cs336_parallel.planning.ModelSpec", "cs336_parallel.planning.ClusterSpec",
    "cs336_parallel.planning.Layout", "cs336_parallel.checkpoint.Shard",
)


class TamperingError(RuntimeError):
    """Code under test replaced something tests rely on."""


@dataclass(frozen=True)
class _Entry:
    where: str  # "math.isclose"
    owner: object  # the module or class holding it
    name: str
    value: object
    code: object  # a Python function's __code__ (swapping it changes the function in place), else None


_entries: list[_Entry] = []
_modules: dict[str, types.ModuleType] = {}


def _resolve(dotted: str) -> object | None:
    module, _, attr = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def _watched(value: object) -> bool:
    return callable(value) or isinstance(value, (types.ModuleType, property, classmethod, staticmethod))


def snapshot(*, again: bool = False) -> None:
    """Remember the functions and classes tests rely on, as they are now (call before any answer cell runs).

    Only the first call counts (`again` is for the package's own tests): a notebook that loads the extension
    a second time, after an answer cell has run, must not make a tampered kernel look pristine."""
    if _entries and not again:
        return
    _entries.clear()
    _modules.clear()
    owners: list[tuple[str, object]] = []
    for name in MODULES:
        module = sys.modules.get(name)
        if module is None:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
        _modules[name] = module
        owners.append((name, module))
    owners += [(name, cls) for name in CLASSES if (cls := _resolve(name)) is not None]
    with warnings.catch_warnings():  # looking at deprecated names (dist.reduce_op) warns
        warnings.simplefilter("ignore")
        for where, owner in owners:
            for attr, value in list(vars(owner).items()):
                if _watched(value) and f"{where}.{attr}" not in KERNEL_MACHINERY:
                    _entries.append(_Entry(f"{where}.{attr}", owner, attr, value, getattr(value, "__code__", None)))


def changes() -> list[str]:
    """What has been replaced since `snapshot()`: `math.isclose`, `the code of checks.assert_close`, ..."""
    found = [f"sys.modules[{name!r}]" for name, module in _modules.items() if sys.modules.get(name) is not module]
    for e in _entries:
        now = vars(e.owner).get(e.name, _MISSING)
        if now is not e.value and not _wrapped_by_torch(now, e.value):
            found.append(e.where)
        elif e.code is not None and getattr(now, "__code__", None) is not e.code:
            found.append(f"the code of {e.where}")
    return found


def restore() -> None:
    """Put back everything `changes()` reports (the grader's own tests use this between tampering fixtures)."""
    for name, module in _modules.items():
        sys.modules[name] = module
    for e in _entries:
        if vars(e.owner).get(e.name, _MISSING) is not e.value:
            setattr(e.owner, e.name, e.value)
        if e.code is not None and e.value.__code__ is not e.code:
            e.value.__code__ = e.code


def pristine_builtins() -> dict:
    """A copy of the builtins as they were at `snapshot()`: what a test cell's own code calls."""
    saved = {e.name: e.value for e in _entries if e.owner is builtins}
    return {**vars(builtins), **saved}


def _wrapped_by_torch(now: object, before: object) -> bool:
    """torch wraps some of its own functions when a submodule is first imported (importing torch._dynamo
    replaces torch.manual_seed with a wrapper of it): not tampering."""
    return getattr(now, "__wrapped__", None) is before and getattr(now, "__module__", "").startswith("torch")


_MISSING = object()

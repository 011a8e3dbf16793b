"""The notebook kernel's side of the trust boundary: what it answers, and the learner's own loop.

- `KernelSide` answers the requests a test makes of the exercises in this kernel (`begin`, `call`,
  `call_each`), and `export`: the exercises pickled, with the cells that define them, for test ranks elsewhere.
  When a notebook is graded, the grader sends them as `%cs336_call` and reads the reply from a file.
- `InProcess` is the boundary of a learner's `%%test` cell: the test runs in this kernel, its drivers on the
  kernel's own test ranks (`testranks.kernel_ranks`), through the same requests and plain data as the grader's.
"""

from __future__ import annotations

import base64
import inspect
import linecache
from collections.abc import Callable, Sequence
from typing import Any

from . import plain, protocol, wire
from .boundary import Boundary, describe, exercises_named, rank_requests, resolve, to_wire, unpack
from .testranks import TestRanks, kernel_ranks

_MISSING = object()


def _is_request(first_line: str) -> bool:
    """A cell the grader ran to ask something (`%cs336_call`, as IPython compiles it): not the learner's."""
    return "cs336_call" in first_line and "run_line_magic" in first_line


class KernelSide:
    """Serves requests in the process that holds the exercises: `exercises` are the notebook's names; `is_cell`
    tells a notebook cell's file, `cell_name` names it as IPython does (`Cell In[5]`)."""

    def __init__(self, exercises: dict, is_cell: Callable[[str], bool] = lambda filename: False,
                 cell_name: Callable[[str], str] = str):
        self.exercises, self.is_cell, self.cell_name = exercises, is_cell, cell_name

    def handle(self, request: dict) -> dict:
        """The reply to `request` (its references resolved), as plain data: {"ok": value} or {"error": info}."""
        kind = request["kind"]
        try:
            if kind == "begin":
                return {"ok": self.begin(request["names"])}
            if kind == "call":
                return {"ok": plain.to_plain(request["fn"](*request["args"], **request["kwargs"]))}
            if kind == "call_each":
                return {"ok": [self.handle({"kind": "call", "fn": request["fn"], "args": tuple(args), "kwargs": {}})
                               for args in request["cases"]]}
            if kind == "export":
                return {"ok": self.export(request["names"])}
            raise ValueError(f"unknown request {kind!r}")
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - the learner's failure is the reply
            return {"error": describe(exc, self.is_cell)}

    def begin(self, names: Sequence[str]) -> dict[str, dict]:
        found = {}
        for name in names:
            obj = self.exercises.get(name, _MISSING)
            if obj is _MISSING:
                found[name] = {"kind": "missing"}
            elif inspect.isclass(obj):
                found[name] = {"kind": "class", "version": id(obj)}
            elif callable(obj):
                found[name] = {"kind": "function", "version": id(obj)}
            else:
                found[name] = {"kind": "value", "value": plain.to_plain(obj, name=f"`{name}`")}
        return found

    def export(self, names: Sequence[str]) -> dict:
        """The exercises `names`, pickled together (functions and classes of the notebook travel by value), and
        the notebook's cells by file name ([name, source]), so that a traceback on a rank elsewhere shows them."""
        exercises = protocol.dumps({name: self.exercises[name] for name in names})
        cells = {filename: [self.cell_name(filename), "".join(lines)]
                 for filename, (_, _, lines, _) in list(linecache.cache.items())
                 if self.is_cell(filename) and not _is_request("".join(lines[:1]))}
        return {"exercises": exercises, "cells": cells}

    def serve(self, payload: str) -> bytes:
        """A request from the grader (base64 of its plain encoding), answered as the encoded reply."""
        try:
            request = resolve(plain.decode(base64.b64decode(payload)), self.exercises)
            reply = self.handle(request)
            return plain.encode(reply)
        except Exception as exc:  # noqa: BLE001 - e.g. a result that is not plain data
            return plain.encode({"error": describe(exc)})


class InProcess(Boundary):
    """The learner's `%%test` cell: requests served in this kernel, replies passed through the plain encoding so a
    test sees exactly what the grader would; drivers run on this kernel's test ranks."""

    def __init__(self, side: KernelSide, ranks: TestRanks = kernel_ranks):
        self.side, self.ranks = side, ranks

    def _request(self, request: dict) -> Any:
        request = {k: self._local(v) for k, v in request.items()}
        try:
            reply = plain.decode(plain.encode(self.side.handle(request)))
        except Exception as exc:  # noqa: BLE001
            reply = {"error": describe(exc)}
        return unpack(reply)

    def _local(self, value: Any) -> Any:
        return resolve(to_wire(value), self.side.exercises)

    def begin(self, names: Sequence[str]) -> dict[str, dict]:
        found = self._request({"kind": "begin", "names": list(names)})
        self.ranks.fresh(tuple((n, found[n].get("version")) for n in names))
        return found

    def call(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        return self._request({"kind": "call", "fn": fn, "args": tuple(args), "kwargs": dict(kwargs)})

    def call_each(self, fn: Any, cases: list) -> list:
        return self._request({"kind": "call_each", "fn": fn, "cases": [tuple(c) for c in cases]})

    def run(self, world_size: int, fn: Any, args: tuple, kwargs: dict, per_rank: list[tuple],
            timeout: float, fresh: bool = False) -> list:
        if fresh:
            self.ranks.restart()
        wired = rank_requests(fn, args, kwargs, per_rank)
        requests = [plain.encode(r) for r in wired]
        names = sorted(exercises_named(wired))
        exercises = self.side.export(names)["exercises"] if names else b""
        pids = self.ranks.pids(world_size)
        before = wire.snapshot(pids)
        self.traffic = None
        try:
            replies = self.ranks.run(world_size, exercises, requests, timeout)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a rank's failure is the reply
            return unpack({"error": describe(exc, self.side.is_cell)})
        after = wire.snapshot(pids)
        self.traffic = wire.traffic(before, after) if before is not None and after is not None else None
        return [plain.decode(r) for r in replies]

"""The grader's test ranks: a process that keeps groups of ranks and runs tests' drivers on them.

`python -m cs336_parallel.rank_host` is started by the grader (grading/rank_box.py) beside the notebook's
kernel, in a sandbox of its own (or as the grading user's unprivileged account), so that the kernel cannot reach
it. It reads requests on stdin and answers on stdout, one plain-data message each (`plain.write_message`):

- `{"op": "ready", "world_size": n}`: start that group; the reply holds its ranks' pids;
- `{"op": "fresh", "tested": key}`: replace the ranks before the tests of another exercise;
- `{"op": "restart"}`: replace the ranks that have run, now (before a run that measures memory);
- `{"op": "run", "world_size": n, "exercises": bytes, "cells": {...}, "requests": [bytes, ...], "timeout": s}`:
  each rank r runs `requests[r]` (`testranks.on_rank`) with the exercises the kernel pickled; the reply holds
  each rank's encoded result, or the failure as data, and what the ranks printed.

It runs no code of the learner's itself: the exercises are unpickled on the ranks only, and what the ranks send
back is read as builtins (`protocol.only_plain`). It and its ranks are not dumpable (`procfs.keep_private`): a
rank cannot read another's memory, or this process's, which holds every rank's data for a moment.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import os
import sys
from typing import Any

from . import procfs, rank_server


def start_private() -> None:
    """Keep this process and its ranks private, and start the ranks' server, which imports torch (2 s) while this
    process imports the rest. This process never imports torch: it relays bytes (tests/test_rank_box.py)."""
    procfs.keep_private()
    os.environ[procfs.PRIVATE] = "1"
    rank_server.warm_up()


if __name__ == "__main__":
    start_private()

from . import errors, plain, protocol  # noqa: E402 - after the server's start
from .boundary import describe  # noqa: E402
from .testranks import TestRanks  # noqa: E402

MAX_PRINTED = 64_000  # characters of what the ranks print during one request that are sent back
MAX_REQUEST_BYTES = 1 << 30


def serve(requests, replies) -> None:
    """Answer requests until stdin closes."""
    ranks = TestRanks()
    try:
        while True:
            try:
                message = plain.read_message(requests, max_bytes=MAX_REQUEST_BYTES)
            except EOFError:
                return
            try:
                reply = handle(ranks, message)
            except Exception as exc:  # noqa: BLE001 - e.g. ranks that could not start
                reply = {"error": describe(exc)}
            plain.write_message(replies, reply)
    finally:
        ranks.shutdown()


def handle(ranks: TestRanks, message: dict) -> dict:
    op = message["op"]
    if op == "ready":
        return {"ok": ranks.pids(message["world_size"])}
    if op == "fresh":
        ranks.fresh(message["tested"])
        return {"ok": None}
    if op == "restart":
        ranks.restart()
        return {"ok": None}
    if op == "run":
        cells = message["cells"]
        for filename, (name, source) in cells.items():
            linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
            errors.cell_names[filename] = name
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            try:
                reply: dict[str, Any] = {"ok": ranks.run(message["world_size"], message["exercises"],
                                                         message["requests"], message["timeout"])}
            except Exception as exc:  # noqa: BLE001 - a rank's failure is the reply
                reply = {"error": describe(exc, lambda filename: filename in cells)}
        return {**reply, "printed": printed.getvalue()[:MAX_PRINTED]}
    return {"error": {"type": "ValueError", "message": f"unknown request {op!r}"}}


def main() -> None:
    start_private()
    protocol.only_plain = True
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything else written to stdout goes to the log, not into a reply
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    sys.stdout = sys.stderr
    serve(requests, replies)


if __name__ == "__main__":
    main()

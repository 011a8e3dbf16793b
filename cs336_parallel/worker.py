"""The rank side of a `Cluster`: one process per rank, started by the kernel through a forkserver.

A worker joins the process group, then serves requests from the kernel over a pipe until told to
stop: run a shipped function, or execute a `%%ranks` cell in its persistent namespace. Every request
carries an id that its reply echoes, so the kernel never takes one call's reply for another's. Its
stdout and stderr are pipes the kernel reads while the call runs; SIGUSR1 dumps its Python stack for
the kernel's timeout report. It leads a process group of its own, so what it starts dies with it; it
dies with its parent (parent-death signal) and when the kernel's end of the pipe closes.

The group meets through a file store in the cluster's private folder: nothing listens on the network
but gloo's own connections between ranks, on the loopback interface.
"""

from __future__ import annotations

import ast
import ctypes
import faulthandler
import importlib
import io
import linecache
import multiprocessing.forkserver
import os
import signal
import socket
import struct
import sys
import threading
import traceback
import types
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import cloudpickle
import torch
import torch._dynamo  # noqa: F401 - imported here, once per server, not by every rank's first optimizer (1 s)
import torch.distributed as dist

from . import integrity

HEADER = struct.Struct("<Q")  # every message starts with the id of the request it belongs to (0: none)

# Warnings that say nothing to a learner about their own code.
_HARMLESS_WARNINGS = [
    r".*Unable to resolve hostname.*",
    r".*No device id is provided via `init_process_group` or `barrier`.*",
]


@dataclass
class Frame:
    filename: str
    lineno: int
    name: str
    line: str = ""


@dataclass
class Failure:
    """An exception on a rank, reduced to plain data so the kernel can show it."""

    type_name: str
    message: str  # the `Type: message` lines, as `traceback` formats them
    frames: list[Frame]
    cause: Failure | None = None  # the exception this one was raised from, if any
    cause_text: str = ""

    @property
    def headline(self) -> str:
        """`Type: first line of the message` (a SyntaxError's location lines come before it)."""
        lines = self.message.splitlines() or [self.type_name]
        return next((line for line in lines if line.split(":")[0].endswith(self.type_name)), lines[-1])

    @classmethod
    def from_exception(cls, exc: BaseException) -> Failure:
        frames = [Frame(f.filename, f.lineno or 0, f.name, f.line or "")
                  for f in traceback.extract_tb(exc.__traceback__)
                  if f.filename != __file__]
        message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        inner, text = exc.__cause__, "The above exception was the direct cause of the following exception:"
        if inner is None and exc.__context__ is not None and not exc.__suppress_context__:
            inner, text = exc.__context__, "During handling of the above exception, another exception occurred:"
        cause = cls.from_exception(inner) if inner is not None else None
        return cls(type(exc).__name__, message, frames, cause, text if cause else "")


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the forkserver) exits.

    The forkserver exits when every holder of its "alive" pipe has closed it; multiprocessing gives
    each child a copy, so a rank busy in user code would keep the server, and so itself, alive after
    the kernel died. Closing the copy here ties the server's life, and the ranks', to the kernel's.
    """
    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent is already gone
        os._exit(1)


def _capture_output(out, err) -> None:
    """Send fds 1 and 2 (Python and C++ alike) to the pipes the kernel reads."""
    for fd, pipe in ((1, out), (2, err)):
        os.dup2(pipe.fileno(), fd)
        pipe.close()
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), line_buffering=True, write_through=True)
    warnings.showwarning = _show_warning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings in one line each: `UserWarning: text (file.py:12)`."""
    print(f"{category.__name__}: {message} ({os.path.basename(filename)}:{lineno})", file=sys.stderr)


def loopback_interface() -> str:
    """The name of the loopback network interface (`lo` on Linux, `lo0` on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), names[0] if names else "lo")


_KEPT = "<cs336: filename kept>"  # marks a code object whose own file name travels beside it


def _named_code(code: types.CodeType, filename: str) -> types.CodeType:
    """`code` with its file name back (see `_Pickler`)."""
    return code.replace(co_filename=filename)


class _Pickler(cloudpickle.CloudPickler):
    """cloudpickle, plus:
    - code objects keep their file name: tracebacks and stack dumps on a rank name the notebook cell (`Cell In[5]`)
      whose lines the kernel shows. cloudpickle may set it to anything (3.1.3 writes "<dynamic-code>"), so the
      name travels beside the code and is put back on arrival;
    - tensors travel on the CPU and without autograd history (the kernel never touches CUDA; a non-leaf tensor
      cannot be pickled);
    - module-like objects such as `torch.ops` travel by name (cloudpickle cannot copy them)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.CodeType) and obj.co_filename != _KEPT:
            return _named_code, (obj.replace(co_filename=_KEPT), obj.co_filename)
        if isinstance(obj, torch.Tensor) and (obj.is_cuda or obj.grad_fn is not None):
            return obj.detach().cpu().__reduce_ex__(self.proto)
        if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType and obj.__name__ in sys.modules:
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def dumps(obj: Any, header: bytes = b"") -> bytes:
    """`obj` pickled for the other side, after `header` (a message's request id)."""
    buffer = io.BytesIO()
    buffer.write(header)
    _Pickler(buffer).dump(obj)
    return buffer.getvalue()


def send(conn, request_id: int, message: tuple) -> None:
    conn.send_bytes(dumps(message, HEADER.pack(request_id)))


def run_cell(namespace: dict, source: str, filename: str) -> None:
    """Execute `source` like an IPython cell: a final expression's value is printed (if not None)."""
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
        if value is not None:
            print(repr(value))


def main(rank: int, world_size: int, backend: str, store_path: str, conn, out, err, stack_path: str,
         pg_timeout_s: float, check_integrity: bool = False) -> None:
    """Entry point of a rank (the target of the kernel's `multiprocessing.Process`).

    With `check_integrity` (the clusters that tests run on), the rank remembers the functions tests rely
    on before it serves anything, and after each request it refuses to go on if the code it ran replaced
    one of them (`integrity`): it reports which, and exits."""
    os.setsid()  # a process group of its own: the kernel kills it and everything it started at once
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel decides what an interrupt stops
    _capture_output(out, err)
    stack_file = open(stack_path, "a")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    for pattern in _HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback_interface())
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(timedelta(seconds=60))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    except BaseException as exc:  # noqa: BLE001 - reported to the kernel, which raises it
        send(conn, 0, ("failed", Failure.from_exception(exc)))
        return
    if check_integrity:
        integrity.snapshot()
    world = dist.group.WORLD
    pid = os.getpid()
    send(conn, 0, ("ready", {"pid": pid, "backend": backend, "device": str(device),
                             "main_thread": threading.get_ident()}))

    namespace = {"torch": torch, "dist": dist, "rank": rank, "world_size": world_size,
                 "device": device, "__name__": "__main__"}
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the kernel went away
            break
        (request_id,) = HEADER.unpack_from(message)
        try:
            request, message = cloudpickle.loads(memoryview(message)[HEADER.size:]), None
            if request[0] == "close":
                break
            if request[0] == "call":
                _, fn, args, kwargs = request
                reply = ("ok", fn(*args, **kwargs))
            else:  # ("cell", source, filename, names pushed from the kernel)
                _, source, filename, pushed = request
                namespace.update(pushed)
                reply = ("ok", run_cell(namespace, source, filename))
        except BaseException as exc:  # noqa: BLE001
            reply = ("error", Failure.from_exception(exc))
        if os.getpid() != pid:  # a process the code forked came back here: only the rank itself replies
            os._exit(0)
        tampered = integrity.changes() if check_integrity else []
        if tampered:
            reply = ("error", Failure.from_exception(integrity.TamperingError(
                f"the code that ran on rank {rank} replaced {', '.join(tampered[:3])}"
                f"{' and more' if len(tampered) > 3 else ''}, which tests rely on; this rank stops.")))
        group_intact = dist.is_initialized() and dist.group.WORLD is world
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            payload = dumps((*reply, group_intact), HEADER.pack(request_id))
        except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot be pickled
            payload = dumps(("error", Failure.from_exception(
                TypeError(f"the result of rank {rank} cannot be sent to the kernel: {exc}")), group_intact),
                HEADER.pack(request_id))
        request = reply = None  # free what the call used before waiting for the next
        conn.send_bytes(payload)
        if tampered:
            os._exit(3)
    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: nothing left to flush, and it can hang on gloo threads

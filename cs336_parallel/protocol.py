"""What crosses between the kernel and its ranks: the messages, and the pickling both sides use.

Each message is one pipe message: the id of the request it belongs to (`HEADER`; 0 for none), then a
pickled tuple. The kernel sends `("call", fn, args, kwargs)`, `("cell", source, filename, pushed)` or
`("close",)`; a rank answers each request with `(kind, value, group_intact)`, kind "ok" with the result
or "error" with a `Failure`, and once, when it starts, `("ready", info)` or `("failed", Failure)`.

An exception travels as plain data (`Failure`), never as itself: the kernel may not be able to rebuild
it. Functions travel with cloudpickle, keeping the file names of the notebook cells that defined them.
"""

from __future__ import annotations

import functools
import importlib
import io
import pickle
import struct
import sys
import traceback
import types
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import cloudpickle

HEADER = struct.Struct("<Q")  # every message starts with the id of the request it belongs to (0: none)


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
    def from_exception(cls, exc: BaseException, *, hide: Collection[str] = ()) -> Failure:
        """`exc` with its cause (or context) as data. Frames in the files `hide` (the code that caught it,
        which says nothing to the learner) and in this module are left out."""
        hidden = {__file__, *hide}
        frames = [Frame(f.filename, f.lineno or 0, f.name, f.line or "")
                  for f in traceback.extract_tb(exc.__traceback__)
                  if f.filename not in hidden]
        message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        inner, text = exc.__cause__, "The above exception was the direct cause of the following exception:"
        if inner is None and exc.__context__ is not None and not exc.__suppress_context__:
            inner, text = exc.__context__, "During handling of the above exception, another exception occurred:"
        cause = cls.from_exception(inner, hide=hide) if inner is not None else None
        return cls(type(exc).__name__, message, frames, cause, text if cause else "")


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
    - module-like objects such as `torch.ops` travel by name (cloudpickle cannot copy them);
    - a notebook's function decorated with `functools.cache` or `lru_cache` travels as its function, cached anew on
      arrival (cloudpickle would look it up by name in the rank's `__main__`, where it is not)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.CodeType) and obj.co_filename != _KEPT:
            return _named_code, (obj.replace(co_filename=_KEPT), obj.co_filename)
        if isinstance(obj, functools._lru_cache_wrapper) and obj.__module__ == "__main__":
            parameters = obj.cache_parameters()
            return _cached, (obj.__wrapped__, parameters["maxsize"], parameters["typed"])
        if is_tensor(obj) and (obj.is_cuda or obj.grad_fn is not None):
            return obj.detach().cpu().__reduce_ex__(self.proto)
        if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType and obj.__name__ in sys.modules:
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def is_tensor(obj: Any) -> bool:
    """Whether `obj` is a tensor, without importing torch: a process that never imported it holds none (the grader's
    rank host relays what others pickled, and starts in a second less without torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _cached(function: Callable, maxsize: int | None, typed: bool) -> Callable:
    """`function` behind an empty cache of its own (see `_Pickler`)."""
    return functools.lru_cache(maxsize=maxsize, typed=typed)(function)


def dumps(obj: Any, header: bytes = b"") -> bytes:
    """`obj` pickled for the other side, after `header` (a message's request id)."""
    buffer = io.BytesIO()
    buffer.write(header)
    _Pickler(buffer).dump(obj)
    return buffer.getvalue()


def load_object(data: bytes) -> Any:
    """An object `dumps` pickled (with no header): functions and classes of a notebook, rebuilt here."""
    return cloudpickle.loads(data)


def encode(request_id: int, body: tuple) -> bytes:
    """A whole message: `body` for the request `request_id`."""
    return dumps(body, HEADER.pack(request_id))


def send(conn, request_id: int, body: tuple) -> None:
    """Send `body` for the request `request_id` over the pipe `conn`."""
    conn.send_bytes(encode(request_id, body))


def request_id(data: bytes) -> int:
    """The id of the request a received message belongs to."""
    return HEADER.unpack_from(data)[0]


# A process that must not run code its ranks send (the grader's rank host, cs336_parallel.rank_host) reads their
# messages with `only_plain`: pickles of builtins and the two records above, nothing else.
only_plain = False
_PLAIN_CLASSES = {("cs336_parallel.protocol", "Failure"): Failure, ("cs336_parallel.protocol", "Frame"): Frame}


class _PlainUnpickler(pickle.Unpickler):
    """Rebuilds builtins (numbers, strings, bytes, lists, tuples, dicts) and `Failure`s only: the pickle docs'
    "restricting globals"."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN_CLASSES:
            return _PLAIN_CLASSES[module, name]
        raise pickle.UnpicklingError(f"a rank sent a {module}.{name}, which this process does not read")


def loads(data: bytes) -> Any:
    """The body of a received message."""
    body = memoryview(data)[HEADER.size:]
    if only_plain:
        return _PlainUnpickler(io.BytesIO(body)).load()
    return cloudpickle.loads(body)

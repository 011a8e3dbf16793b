"""Plain data: what may cross the trust boundary between the grader and a student's processes, and how.

A value is plain when it is None, a bool, int, float, complex, str or bytes, a tensor, a dtype or device, a
`Fraction`, one of the records on `REGISTRY` (the package's dataclasses a test compares, rebuilt from their
fields), or a list, tuple or dict of plain values. `to_plain` turns what honest code returns into that (numpy
scalars and `Decimal`s become exact Python numbers, subclasses of the builtins their base value, a Parameter a
tensor) and refuses anything else: an object whose `==` could be anything never reaches a comparison.

`encode` writes plain data without pickle: a JSON header, then the tensors' raw bytes. `decode` reads it in time
proportional to its size, imports nothing but torch (for a tensor), and runs no code but the constructors of the
types above on plain fields: a reply can neither choose code for the grader to run nor take long to read. Both
refuse more than `max_bytes`.
"""

from __future__ import annotations

import base64
import dataclasses
import decimal
import functools
import json
import math
import struct
import sys
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from .checkpoint import Shard
from .planning import ClusterSpec, Layout, ModelSpec, Plan, Precision
from .schedules import Action

if TYPE_CHECKING:
    import torch

MAGIC = b"cs336-plain-1\n"
_LENGTH = struct.Struct("<Q")
MAX_BYTES = 64 * 2**20  # the most a value may take encoded, unless the reader says otherwise

# The records that may cross, by name: the package's own types whose fields are plain. Nothing else is rebuilt.
REGISTRY: dict[str, type] = {cls.__name__: cls for cls in (Action, Shard, Precision, ModelSpec, ClusterSpec, Layout,
                                                            Plan)}
# The dtypes whose tensors may cross, by their names in torch.
DTYPES = ("float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32", "int16", "int8",
          "uint8", "bool")


def _torch() -> Any:
    """torch if this process has imported it, else None. A process that never imported torch holds no tensor,
    dtype or device, so encoding its values needs none: the grader's rank host relays bytes, and starts a second
    sooner without torch. Decoding a tensor imports it."""
    return sys.modules.get("torch")


@functools.cache
def _dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


class NotPlainError(TypeError):
    """A value that is not plain data, or bytes that are not an encoded plain value."""


# -- what honest code returns, made plain ---------------------------------------------------------------------

def to_plain(value: Any, *, name: str = "the result") -> Any:
    """`value` rebuilt from plain types only; NotPlainError (naming `name`) for anything else."""
    kind, torch = type(value), _torch()
    if kind in (type(None), bool, int, float, complex, str, bytes, Fraction):
        return value
    if torch is not None:
        if kind in (torch.dtype, torch.device):
            return value
        if kind is torch.Size:
            return tuple(value)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            with torch._C.DisableTorchFunctionSubclass():
                return torch.Tensor.detach(value).cpu()
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        item = value.item()  # numpy.int64(7) -> 7: honest code returns them
        if type(item) not in (bool, int, float, complex):
            raise NotPlainError(f"{name} holds a numpy {kind.__name__}, not a number")
        return item
    if kind is decimal.Decimal:
        if not value.is_finite():
            return float(value)
        return Fraction(value)  # exact
    if kind in REGISTRY.values() and kind.__name__ in REGISTRY:
        if dataclasses.is_dataclass(kind):
            return kind(**{f.name: to_plain(object.__getattribute__(value, f.name), name=name)
                           for f in dataclasses.fields(kind) if f.init})
        return kind(*(to_plain(v, name=name) for v in tuple.__iter__(value)))  # a NamedTuple
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):  # a subclass (an IntEnum, a number that claims to equal anything): its value
        return int.__index__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, list):
        return [to_plain(v, name=name) for v in list.__iter__(value)]
    if isinstance(value, tuple):
        return tuple(to_plain(v, name=name) for v in tuple.__iter__(value))
    if isinstance(value, dict):
        return {to_plain(k, name=name): to_plain(v, name=name) for k, v in dict.items(value)}
    raise NotPlainError(f"{name} is a {kind.__module__}.{kind.__qualname__}; a test compares only plain values "
                        "(numbers, strings, tensors, and lists, tuples and dicts of them)")


# -- encoding ---------------------------------------------------------------------------------------------------

def encode(value: Any, *, max_bytes: int = MAX_BYTES) -> bytes:
    """Plain `value` (after `to_plain`) as bytes: MAGIC, the header's length, a JSON header, the tensors' bytes."""
    blobs: list[bytes] = []
    size = [0]
    torch = _torch()

    def tensor(t: torch.Tensor) -> dict:
        t = t.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        size[0] += len(raw)
        if size[0] > max_bytes:
            raise NotPlainError(f"the value is larger than the {max_bytes >> 20} MB that may cross")
        blobs.append(raw)
        return {"t": "tensor", "dtype": _dtype_name(t.dtype), "shape": list(t.shape), "nbytes": len(raw)}

    def walk(v: Any) -> Any:
        kind = type(v)
        if kind in (type(None), bool, str):
            return v
        if kind is int:
            return v if abs(v) < 2**53 else {"t": "int", "v": str(v)}
        if kind is float:
            return v if math.isfinite(v) else {"t": "float", "v": repr(v)}
        if kind is list:
            return [walk(x) for x in v]
        if kind is tuple:
            return {"t": "tuple", "v": [walk(x) for x in v]}
        if kind is dict:
            return {"t": "dict", "v": [[walk(k), walk(x)] for k, x in v.items()]}
        if kind is bytes:
            return {"t": "bytes", "v": base64.b64encode(v).decode("ascii")}
        if kind is complex:
            return {"t": "complex", "v": [walk(v.real), walk(v.imag)]}
        if kind is Fraction:
            return {"t": "fraction", "v": [str(v.numerator), str(v.denominator)]}
        if torch is not None:
            if kind is torch.dtype:
                return {"t": "dtype", "v": _dtype_name(v)}
            if kind is torch.device:
                return {"t": "device", "v": str(v)}
            if kind is torch.Tensor:
                return tensor(v)
        if REGISTRY.get(kind.__name__) is kind:
            if dataclasses.is_dataclass(kind):
                fields = {f.name: walk(getattr(v, f.name)) for f in dataclasses.fields(kind) if f.init}
            else:
                fields = {f: walk(x) for f, x in zip(kind._fields, v, strict=True)}
            return {"t": "record", "type": kind.__name__, "v": fields}
        raise NotPlainError(f"a {kind.__name__} is not plain data (call to_plain first)")

    header = json.dumps(walk(value), separators=(",", ":")).encode()
    if len(header) + size[0] > max_bytes:
        raise NotPlainError(f"the value is larger than the {max_bytes >> 20} MB that may cross")
    return b"".join([MAGIC, _LENGTH.pack(len(header)), header, *blobs])


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise NotPlainError(f"tensors of {dtype} do not cross (allowed: {', '.join(DTYPES)})")
    return name


# -- decoding ---------------------------------------------------------------------------------------------------

def decode(data: bytes, *, max_bytes: int = MAX_BYTES) -> Any:
    """The value `encode` wrote, rebuilt from the types above only; NotPlainError for anything else."""
    if len(data) > max_bytes:
        raise NotPlainError(f"the reply is {len(data) / 2**20:.1f} MB, more than the {max_bytes / 2**20:.0f} MB a "
                            "test reads")
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LENGTH.size:
        raise NotPlainError("not an encoded plain value")
    start = len(MAGIC) + _LENGTH.size
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    if start + length > len(data):
        raise NotPlainError("a truncated plain value")
    try:
        tree = json.loads(data[start:start + length])
    except (ValueError, RecursionError) as e:
        raise NotPlainError(f"not an encoded plain value ({type(e).__name__})") from None
    blob = memoryview(data)[start + length:]
    offset = [0]

    def tensor(node: dict) -> torch.Tensor:
        import torch

        name, shape, nbytes = node.get("dtype"), node.get("shape"), node.get("nbytes")
        if name not in DTYPES or not _ints(shape) or any(d < 0 for d in shape) or not _ints([nbytes]):
            raise NotPlainError("a malformed tensor")
        dtype = _dtype(name)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if math.prod(shape) * itemsize != nbytes or offset[0] + nbytes > len(blob):
            raise NotPlainError("a tensor whose bytes do not match its shape")
        raw = blob[offset[0]:offset[0] + nbytes]
        offset[0] += nbytes
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)

    def number(text: Any, kind: type) -> Any:
        if not isinstance(text, str):
            raise NotPlainError(f"a malformed {kind.__name__}")
        try:
            return kind(text)
        except ValueError:
            raise NotPlainError(f"a malformed {kind.__name__}") from None

    def walk(node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            raise NotPlainError("not an encoded plain value")
        tag, v = node.get("t"), node.get("v")
        if tag == "tuple" and isinstance(v, list):
            return tuple(walk(x) for x in v)
        if tag == "dict" and isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v):
            items = [(walk(k), walk(x)) for k, x in v]
            try:
                return dict(items)
            except TypeError:
                raise NotPlainError("a dict with a key that cannot be one") from None
        if tag == "int":
            return number(v, int)
        if tag == "float":
            return number(v, float)
        if tag == "bytes" and isinstance(v, str):
            return base64.b64decode(v, validate=True)
        if tag == "complex" and isinstance(v, list) and len(v) == 2:
            re_, im = walk(v[0]), walk(v[1])
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (re_, im)):
                raise NotPlainError("a malformed complex number")
            return complex(re_, im)
        if tag == "fraction" and isinstance(v, list) and len(v) == 2:
            numerator, denominator = number(v[0], int), number(v[1], int)
            if denominator == 0:
                raise NotPlainError("a fraction with denominator 0")
            return Fraction(numerator, denominator)
        if tag == "dtype" and v in DTYPES:
            return _dtype(v)
        if tag == "device" and isinstance(v, str):
            import torch

            return torch.device(v)
        if tag == "tensor":
            return tensor(node)
        if tag == "record" and node.get("type") in REGISTRY and isinstance(v, dict):
            cls = REGISTRY[node["type"]]
            fields = {str(k): walk(x) for k, x in v.items()}
            try:
                return cls(**fields)
            except (TypeError, ValueError) as e:
                raise NotPlainError(f"a {cls.__name__} that cannot be built: {e}") from None
        raise NotPlainError(f"a value of a kind that does not cross ({str(tag)[:40]!r})")

    try:
        return walk(tree)
    except RecursionError:
        raise NotPlainError("a value nested too deeply") from None


def _ints(values: Any) -> bool:
    return isinstance(values, list) and all(type(v) is int for v in values)


def round_trip(value: Any, *, name: str = "the result") -> Any:
    """What the other side of the boundary receives: a test in the notebook sees exactly what the grader gets."""
    return decode(encode(to_plain(value, name=name)))


# -- messages on a pipe ---------------------------------------------------------------------------------------------

def write_message(stream, value: Any) -> None:
    """One message on a binary stream: its length, then `encode(value)`."""
    data = encode(value)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def read_message(stream, *, max_bytes: int = MAX_BYTES) -> Any:
    """The next message `write_message` sent; EOFError at the end of the stream, NotPlainError for a message
    longer than `max_bytes` (nothing of it is read)."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError("the stream ended")
    (length,) = _LENGTH.unpack(head)
    if length > max_bytes:
        raise NotPlainError(f"a message of {length / 2**20:.1f} MB, more than the {max_bytes / 2**20:.0f} MB allowed")
    data = stream.read(length)
    if len(data) < length:
        raise EOFError("the stream ended inside a message")
    return decode(data, max_bytes=max_bytes)

"""Memory per rank: peak tensor memory measured the same way on CPU and GPU, and the formulas it is
checked against.

    with memory.track() as mem:        # on this rank's device (cs336_parallel.device())
        train_step()
    mem.peak_bytes, mem.start_bytes, mem.end_bytes

On a GPU the tracker reads the caching allocator's statistics (`torch.cuda.max_memory_allocated`). A CPU
has no such statistic, and the process's resident memory (RSS) counts much else: the allocator's free
lists, the Python heap, the libraries. So on the CPU the tracker counts what `memory_allocated` counts on
a GPU, the bytes of live tensor storages: every tensor alive when the block starts (the garbage
collector lists them; parameters' gradients are added), and every tensor an operation reads or creates
inside it (a TorchDispatchMode sees each operation). A storage leaves the count when it is freed (a
weak reference's callback) or resized (`UntypedStorage.resize_`, which FSDP uses to free parameters, is
wrapped while tracking). A storage shared by views counts once.

What the CPU tracker cannot see: memory a kernel allocates for itself without making it a tensor
(gloo's buffers, a matmul's workspace), operations run by other threads, and tensors that exist only
inside C++ when the block starts (the activations an autograd graph saved, if the block begins between
a forward pass and its backward). Start it between steps.

The per-rank memory of ZeRO's stages is an exercise of notebook 03 (`training_memory_bytes`), so this
package does not ship it; the communication volume of each stage is here.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from .devices import device as rank_device

__all__ = ["MemoryTracker", "live_tensor_bytes", "tensor_bytes", "track"]


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind `t` (a tensor subclass such as DTensor wraps one or more plain tensors)."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        return [s for a in attrs if isinstance(getattr(t, a), torch.Tensor) for s in _storages(getattr(t, a))]
    try:
        return [t.untyped_storage()]
    except (NotImplementedError, RuntimeError, ValueError, TypeError):  # sparse, lazy (uninitialized), ...
        return []


def _tensors_in(tree, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in an operation's arguments or result (nested lists, tuples and dicts), appended to `found`:
    what torch's `tree_flatten` would list, at a fraction of its cost (it runs for every operation)."""
    if isinstance(tree, torch.Tensor):
        found.append(tree)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            if isinstance(item, (torch.Tensor, list, tuple, dict)):
                _tensors_in(item, found)
    elif isinstance(tree, dict):
        for item in tree.values():
            _tensors_in(item, found)
    return found


def _same_device(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (None is skipped; views of one storage count once).

    `tensor_bytes(model.parameters())`, or an optimizer's state:
    `tensor_bytes(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t))`."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            for st in _storages(t):
                seen[id(st)] = st.nbytes()
    return sum(seen.values())


def _live_tensors() -> list[torch.Tensor]:
    """Every tensor the garbage collector knows, and the gradients of the leaves among them."""
    gc.collect()
    # type() rather than isinstance(): some objects (deprecated module attributes) warn when asked for __class__
    found = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    grads = []
    for t in found:
        try:
            if t.is_leaf and t.grad is not None:
                grads.append(t.grad)
        except (RuntimeError, ValueError, TypeError):  # e.g. an uninitialized (lazy) parameter
            pass
    return found + grads


def live_tensor_bytes(device: torch.device | str | None = None) -> int:
    """Bytes of all live tensor storages on `device` (default: this rank's device) in this process."""
    device = torch.device(device) if device is not None else rank_device()
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return tensor_bytes(t for t in _live_tensors() if _same_device(t, device))


_active: list[MemoryTracker] = []  # trackers inside their block, told about every storage resize
_original_resize = torch.UntypedStorage.resize_


def _tracked_resize(storage: torch.UntypedStorage, size: int):
    result = _original_resize(storage, size)
    for tracker in _active:
        tracker._resized(storage)
    return result


class MemoryTracker(TorchDispatchMode):
    """Peak bytes of live tensor memory on one device inside a `with` block (see the module docstring).

    Attributes after the block: `start_bytes` (live when it began), `peak_bytes` (the most at any one
    time, start included, since the start or the last `reset_peak()`), `end_bytes` (live when it ended);
    `peak_bytes - start_bytes` is what the block added at its worst.

    Starting a tracker costs a garbage collection and a walk over the process's objects (a few tenths
    of a second): to measure a step of a model built in the block, build it inside, `reset_peak()`, and
    run the step. With `count_existing=False` (CPU only) the tracker skips both and counts only the
    storages its block touches, from 0: for a block that creates everything it uses (a tensor made before
    the block and read inside would count as if the block had made it)."""

    def __init__(self, device: torch.device | str | None = None, *, count_existing: bool = True):
        super().__init__()
        self.count_existing = count_existing
        self.device = torch.device(device) if device is not None else rank_device()
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be a CPU or CUDA device, got {self.device}")
        self.start_bytes = self.peak_bytes = self.end_bytes = 0
        self._live: dict[int, list] = {}  # id(storage) -> [weakref to it, bytes counted]
        self._current = 0

    @property
    def current_bytes(self) -> int:
        """Live tensor bytes now (inside the block)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self._current

    def reset_peak(self) -> None:
        """Count the peak afresh from the bytes live now (`torch.cuda.reset_peak_memory_stats` on a GPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak_bytes = self._current

    # -- the CPU count --------------------------------------------------------------------------
    def _add(self, t: torch.Tensor) -> None:
        if not _same_device(t, self.device):
            return
        for st in _storages(t):
            entry = self._live.get(id(st))
            nbytes = st.nbytes()
            if entry is None:
                self._live[id(st)] = [weakref.ref(st, partial(self._freed, id(st))), nbytes]
                self._current += nbytes
            elif entry[1] != nbytes:  # resized since we last looked (e.g. Tensor.resize_, set_)
                self._current += nbytes - entry[1]
                entry[1] = nbytes

    def _freed(self, key: int, _ref) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._current -= entry[1]

    def _resized(self, storage: torch.UntypedStorage) -> None:
        entry = self._live.get(id(storage))
        if entry is not None and entry[0]() is storage:
            self._current += storage.nbytes() - entry[1]
            entry[1] = storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self._current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors_in((args, kwargs, out), []):
            self._add(t)
        self.peak_bytes = max(self.peak_bytes, self._current)
        return out

    # -- the block ------------------------------------------------------------------------------
    def __enter__(self) -> MemoryTracker:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = self.peak_bytes = torch.cuda.memory_allocated(self.device)
            return self
        self._live.clear()
        self._current = 0
        for t in _live_tensors() if self.count_existing else []:
            self._add(t)
        self.start_bytes = self.peak_bytes = self._current
        if not _active:
            torch.UntypedStorage.resize_ = _tracked_resize
        _active.append(self)
        return super().__enter__()

    def __exit__(self, *exc_info) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            self.end_bytes = torch.cuda.memory_allocated(self.device)
            return None
        super().__exit__(*exc_info)
        _active.remove(self)
        if not _active:
            torch.UntypedStorage.resize_ = _original_resize
        self.end_bytes = self._current
        self._live.clear()  # dropping the weak references drops their callbacks
        return None


def track(device: torch.device | str | None = None, *, count_existing: bool = True) -> MemoryTracker:
    """`with memory.track() as mem: ...`, then `mem.peak_bytes` (see `MemoryTracker`)."""
    return MemoryTracker(device, count_existing=count_existing)

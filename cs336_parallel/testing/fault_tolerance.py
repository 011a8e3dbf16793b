"""Notebook 08's tests: `save_sharded` and `load_resharded`.

Every check draws the tensors of a checkpoint itself (`checks.generator()`). A rank that saves receives only its own
pieces (`Shard`s) and the replicated values; `load_resharded` is given a checkpoint's files, which the test writes
with plain PyTorch in `save_sharded`'s format (as a shared file system holds them for every rank).

Files live where the code that writes them runs: a test's ranks write a checkpoint in a folder the test names
(under that machine's temporary directory), and drivers there return the folder's bytes, which the checks read
here with plain PyTorch. What the ranks exchanged while saving is measured outside them: no tensor may cross, only
the digests.
"""

from __future__ import annotations

import hashlib
import io
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from cs336_parallel import checks, probes
from cs336_parallel.boundary import RemoteError
from cs336_parallel.checkpoint import Shard

CHECKPOINT = "checkpoint"  # the checkpoint's folder inside a test's folder


# -- the data of a test -----------------------------------------------------------------------------------------

@dataclass
class Example:
    """The whole tensors a checkpoint shards, and the values every rank holds the same (replicated)."""

    full: dict[str, torch.Tensor]
    replicated: dict

    def state(self, world_size: int, rank: int) -> dict:
        """What rank `rank` of `world_size` holds and saves: its pieces (tensor_split's), and the replicated values."""
        pieces = {key: Shard(t.flatten().tensor_split(world_size)[rank].clone(), tuple(t.shape))
                  for key, t in self.full.items()}
        return {**pieces, **self.replicated}


def checkpoint_format(full: dict[str, torch.Tensor], replicated: dict, world_size: int) -> dict[str, bytes]:
    """The files `world_size` ranks write for these tensors and values, in save_sharded's format, with plain
    PyTorch."""
    files = {}
    for r in range(world_size):
        files[f"shard_{r}.pt"] = saved({k: t.flatten().tensor_split(world_size)[r].clone() for k, t in full.items()})
    files["metadata.pt"] = saved({
        "world_size": world_size, "shapes": {k: tuple(t.shape) for k, t in full.items()},
        "dtypes": {k: t.dtype for k, t in full.items()}, "replicated": replicated,
        "sha256": {name: sha256(data) for name, data in files.items()}})
    return files


def draw_example(*, large: bool = False, tiny: bool = False) -> Example:
    """Tensors whose sizes 2, 3 and 4 do not all divide, of several dtypes (`large`: a rank's pieces are 4 kB and
    more on 4 ranks; `tiny`: also tensors with fewer elements than ranks), and replicated values: a step, a list of
    losses, and a tensor (`large`: a data generator's state, as the notebook's run saves; else a small one, which
    keeps the requests that carry a checkpoint to the notebook small). Drawn from the test's own seed."""
    g = checks.generator()
    full = {"w": checks.random_tensor((32, 129) if large else (7, 11), generator=g),
            "b": checks.random_tensor((13,), torch.float64, generator=g),
            "ids": checks.random_tensor((7,) if large else (5,), torch.int64, generator=g),
            "h": checks.random_tensor((3, 3), generator=g).to(torch.bfloat16)}
    if large:
        full["one"] = checks.random_tensor((1,), generator=g)
    if tiny:
        full |= {"scalar": checks.random_tensor((), generator=g),
                 "few": checks.random_tensor((2,), torch.int32, generator=g)}
    step, seed = (int(torch.randint(1, 10**6, (), generator=g)) for _ in range(2))
    losses = checks.random_tensor((2,), torch.float64, generator=g).tolist()
    rng = torch.Generator().manual_seed(seed).get_state() if large else torch.randint(0, 256, (16,), generator=g,
                                                                                       dtype=torch.uint8)
    return Example(full, {"step": step, "data_rng": rng, "losses": losses})


def saved(obj) -> bytes:
    data = io.BytesIO()
    torch.save(obj, data)
    return data.getvalue()


def loaded(data: bytes, file: str):
    """A checkpoint file's contents, read as a loader reads them (weights_only): a file that does not load so fails
    the test with one line."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as error:  # noqa: BLE001 - any failure to load is the test's verdict
        raise AssertionError(f"{file} does not load with torch.load(weights_only=True): {type(error).__name__} (save "
                             "only tensors and plain values there)") from None


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- folders where the ranks run --------------------------------------------------------------------------------

def folder(name: str) -> str:
    """A test's folder `name`, under the temporary directory of the machine this runs on."""
    return os.path.join(tempfile.gettempdir(), name)


def remove_folder(exercise, name: str) -> int:
    """A driver: remove a test's folder. (`exercise` rides along unused, as in `folder_files`.)"""
    shutil.rmtree(folder(name), ignore_errors=True)
    return 0


def checkpoint_files(name: str) -> dict[str, bytes]:
    """Every file of the checkpoint in the test's folder `name`, by name, with its bytes (nothing if there is no
    such folder)."""
    path = os.path.join(folder(name), CHECKPOINT)
    if not os.path.isdir(path):
        return {}
    return {f: Path(path, f).read_bytes() for f in sorted(os.listdir(path)) if Path(path, f).is_file()}


def file_digests(files: dict[str, bytes]) -> dict[str, str]:
    """The SHA-256 of each file (what a check of the order of writes needs, without the bytes crossing)."""
    return {file: sha256(data) for file, data in files.items()}


def folder_files(exercise, name: str) -> dict[str, bytes]:
    """A driver: on rank 0, `checkpoint_files(name)`; on the other ranks, nothing (one copy crosses). `exercise`
    rides along unused: a test's requests that name the same exercises reuse the copy of them the ranks were sent."""
    return checkpoint_files(name) if dist.get_rank() == 0 else {}


@contextmanager
def scratch_folder(save_sharded, world_size: int) -> Iterator[str]:
    """For the checks: the name of a new folder for a test's ranks, removed afterwards."""
    name = f"cs336-checkpoint-test-{secrets.token_hex(6)}"
    try:
        yield name
    finally:
        checks.run(world_size, remove_folder, save_sharded, name)


# -- save_sharded ---------------------------------------------------------------------------------------------

def watched_save(original, seen: dict, *, dies_in: str = "", metadata_delay_s: float = 0.0):
    """torch.save that notes each call in seen["saves"] ("shard", or for the metadata the digests it records and
    the folder's files at that moment); that waits `metadata_delay_s` before writing the metadata; and that, at
    its first call writing a shard (dies_in="shard") or the metadata ("metadata"), writes half of the bytes and
    SIGKILLs this process: a crash mid-write."""
    def save(obj, f, *args, **kwargs):
        is_metadata = isinstance(obj, dict) and "sha256" in obj
        if is_metadata:
            seen["saves"].append({"kind": "metadata", "sha256": dict(obj["sha256"]),
                                  "files": file_digests(checkpoint_files(seen["name"]))})
            time.sleep(metadata_delay_s)
        else:
            seen["saves"].append({"kind": "shard"})
        if dies_in and is_metadata == (dies_in == "metadata"):
            buffer = io.BytesIO()
            original(obj, buffer, *args, **kwargs)
            half = buffer.getvalue()[: len(buffer.getvalue()) // 2]
            if isinstance(f, (str, os.PathLike)):
                Path(f).write_bytes(half)
            else:
                f.write(half)
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(obj, f, *args, **kwargs)
    return save


def save_example(save_sharded, name: str, victim: int | None, late_s: float, crash: dict, state: dict) -> dict:
    """A driver: this rank saves its `state` into the test's folder `name`, with torch.save watched
    (watched_save(**crash) on rank `victim`); rank 0 starts `late_s` seconds late, first noting the folder's files
    ("files_when_late"). What this rank saw: its torch.save calls ("saves"), its collectives ("comm"), and whether
    metadata.pt existed when save_sharded returned ("complete_on_return"); on rank 0, the checkpoint's files once
    every rank has returned ("files")."""
    rank, path = dist.get_rank(), os.path.join(folder(name), CHECKPOINT)
    state = {key: Shard(in_buffer(v.local), v.shape) if isinstance(v, Shard) else v for key, v in state.items()}
    seen = {"name": name, "saves": []}
    if rank == 0 and late_s:
        time.sleep(late_s)
        files = checkpoint_files(name)
        seen["files_when_late"] = {"digests": file_digests(files), "metadata": files.get("metadata.pt")}
    original = torch.save
    torch.save = watched_save(original, seen, **(crash if rank == victim else {}))
    try:
        with probes.count_collectives() as comm:
            save_sharded(state, path)
    finally:
        torch.save = original
    del seen["name"]
    complete = os.path.exists(os.path.join(path, "metadata.pt"))
    dist.barrier()  # every rank has returned: the files as they are left
    files = checkpoint_files(name) if rank == 0 else {}
    return {**seen, "comm": comm.record(), "complete_on_return": complete, "files": files}


def in_buffer(local: torch.Tensor) -> torch.Tensor:
    """`local` as a view into a larger buffer of this rank's, as a rank's pieces often are (of a flat parameter
    buffer): torch.save of a view writes the whole buffer."""
    return torch.cat([local, local.new_zeros(1)])[: local.numel()]


def save_on_ranks(save_sharded, world_size: int, name: str, example: Example, *, victim: int | None = None,
                  late_s: float = 0.0, **crash) -> list[dict]:
    """Every rank saves its share of `example` in the test's folder `name` (`save_example`); what each saw. The
    ranks' pieces are a rank's alone, and no tensor may cross while they save: checked on every call."""
    results = checks.run(world_size, save_example, save_sharded, name, victim, late_s, crash,
                         per_rank=[(example.state(world_size, r),) for r in range(world_size)])
    assert_digests_only(results, example, f"save_sharded on {world_size} ranks")
    return results


def assert_digests_only(results: list[dict], example: Example, what: str) -> None:
    """The rule of save_sharded, checked in each of its tests: no tensor crosses the network, only the digests go to
    rank 0. Each rank's word: no message of 2 kB or more, every call visible (a rank's pieces here are 4 kB and
    more). Measured outside the ranks: no rank receives as many bytes as the smallest rank's pieces."""
    for rank, result in enumerate(results):
        checks.assert_nothing_hidden(result["comm"], "save_sharded", rank=rank)
        largest = max((size for _, size, _ in result["comm"]["calls"]), default=0)
        checks.count_comparison()
        assert largest < 2048, (f"{what}: rank {rank}'s save_sharded moved {largest} bytes in one collective: each "
                                "rank writes its own pieces; only the digests go to rank 0")
    n = len(results)
    smallest = min(sum(t.flatten().tensor_split(n)[r].numel() * t.element_size() for t in example.full.values())
                   for r in range(n))
    traffic = checks.last_traffic()
    if traffic is not None and n > 1:
        checks.count_comparison()
        for rank in range(n):
            received = sum(traffic[r][rank] for r in range(n) if r != rank)
            assert received < smallest, (
                f"{what}: rank {rank} received {received} bytes from the other ranks (measured outside them), as much "
                f"as a rank's pieces ({smallest} bytes): no tensor may cross, only the digests")


def assert_checkpoint(files: dict[str, bytes], example: Example, world_size: int) -> None:
    """The files of a checkpoint of `example` written by `world_size` ranks, read here with plain PyTorch, against
    the format."""
    checks.count_comparison()
    assert "metadata.pt" in files, f"the checkpoint has no metadata.pt; it holds {sorted(files)}"
    meta = loaded(files["metadata.pt"], "metadata.pt")
    full = example.full
    names = sorted(name for name in files if not name.endswith(".tmp"))
    assert names == sorted(["metadata.pt"] + [f"shard_{r}.pt" for r in range(world_size)]), (
        f"the checkpoint of {world_size} ranks holds {names}")
    assert meta["world_size"] == world_size, f"metadata['world_size'] is {meta['world_size']}, saved by {world_size}"
    assert meta["shapes"] == {k: tuple(t.shape) for k, t in full.items()}, f"metadata['shapes'] is {meta['shapes']}"
    assert meta["dtypes"] == {k: t.dtype for k, t in full.items()}, f"metadata['dtypes'] is {meta['dtypes']}"
    replicated, expected = meta["replicated"], example.replicated
    assert replicated.keys() == expected.keys(), f"metadata['replicated'] holds {list(replicated)}"
    assert replicated["step"] == expected["step"] and replicated["losses"] == expected["losses"], (
        f"metadata['replicated'] is {replicated}, expected step {expected['step']} and losses {expected['losses']}")
    checks.assert_equal(replicated["data_rng"], expected["data_rng"], name="metadata['replicated']['data_rng']")
    for r in range(world_size):
        data = files[f"shard_{r}.pt"]
        checks.count_comparison()
        assert sha256(data) == meta["sha256"][f"shard_{r}.pt"], (
            f"metadata['sha256']['shard_{r}.pt'] is not the SHA-256 of that file's bytes")
        pieces = loaded(data, f"shard_{r}.pt")
        assert pieces.keys() == full.keys(), f"shard_{r}.pt holds {list(pieces)}, expected {list(full)}"
        for key, t in full.items():
            piece = pieces[key]
            checks.assert_equal(piece, t.flatten().tensor_split(world_size)[r],
                                name=f"shard_{r}.pt[{key!r}] ({world_size} ranks)")
            assert piece.untyped_storage().nbytes() == piece.numel() * piece.element_size(), (
                f"shard_{r}.pt[{key!r}] stores {piece.untyped_storage().nbytes()} bytes for {piece.numel()} "
                "elements: torch.save of a view writes the whole tensor it views; save a .clone()")


def check_save(save_sharded, world_size: int, *, tiny: bool = False, over_old: bool = False) -> list[dict]:
    """save_sharded on `world_size` ranks: its rule, and the checkpoint it leaves (with `over_old`, written over a
    complete checkpoint of other values). Returns what each rank saw."""
    with scratch_folder(save_sharded, world_size) as name:
        if over_old:
            check_save_in(save_sharded, world_size, name, draw_example(large=True, tiny=tiny))
        return check_save_in(save_sharded, world_size, name, draw_example(large=True, tiny=tiny))


def check_save_traffic(save_sharded, world_size: int) -> None:
    """save_sharded on `world_size` ranks moves no tensor (measured outside the ranks, and as each reports it), and
    leaves a metadata.pt."""
    with scratch_folder(save_sharded, world_size) as name:
        files = save_on_ranks(save_sharded, world_size, name, draw_example(large=True))[0]["files"]
    checks.count_comparison()
    assert "metadata.pt" in files, f"save_sharded on {world_size} ranks wrote no metadata.pt"


def check_save_in(save_sharded, world_size: int, name: str, example: Example) -> list[dict]:
    results = save_on_ranks(save_sharded, world_size, name, example)
    assert_checkpoint(results[0]["files"], example, world_size)
    return results


def assert_metadata_last(result: dict, what: str) -> None:
    """Rank 0 wrote metadata.pt with torch.save, once every shard file it records was complete on disk."""
    written = [save for save in result["saves"] if save["kind"] == "metadata"]
    checks.count_comparison()
    assert written, f"{what}: rank 0 did not write metadata.pt with torch.save (the tests watch it)"
    files, digests = written[0]["files"], written[0]["sha256"]
    assert all(files.get(name) == digest for name, digest in digests.items()), (
        f"{what}: rank 0 wrote the metadata before every shard file was complete on disk: metadata.pt is written last")


def check_metadata_last(save_sharded, world_size: int) -> None:
    with scratch_folder(save_sharded, world_size) as name:
        results = check_save_in(save_sharded, world_size, name, draw_example(large=True))
    assert_metadata_last(results[0], f"{world_size} ranks")


def expect_death(save_sharded, world_size: int, victim: int, name: str, example: Example, dies_in: str) -> None:
    """Rank `victim` dies inside torch.save while writing a shard or the metadata."""
    checks.count_comparison()
    try:
        checks.run(world_size, save_example, save_sharded, name, victim, 0.0, {"dies_in": dies_in},
                   per_rank=[(example.state(world_size, r),) for r in range(world_size)])
    except RemoteError as error:
        if error.rank != victim or "SIGKILL" not in error.headline:
            raise
    else:
        raise AssertionError(f"rank {victim} should have died writing the {dies_in} with torch.save, but save_sharded "
                             "returned: write the files with torch.save")


def torn(seen: dict) -> bool:
    """Whether a folder held a metadata.pt while some shard file did not have the digest it records (`seen`: the
    folder's "digests" and its "metadata" bytes, or None)."""
    if seen["metadata"] is None:
        return False
    recorded = torch.load(io.BytesIO(seen["metadata"]), weights_only=True)["sha256"]
    return any(seen["digests"].get(name) != digest for name, digest in recorded.items())


def check_crash_over_old(save_sharded, world_size: int = 4) -> None:
    """Over a complete checkpoint, rank 0 dies writing the new metadata: no metadata.pt is left, or the old one, whole
    and describing the files that are there (a checkpoint that looks complete is complete)."""
    with scratch_folder(save_sharded, world_size) as name:
        old = draw_example(large=True)
        assert_metadata_last(check_save_in(save_sharded, world_size, name, old)[0], f"{world_size} ranks")
        expect_death(save_sharded, world_size, 0, name, draw_example(large=True), "metadata")
        files = checks.run(world_size, folder_files, save_sharded, name)[0]
    if "metadata.pt" in files:
        try:
            assert_checkpoint(files, old, world_size)
        except Exception as error:  # noqa: BLE001 - a torn metadata.pt may not even load
            raise AssertionError("rank 0 died writing metadata.pt over an older checkpoint, and a metadata.pt is there "
                                 f"that does not describe the files: the checkpoint looks complete but is not ({error})"
                                 ) from None


def check_late_rank_over_old(save_sharded, world_size: int = 4) -> None:
    """Over a complete checkpoint, with rank 0 late: no rank may write before the old checkpoint is taken down."""
    with scratch_folder(save_sharded, world_size) as name:
        check_save_in(save_sharded, world_size, name, draw_example(large=True))
        new = draw_example(large=True)
        results = save_on_ranks(save_sharded, world_size, name, new, late_s=0.3)
        checks.count_comparison()
        assert not torn(results[0]["files_when_late"]), (
            f"over a complete checkpoint, with rank 0 late ({world_size} ranks): shard files changed while the old "
            "metadata.pt was still there, so a crash then would leave a checkpoint that looks complete and is not")
        assert_checkpoint(results[0]["files"], new, world_size)


def check_complete_on_return(save_sharded, world_size: int = 4) -> None:
    """Rank 0 takes 0.3 s longer to write metadata.pt: every rank returns only once it is written."""
    with scratch_folder(save_sharded, world_size) as name:
        results = save_on_ranks(save_sharded, world_size, name, draw_example(large=True), victim=0,
                                metadata_delay_s=0.3)
    early = [rank for rank, result in enumerate(results) if not result["complete_on_return"]]
    checks.count_comparison()
    assert not early, (f"save_sharded returned on ranks {early} before metadata.pt was written: the checkpoint must be "
                       "complete when it returns, on every rank")


def save_outcome(save_sharded, name: str, state: dict) -> dict:
    """A driver: what save_sharded did with this rank's `state` (the test wants ValueError)."""
    return probes.outcome(save_sharded, state, os.path.join(folder(name), CHECKPOINT))


def check_refuses_piece(save_sharded, world_size: int, local_shape: str) -> None:
    """Every rank's piece of "w" has one element too many ("long") or is 2-D ("2-D"): save_sharded raises
    ValueError."""
    example = draw_example(large=True)
    states = [example.state(world_size, r) for r in range(world_size)]
    for state in states:
        local = state["w"].local
        wrong = torch.cat([local, local[:1]]) if local_shape == "long" else local.reshape(1, -1)
        state["w"] = Shard(wrong, state["w"].shape)
    with scratch_folder(save_sharded, world_size) as name:
        got = checks.run(world_size, save_outcome, save_sharded, name, per_rank=[(s,) for s in states])
    for rank, result in enumerate(got):
        checks.assert_raised(result, ValueError, f"save_sharded of a {local_shape} piece on {world_size} ranks",
                             rank=rank)


# -- load_resharded ------------------------------------------------------------------------------------------

def write_checkpoint(name: str, full: dict[str, torch.Tensor], replicated: dict, saved_by: int,
                     remove: list[str], damage: tuple[str, str] | None) -> str:
    """A driver, in the kernel: the checkpoint `saved_by` ranks write for these tensors and values
    (`checkpoint_format`), in the test's folder `name`, without the files in `remove`, and with `damage` done to one
    file: ("flipped", file), a bit flipped in one of its values of "w"; ("cut", file), its second half gone. Its
    path. (The tensors travel, not the files: the request is a few hundred bytes.)"""
    files = checkpoint_format(full, replicated, saved_by)
    for file in remove:
        del files[file]
    if damage is not None:
        kind, file = damage
        data = bytearray(files[file])
        if kind == "flipped":
            piece = full["w"].flatten().tensor_split(saved_by)[int(file.removeprefix("shard_").removesuffix(".pt"))]
            data[data.find(piece.numpy().tobytes()) + 3] ^= 0x40  # in a value, not in the zip's headers
        else:
            data = data[: len(data) // 2]
        files[file] = bytes(data)
    path = os.path.join(folder(name), CHECKPOINT)
    os.makedirs(path)
    for file, data in files.items():
        Path(path, file).write_bytes(data)
    return path


@contextmanager
def checkpoint_in_kernel(example: Example, saved_by: int, remove: list[str] = (),
                         damage: tuple[str, str] | None = None) -> Iterator[str]:
    """For the checks: a checkpoint of `example` by `saved_by` ranks where the notebook runs (`write_checkpoint`);
    its path, removed afterwards."""
    name = f"cs336-checkpoint-test-{secrets.token_hex(6)}"
    try:
        yield checks.call(write_checkpoint, name, example.full, example.replicated, saved_by, list(remove), damage)
    finally:
        checks.call(remove_folder, None, name)


def assert_loaded(state, example: Example, world_size: int, rank: int, saved_by: int) -> None:
    """The state load_resharded returned for `rank` of `world_size`, against tensor_split's pieces."""
    case = f"saved by {saved_by} ranks, loaded by rank {rank} of {world_size}"
    full, replicated = example.full, example.replicated
    checks.count_comparison()
    assert isinstance(state, dict) and set(state) == set(full) | set(replicated), (
        f"{case}: loaded keys {sorted(state) if isinstance(state, dict) else state!r}")
    for key, t in full.items():
        assert isinstance(state[key], Shard), f"{case}: {key!r} is a {type(state[key]).__name__}, not a Shard"
        checks.assert_equal(state[key].local, t.flatten().tensor_split(world_size)[rank], name=f"{key!r}, {case}")
        assert tuple(state[key].shape) == tuple(t.shape), f"{case}: the shape of {key!r} is {state[key].shape}"
    for key, value in replicated.items():
        if isinstance(value, torch.Tensor):
            checks.assert_equal(state[key], value, name=f"replicated {key!r}, {case}")
        else:
            assert state[key] == value, f"{case}: replicated {key!r} loaded as {state[key]!r}, saved {value!r}"


def unneeded_files(example: Example, saved_by: int, loaded_by: int, rank: int) -> list[str]:
    """The shard files of `saved_by` ranks that hold none of `rank`'s elements of the example's tensors."""
    needed = set()
    for t in example.full.values():
        mine = set(torch.arange(t.numel()).tensor_split(loaded_by)[rank].tolist())
        needed |= {r for r, part in enumerate(torch.arange(t.numel()).tensor_split(saved_by))
                   if mine & set(part.tolist())}
    return [f"shard_{r}.pt" for r in range(saved_by) if r not in needed]


def check_resharding(load_resharded, saved_by: int, loaded_by: int, *, tiny: bool = False,
                     only_needed_by: int | None = None) -> None:
    """A checkpoint of `saved_by` ranks, loaded for each rank of `loaded_by`. With `only_needed_by`, for that rank
    only, from a checkpoint without the shard files that hold none of its elements."""
    example = draw_example(tiny=tiny)
    ranks = range(loaded_by) if only_needed_by is None else [only_needed_by]
    remove = [] if only_needed_by is None else unneeded_files(example, saved_by, loaded_by, only_needed_by)
    with checkpoint_in_kernel(example, saved_by, remove) as path:
        states = checks.call_each(load_resharded, [(path, loaded_by, r) for r in ranks])
    for rank, state in zip(ranks, states, strict=True):
        assert_loaded(state, example, loaded_by, rank, saved_by)


def assert_refused(load_resharded, exc_type: type, file: str, case: str, world_size: int, rank: int,
                   checkpoint: tuple) -> None:
    """load_resharded of the checkpoint `checkpoint_in_kernel(*checkpoint)` makes, for `rank` of `world_size`,
    raises exc_type with `file` in its message."""
    checks.count_comparison()
    with checkpoint_in_kernel(*checkpoint) as path:
        try:
            load_resharded(path, world_size, rank)
        except RemoteError as error:
            if error.unfilled:
                raise
            assert error.is_a(exc_type), f"{case}: load_resharded should raise {exc_type.__name__}, it raised " \
                                         f"{error.headline}"
            assert file in error.message, f"{case}: the {exc_type.__name__} should name {file}: {error.message}"
        else:
            raise AssertionError(f"{case}: load_resharded should raise {exc_type.__name__}")


def check_damage_refused(load_resharded, damage: str, saved_by: int, world_size: int, rank: int,
                         file: str = "") -> None:
    """A damaged checkpoint of `saved_by` ranks, loaded for `rank` of `world_size`, which needs `file`: "missing"
    (that shard file), "incomplete" (no metadata.pt), "flipped" (a bit of a value in that file) or "cut" (that
    file cut in half): FileNotFoundError or ValueError naming the file."""
    example = draw_example()
    if damage in ("missing", "incomplete"):
        file = "metadata.pt" if damage == "incomplete" else file
        assert_refused(load_resharded, FileNotFoundError, file, f"{file} is missing", world_size, rank,
                       (example, saved_by, [file]))
    elif damage == "flipped":
        assert_refused(load_resharded, ValueError, file, f"a value of {file} is damaged", world_size, rank,
                       (example, saved_by, [], (damage, file)))
    else:
        assert_refused(load_resharded, ValueError, file, f"{file} is cut in half (check before loading)", world_size,
                       rank, (example, saved_by, [], (damage, file)))


def check_load_refuses(load_resharded, cases: list[tuple[int, int]]) -> None:
    """A valid checkpoint loads for a valid rank; each (world_size, rank) of `cases` raises ValueError."""
    example = draw_example()
    with checkpoint_in_kernel(example, 2) as path:
        assert_loaded(checks.call(load_resharded, path, 3, 1), example, 3, 1, 2)  # a valid call works
        checks.assert_each_raises(ValueError, load_resharded, [(path, n, r) for n, r in cases])

"""Test ranks: CPU ranks (gloo) apart from the notebook's own, one group per world size, that run a test's driver.

Two processes keep such groups: the notebook's kernel, for the learner's own `%%test` cells
(`kernel_side.InProcess`), and, when a notebook is graded, the grader's rank host (`rank_host`), which the
kernel cannot reach. Either way a request is the same: the exercises, pickled where they were defined, and for
each rank its own request as plain data (`boundary.rank_requests`); each rank replies with plain data only.
Before the tests of another exercise the ranks are replaced: no test sees what an earlier one left on a rank.
"""

from __future__ import annotations

from . import plain, protocol
from .boundary import resolve
from .cluster import Cluster


def on_rank(request: bytes, exercises: bytes) -> bytes:
    """On one rank: the driver of `request` (plain data), called with the exercises (pickled by the kernel that
    defined them) in place of their references; its result, encoded as plain data."""
    import torch.distributed as dist  # the rank's, already imported; the rank host, which imports this module, has none

    call = plain.decode(request)
    named = protocol.load_object(exercises) if exercises else {}
    fn, args, kwargs = (resolve(call[k], named) for k in ("fn", "args", "kwargs"))
    result = fn(*args, **kwargs)
    return plain.encode(plain.to_plain(result, name=f"the result of rank {dist.get_rank()}"))


class TestRanks:
    """One cluster per world size, replaced between the tests of different exercises."""

    __test__ = False  # not a pytest test class

    def __init__(self) -> None:
        self.clusters: dict[int, Cluster] = {}
        self.tested: object = None  # what the ranks last ran the tests of

    def ranks(self, world_size: int) -> Cluster:
        """The cluster of `world_size` ranks, started and joined."""
        if world_size not in self.clusters:
            self.clusters[world_size] = Cluster(world_size, backend="gloo")
        return self.clusters[world_size].start()

    def pids(self, world_size: int) -> list[int]:
        return [s["pid"] for s in self.ranks(world_size).status()]

    def run(self, world_size: int, exercises: bytes, requests: list[bytes], timeout: float) -> list[bytes]:
        """Each rank's encoded result of its request (`on_rank`)."""
        return self.ranks(world_size).call_each_rank(on_rank, [(r, exercises) for r in requests], timeout=timeout)

    def restart(self) -> None:
        """Replace the ranks of every cluster that has run something (a test about to measure memory wants ranks
        that hold nothing of an earlier test)."""
        for cluster in self.clusters.values():
            if cluster.has_run:
                cluster.replace_ranks()

    def fresh(self, tested: object = None) -> None:
        """Replace the ranks of every cluster that has run something, unless they ran the tests of `tested`."""
        if tested is None or tested != self.tested:
            self.restart()
        self.tested = tested

    def shutdown(self) -> None:
        for cluster in self.clusters.values():
            cluster.shutdown()
        self.clusters.clear()


kernel_ranks = TestRanks()  # the notebook kernel's own, for the learner's %%test cells

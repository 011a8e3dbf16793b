"""Who sent how many bytes to whom, measured outside the ranks (cs336_parallel.wire): a rank's own sockets, read
through the kernel's TCP counters; traffic with anything that is not a rank, or with itself, counts for no pair."""

from __future__ import annotations

import socket
import sys

import pytest
import torch
import torch.distributed as dist

from cs336_parallel import Cluster, wire

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")


def ring(nbytes: int) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    ops = [dist.P2POp(dist.isend, torch.zeros(nbytes // 4), (rank + 1) % n),
           dist.P2POp(dist.irecv, torch.zeros(nbytes // 4), (rank - 1) % n)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def to_itself_and_to(address: tuple[str, int], nbytes: int) -> None:
    """Send `nbytes` to a process that is not a rank, and to this rank itself."""
    with socket.create_connection(address) as out:
        out.sendall(b"x" * nbytes)
    server = socket.create_server(("127.0.0.1", 0))
    with socket.create_connection(server.getsockname()) as loop, server.accept()[0] as back:
        loop.sendall(b"y" * nbytes)
        back.recv(nbytes)
    server.close()


@pytest.fixture(scope="module")
def cluster():
    with Cluster(3, backend="gloo") as c:
        c.run(ring, 4)  # the pairs are connected
        yield c


def pids(cluster: Cluster) -> list[int]:
    return [s["pid"] for s in cluster.status()]


def test_bytes_between_ranks_are_counted_pair_by_pair(cluster):
    before = wire.snapshot(pids(cluster))
    cluster.run(ring, 40_000)
    matrix = wire.traffic(before, wire.snapshot(pids(cluster)))
    for sender in range(3):
        receiver = (sender + 1) % 3
        assert 40_000 <= matrix[sender][receiver] < 40_400, matrix
        assert matrix[sender][sender] == 0 and matrix[sender][(sender + 2) % 3] < 200, matrix


def test_traffic_with_other_processes_or_itself_counts_for_no_pair(cluster):
    listener = socket.create_server(("127.0.0.1", 0))
    before = wire.snapshot(pids(cluster))
    import threading

    def drain():
        for _ in range(3):
            connection, _ = listener.accept()
            with connection:
                while connection.recv(1 << 16):
                    pass

    reader = threading.Thread(target=drain)
    reader.start()
    cluster.run(to_itself_and_to, listener.getsockname(), 100_000)
    reader.join(timeout=60)
    listener.close()
    matrix = wire.traffic(before, wire.snapshot(pids(cluster)))
    assert all(b < 200 for row in matrix for b in row), matrix


def test_the_pids_of_a_sandbox_are_found_from_outside():
    import os

    assert wire.outer_pids(os.getpid(), [os.getpid()]) == [os.getpid()]
    assert wire.outer_pids(os.getpid(), [10**7]) is None


def test_ranks_whose_sockets_share_a_local_port_are_told_apart_by_the_other_end():
    """Linux lets connect() reuse an ephemeral port towards another destination: here ranks 1 and 2 both connect
    from port 6000, rank 1 to rank 0's listener (5000), rank 2 to rank 1's (8000)."""
    host = "127.0.0.1"
    rank1_to_0 = wire.Socket(1, (host, 6000), (host, 5000), 0)
    rank2_to_1 = wire.Socket(2, (host, 6000), (host, 8000), 0)
    at_0_from_1 = wire.Socket(3, (host, 5000), (host, 6000), 0)
    at_1_from_2 = wire.Socket(4, (host, 8000), (host, 6000), 0)
    before = {0: [at_0_from_1], 1: [rank1_to_0, at_1_from_2], 2: [rank2_to_1]}
    after = {0: [wire.Socket(3, (host, 5000), (host, 6000), 100)],
             1: [rank1_to_0, wire.Socket(4, (host, 8000), (host, 6000), 70)], 2: [rank2_to_1]}
    assert wire.traffic(before, after) == [[0, 0, 0], [100, 0, 0], [0, 70, 0]]

"""Who sent how many bytes to whom: the test ranks' TCP traffic, measured from outside their processes.

A rank's own count of what it sent is only its word. Linux keeps its own count per TCP socket (`TCP_INFO`:
`tcpi_bytes_received`), and a process allowed to trace the ranks (their parent, or the grader that owns their
sandbox's user namespace) can read it: it lists each rank's sockets in /proc/<pid>/fd, takes a copy of each with
`pidfd_getfd` (Linux 5.6+) and asks the kernel. A socket's peer is a rank when that rank holds the other end
(a socket whose local address is this one's peer, and whose peer is this one): the bytes rank s received on it
came from that rank. Traffic between anything else (a process of the notebook's kernel, a rank talking to
itself) counts for no pair.

`snapshot(pids)` before and after a request, then `traffic(before, after)`: a matrix, `m[r][s]` the bytes rank s
received from rank r. Where /proc or the system call is missing or not allowed, `snapshot` returns None.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
from dataclasses import dataclass

_PIDFD_GETFD = 438  # the same number on every Linux architecture
_TCP_INFO_SIZE = 232
_BYTES_RECEIVED = struct.Struct("<Q")
_BYTES_RECEIVED_OFFSET = 128  # struct tcp_info: tcpi_bytes_acked at 120, tcpi_bytes_received at 128 (Linux 4.1+)


@dataclass(frozen=True)
class Socket:
    inode: int
    local: tuple[str, int]
    peer: tuple[str, int]
    received: int  # bytes received so far on this connection


Snapshot = dict[int, list[Socket]]  # rank -> its connected TCP sockets


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _copy_fd(pidfd: int, fd: int) -> int:
    libc = _libc()
    if libc is None:
        raise OSError("no libc")
    copy = libc.syscall(_PIDFD_GETFD, pidfd, fd, 0)
    if copy < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return copy


def sockets_of(pid: int) -> list[Socket]:
    """The connected TCP sockets of process `pid`, each with the bytes received on it so far."""
    found = []
    pidfd = os.pidfd_open(pid)
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{name}")
            except OSError:  # closed meanwhile
                continue
            if not target.startswith("socket:["):
                continue
            try:
                copy = _copy_fd(pidfd, int(name))
            except OSError as e:
                if e.errno in (9, 3):  # EBADF, ESRCH: closed or gone meanwhile
                    continue
                raise
            with socket.socket(fileno=copy) as s:
                if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                    continue
                try:
                    peer, local = s.getpeername()[:2], s.getsockname()[:2]
                except OSError:  # listening, or not connected
                    continue
                info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
                if len(info) < _BYTES_RECEIVED_OFFSET + 8:
                    raise OSError("this kernel's TCP_INFO has no byte counts")
                (received,) = _BYTES_RECEIVED.unpack_from(info, _BYTES_RECEIVED_OFFSET)
                found.append(Socket(int(target[8:-1]), local, peer, received))
    finally:
        os.close(pidfd)
    return found


def snapshot(pids: list[int]) -> Snapshot | None:
    """Each rank's sockets (rank i is process `pids[i]`); None where they cannot be read from here."""
    if not hasattr(os, "pidfd_open") or not os.path.isdir("/proc"):
        return None
    try:
        return {rank: sockets_of(pid) for rank, pid in enumerate(pids)}
    except (OSError, ValueError):
        return None


def traffic(before: Snapshot, after: Snapshot) -> list[list[int]]:
    """`m[r][s]`: bytes rank s received from rank r between the two snapshots (r != s; the diagonal stays 0)."""
    n = len(after)
    # A connection by its two ends: sockets of different ranks may share a local address (Linux lets connect()
    # reuse an ephemeral port towards another destination), so the local address alone does not name its rank.
    owner = {(sock.local, sock.peer): rank for rank, socks in after.items() for sock in socks}
    earlier = {sock.inode: sock.received for socks in before.values() for sock in socks}
    matrix = [[0] * n for _ in range(n)]
    for receiver, socks in after.items():
        for sock in socks:
            sender = owner.get((sock.peer, sock.local))
            if sender is not None and sender != receiver:
                matrix[sender][receiver] += sock.received - earlier.get(sock.inode, 0)
    return matrix


def outer_pids(root: int, inner: list[int]) -> list[int] | None:
    """The pids, as this process sees them, of the processes that see themselves as `inner` in the PID namespace
    of the sandbox whose outermost process is `root` (its descendants are searched); None if one is missing."""
    by_inner: dict[int, int] = {}
    pending = [root]
    while pending:
        pid = pending.pop()
        try:
            status = open(f"/proc/{pid}/status").read()
            for task in os.listdir(f"/proc/{pid}/task"):
                pending += [int(c) for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("NSpid:"):
                by_inner[int(line.split()[-1])] = pid
    found = [by_inner.get(p) for p in inner]
    return None if None in found else found

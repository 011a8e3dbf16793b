"""What the ranks print, shown in the calling cell while a call runs: live, grouped by rank, bounded.

Each rank's stdout and stderr reach the kernel through pipes (`OutputPipes` reads them, never
blocking, into the call's `CallOutput`). Every FLUSH_S the lines that arrived are
printed in rank order (stdout, then stderr, of rank 0, then of rank 1...), each tagged with its rank: a
short call reads rank by rank, a long one shows its progress as it goes. A line is what a terminal
would show at its end, so a progress bar redrawn with carriage returns shows only its last state.

A call shows at most MAX_LINES lines and MAX_CHARS characters (a `while True: print()` would otherwise
fill the notebook and the browser). What comes after is counted, and each rank's last TAIL_LINES lines
are shown at the end, after a line that says how much was cut.
"""

from __future__ import annotations

import codecs
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection

FLUSH_S = 1.0
MAX_LINES = 1000
MAX_CHARS = 200_000
LINE_CHARS = 2000  # a longer line is cut, saying how many characters were left out
TAIL_LINES = 20
ERROR_LINES = 20  # stderr lines of a rank kept for its error report, shown or not
READ_BYTES = 1 << 16
DRAIN_BYTES = 1 << 22  # read at most this much of a stream after a call (a thread may still be printing)


class Lines:
    """One stream of bytes turned into display lines; memory stays bounded whatever arrives."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._current, self._current_extra = "", 0  # the line since its last carriage return
        self._before, self._before_extra = "", 0  # what it showed before that carriage return

    def feed(self, data: bytes) -> list[str]:
        """The lines that `data` completes."""
        parts = self._decoder.decode(data).split("\n")
        lines = []
        for part in parts[:-1]:
            self._add(part)
            lines.append(self._end_line())
        self._add(parts[-1])
        return lines

    def finish(self) -> list[str]:
        """The unfinished line, if any (a progress bar still on screen)."""
        self._add(self._decoder.decode(b"", final=True))
        return [self._end_line()] if self._current or self._before else []

    def _add(self, text: str) -> None:
        *redrawn, text = text.split("\r")
        for segment in redrawn:
            self._append(segment)
            if self._current or self._current_extra:  # `50%\r\n` shows 50%: an empty redraw changes nothing
                self._before, self._before_extra = self._current, self._current_extra
            self._current, self._current_extra = "", 0
        self._append(text)

    def _append(self, text: str) -> None:
        room = max(0, LINE_CHARS - len(self._current))
        self._current += text[:room]
        self._current_extra += max(0, len(text) - room)

    def _end_line(self) -> str:
        text, extra = ((self._current, self._current_extra) if self._current or self._current_extra
                       else (self._before, self._before_extra))
        self._current, self._current_extra, self._before, self._before_extra = "", 0, "", 0
        return text + (f" ... ({extra:,} more characters)" if extra else "")


class CallOutput:
    """The output of one call, printed with `write` as it arrives (see the module docstring)."""

    def __init__(self, write: Callable[[str], None]):
        self._write = write
        self._streams: dict[tuple[int, str], Lines] = {}
        self._pending: dict[int, dict[str, list[str]]] = {}
        self._lines_left, self._chars_left = MAX_LINES, MAX_CHARS
        self._cut: dict[int, deque] = {}  # rank -> its last lines after the budget ran out
        self._cut_counts: dict[int, list[int]] = {}  # rank -> [lines, characters] past the budget
        self._errors: dict[int, deque] = {}
        self._next_flush = time.monotonic() + FLUSH_S

    def add(self, rank: int, kind: str, data: bytes) -> None:
        """Bytes that rank `rank` wrote to its stdout (`kind` "out") or stderr ("err")."""
        stream = self._streams.setdefault((rank, kind), Lines())
        self._take(rank, kind, stream.feed(data))

    def recent_errors(self, rank: int) -> list[str]:
        """The rank's last stderr lines (cut or not), tagged, for the error that reports its death."""
        return [f"[rank {rank} stderr] {line}" for line in self._errors.get(rank, ())]

    def flush_if_due(self) -> None:
        if time.monotonic() >= self._next_flush:
            self.flush()

    def flush(self) -> None:
        """Print what arrived since the last flush, rank by rank."""
        self._next_flush = time.monotonic() + FLUSH_S
        lines = []
        for rank in sorted(self._pending):
            lines += [f"[rank {rank}] {line}" for line in self._pending[rank]["out"]]
            lines += [f"[rank {rank} stderr] {line}" for line in self._pending[rank]["err"]]
        self._pending.clear()
        if lines:
            self._write("\n".join(lines))

    def finish(self) -> None:
        """The call is over: print the unfinished lines, then for each rank whose output was cut, how much,
        and its last lines."""
        for (rank, kind), stream in sorted(self._streams.items()):
            self._take(rank, kind, stream.finish())
        self._streams.clear()
        self.flush()
        lines = []
        for rank in sorted(self._cut):
            tail = self._cut.pop(rank)
            n, chars = self._cut_counts.pop(rank)
            n, chars = n - len(tail), chars - sum(len(line) + 1 for _, line in tail)
            lines.append(f"[rank {rank}] ... {n:,} lines ({_size(chars)}) cut here: a call shows at most "
                         f"{MAX_LINES:,} lines ({_size(MAX_CHARS)}); the last {len(tail)} follow")
            lines += [f"[rank {rank}{' stderr' if kind == 'err' else ''}] {line}" for kind, line in tail]
        if lines:
            self._write("\n".join(lines))

    def _take(self, rank: int, kind: str, lines: list[str]) -> None:
        if kind == "err" and lines:
            self._errors.setdefault(rank, deque(maxlen=ERROR_LINES)).extend(lines)
        for line in lines:
            if self._lines_left > 0 and self._chars_left > len(line):
                self._pending.setdefault(rank, {"out": [], "err": []})[kind].append(line)
                self._lines_left -= 1
                self._chars_left -= len(line) + 1
            else:
                self._lines_left = 0  # once the output is cut, it stays cut: what is shown stays in order
                self._cut.setdefault(rank, deque(maxlen=TAIL_LINES)).append((kind, line))
                counts = self._cut_counts.setdefault(rank, [0, 0])
                counts[0] += 1
                counts[1] += len(line) + 1


class OutputPipes:
    """The kernel's ends of one rank's stdout and stderr pipes (non-blocking), read into a `CallOutput`."""

    def __init__(self, rank: int, out: Connection, err: Connection):
        self.rank = rank
        self._ends = {"out": out, "err": err}
        self._closed: set[str] = set()  # the streams at end of file

    def open_streams(self) -> dict[int, str]:
        """The streams not yet at end of file ("out", "err"), by file descriptor."""
        return {end.fileno(): kind for kind, end in self._ends.items() if kind not in self._closed}

    def read(self, kind: str, output: CallOutput, limit: int = READ_BYTES) -> int:
        """Pass what the rank wrote on one stream to `output`; the number of bytes read."""
        try:
            data = os.read(self._ends[kind].fileno(), limit)
        except BlockingIOError:
            return 0
        except OSError:
            data = b""
        if not data:
            self._closed.add(kind)
        output.add(self.rank, kind, data)
        return len(data)

    def drain(self, output: CallOutput) -> None:
        """Read what the rank has written so far (at most DRAIN_BYTES a stream)."""
        for kind in list(self.open_streams().values()):
            total = 0
            while total < DRAIN_BYTES and kind not in self._closed and (n := self.read(kind, output)):
                total += n

    def close(self) -> None:
        for end in self._ends.values():
            end.close()


def open_streams(pipes: Iterable[OutputPipes]) -> dict[int, tuple[OutputPipes, str]]:
    """Every stream of `pipes` not yet at end of file, by file descriptor (what a wait watches)."""
    return {fd: (p, kind) for p in pipes for fd, kind in p.open_streams().items()}


def _size(chars: int) -> str:
    return f"{chars / 1e6:.1f} MB" if chars >= 1e6 else f"{chars / 1e3:.1f} kB"

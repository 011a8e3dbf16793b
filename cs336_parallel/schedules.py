"""Pipeline schedules as data: actions per stage, a validity checker, and an event-driven simulator.

A schedule is one list of `Action`s per stage (rank), executed in order. An action is a forward `F`,
an input-gradient backward `B`, a weight-gradient backward `W`, or `BW`, the full backward (B and W
fused, what GPipe and 1F1B run), for one micro-batch and one model chunk. Zero-bubble schedules split
the backward into B and W (Qi et al. 2023, "Zero Bubble Pipeline Parallelism").

With `v` chunks per stage (interleaving, Narayanan et al. 2021) the model is cut into `p * v`
*virtual stages*; chunk `c` of stage `s` is virtual stage `c * p + s`, so data goes stage 0, 1, ...,
p-1, then back to stage 0's next chunk. Activations flow from virtual stage k to k+1, gradients from
k+1 to k.

The *bidirectional* layout is DualPipe's (DeepSeek-V3 technical report, 2024, section 3.2.1): each
stage (rank) s holds two whole stages of the model, model stage s for the micro-batches that enter at
stage 0 (chunk 0: they go 0, 1, ..., p-1) and model stage p-1-s for those that enter at stage p-1
(chunk 1: they go p-1, ..., 0). Every micro-batch travels one way, on one chunk; an action on a chunk
does a whole stage's work, and each stage keeps the parameters of two. A forward followed by a backward
of the other chunk is one overlapped pair ("F&B"), which starts when both its inputs are there; and
since DualPipe posts its receives ahead of the actions that need them, in the order its neighbours
send, the checker does not ask its actions to consume messages in that order.

Communication model (what `run_pipeline` does with isend/irecv, and what `check_schedule` checks):
a stage receives an action's input before running it (the receive waits), sends the output after it
(the send does not wait for the receiver), and messages between two stages are received in the order
they were sent, as NCCL and untagged gloo match them. Pure Python: no torch needed.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

KINDS = ("F", "B", "W", "BW")
LAYOUTS = ("interleaved", "bidirectional")


class Action(NamedTuple):
    """One step of a stage: `kind` in F, B, W, BW; the micro-batch; the chunk (virtual stage) on this stage."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:  # F3, BW0, F2c1 (chunk 1)
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


_TOKEN = re.compile(r"^(BW|F|B|W)(\d+)(?:c(\d+))?$")


def parse(text: str) -> list[Action]:
    """'F0 F1 BW0 F2c1' -> [Action('F', 0), Action('F', 1), Action('BW', 0), Action('F', 2, 1)]."""
    actions = []
    for token in text.split():
        match = _TOKEN.match(token)
        if not match:
            raise ValueError(f"text: {token!r} is not an action (F3, B3, W3 or BW3, chunk as F3c1)")
        kind, mb, chunk = match.groups()
        actions.append(Action(kind, int(mb), int(chunk or 0)))
    return actions


def format_schedule(schedule: Sequence[Sequence[Action]]) -> str:
    """One line per stage: 'stage 0: F0 F1 BW0 BW1'."""
    return "\n".join(f"stage {s}: " + " ".join(map(str, actions)) for s, actions in enumerate(schedule))


def num_chunks(schedule: Sequence[Sequence[Action]]) -> int:
    """v: the number of model chunks per stage (1 + the largest chunk index used)."""
    return 1 + max((a.chunk for actions in schedule for a in actions), default=0)


# -- dependencies -------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Placement:
    """Where each virtual stage of a micro-batch's path lives (see the module docstring)."""

    p: int
    v: int
    bidirectional: bool = False

    @property
    def depth(self) -> int:
        """Virtual stages on one micro-batch's path."""
        return self.p if self.bidirectional else self.p * self.v

    def per_chunk(self, amount):
        """`amount` of a whole stage's work (or parameters, or activations) for one chunk: 1/v of it when
        interleaved, all of it in the bidirectional layout."""
        return amount if self.bidirectional or self.v == 1 else amount / self.v

    def virtual(self, stage: int, chunk: int) -> int:
        """The position on its micro-batch's path of `chunk` of `stage`."""
        return self.p - 1 - stage if self.bidirectional and chunk == 1 else chunk * self.p + stage

    def stage_of(self, k: int, chunk: int) -> int:
        """The stage that holds virtual stage k of the path that an action on `chunk` belongs to."""
        return self.p - 1 - k if self.bidirectional and chunk == 1 else k % self.p


def _placement(schedule: Sequence[Sequence[Action]], layout: str) -> _Placement:
    """Where `layout` ("interleaved" or "bidirectional") puts the virtual stages of `schedule`'s chunks."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    v = num_chunks(schedule)
    if layout == "bidirectional" and v > 2:
        raise ValueError(f"a bidirectional schedule has two chunks per stage, 0 (stage 0 to p-1) and 1 (stage p-1 "
                         f"to 0), got chunk {v - 1}")
    return _Placement(len(schedule), v, layout == "bidirectional")


def _paired(actions: Sequence[Action], i: int, place: _Placement) -> bool:
    """Bidirectional layout: a forward followed by a backward of the other chunk runs with it as one
    overlapped pair (DualPipe's "F&B"), which starts when both inputs are there."""
    if not place.bidirectional or i + 1 >= len(actions):
        return False
    a, b = actions[i], actions[i + 1]
    return a.kind == "F" and b.kind in ("B", "BW") and b.chunk != a.chunk


def _input_of(action: Action, stage: int, place: _Placement) -> tuple | None:
    """(message, producing stage) an action needs from an earlier virtual stage, or None."""
    k = place.virtual(stage, action.chunk)
    if action.kind == "F" and k > 0:
        return ("activation", action.microbatch, k - 1), place.stage_of(k - 1, action.chunk)
    if action.kind in ("B", "BW") and k < place.depth - 1:
        return ("gradient", action.microbatch, k + 1), place.stage_of(k + 1, action.chunk)
    return None


def _output_of(action: Action, stage: int, place: _Placement) -> tuple | None:
    """(message, consuming stage) an action produces for another virtual stage, or None."""
    k = place.virtual(stage, action.chunk)
    if action.kind == "F" and k < place.depth - 1:
        return ("activation", action.microbatch, k), place.stage_of(k + 1, action.chunk)
    if action.kind in ("B", "BW") and k > 0:
        return ("gradient", action.microbatch, k), place.stage_of(k - 1, action.chunk)
    return None


def _describe(message: tuple) -> str:
    what, mb, k = message
    return f"micro-batch {mb}'s {what} (virtual stage {k} -> {k + 1 if what == 'activation' else k - 1})"


def _where(stage: int, index: int, action: Action) -> str:
    return f"stage {stage}, action {index} ({action})"


# -- the checker --------------------------------------------------------------------------------

def _is_integer(x) -> bool:
    """An integer of any kind (a numpy integer too, as `np.arange` gives), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_actions(schedule: Sequence[Sequence[Action]], m: int) -> list[dict]:
    """Every action well formed, each kind once, F before B/BW before W; returns per stage
    {(microbatch, chunk): kinds seen}."""
    seen_per_stage = []
    for s, actions in enumerate(schedule):
        seen: dict[tuple[int, int], set[str]] = {}
        for i, a in enumerate(actions):
            if not isinstance(a, Action):
                raise ValueError(f"stage {s}, action {i}: {a!r} is not an Action(kind, microbatch, chunk)")
            if a.kind not in KINDS:
                raise ValueError(f"{_where(s, i, a)}: kind must be one of {', '.join(KINDS)}, got {a.kind!r}")
            if not _is_integer(a.microbatch) or not 0 <= a.microbatch < m:
                raise ValueError(f"{_where(s, i, a)}: micro-batch must be in 0..{m - 1} (num_microbatches={m})")
            if not _is_integer(a.chunk) or a.chunk < 0:
                raise ValueError(f"{_where(s, i, a)}: chunk must be an integer >= 0")
            done = seen.setdefault((a.microbatch, a.chunk), set())
            if a.kind in done or (a.kind in ("B", "BW") and done & {"B", "BW"}) or (a.kind == "W" and "BW" in done):
                raise ValueError(f"{_where(s, i, a)}: micro-batch {a.microbatch}'s {a.kind} on chunk {a.chunk} "
                                 f"comes twice (BW is B and W together)")
            if a.kind != "F" and "F" not in done:
                raise ValueError(f"{_where(s, i, a)}: comes before F{a.microbatch} of the same chunk on this stage")
            if a.kind == "W" and "B" not in done:
                raise ValueError(f"{_where(s, i, a)}: W needs its B first (the gradient of the output)")
            done.add(a.kind)
        seen_per_stage.append(seen)
    return seen_per_stage


def _check_complete(seen_per_stage: list[dict], m: int, place: _Placement) -> None:
    """Each micro-batch's F, and B and W (or BW), on every stage and chunk (bidirectional: on its one chunk)."""
    chunks = {mb: range(place.v) for mb in range(m)}
    if place.bidirectional:
        used: dict[int, set] = {}
        for seen in seen_per_stage:
            for mb, c in seen:
                used.setdefault(mb, set()).add(c)
        for mb, cs in sorted(used.items()):
            if len(cs) > 1:
                raise ValueError(f"micro-batch {mb} runs on chunks {sorted(cs)}: in a bidirectional schedule each "
                                 f"micro-batch travels one way, on chunk 0 (stage 0 to p-1) or 1 (stage p-1 to 0)")
        chunks = {mb: sorted(used.get(mb, {0})) for mb in range(m)}
    for s, seen in enumerate(seen_per_stage):
        for mb in range(m):
            for c in chunks[mb]:
                done = seen.get((mb, c), set())
                missing = [f"F{mb}"] if "F" not in done else []
                if not done & {"B", "BW"}:
                    missing.append(f"BW{mb} (or B{mb} and W{mb})")
                elif "B" in done and "W" not in done:
                    missing.append(f"W{mb}")
                if missing:
                    raise ValueError(f"stage {s}, chunk {c}: {' and '.join(missing)} missing; every micro-batch "
                                     f"needs F, then BW (or B and W), once per stage and chunk")


def _check_message_order(schedule: Sequence[Sequence[Action]], place: _Placement) -> None:
    """Between each pair of stages, messages are received in the order they are sent."""
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for s, actions in enumerate(schedule):
        for i, a in enumerate(actions):
            out = _output_of(a, s, place)
            if out and out[1] != s:
                sent.setdefault((s, out[1]), []).append(out[0])
            inp = _input_of(a, s, place)
            if inp and inp[1] != s:
                received.setdefault((inp[1], s), []).append((inp[0], i, a))
    for (src, dst), wanted in sorted(received.items()):
        for position, (message, i, a) in enumerate(wanted):
            first = sent[(src, dst)][position]
            if first != message:
                raise ValueError(
                    f"{_where(dst, i, a)}: receives {_describe(message)} from stage {src}, but stage {src} sends "
                    f"{_describe(first)} first: messages between two stages arrive in the order they were sent")


def _check_progress(schedule: Sequence[Sequence[Action]], place: _Placement, blocking_sends: bool) -> None:
    """Run the schedule with waiting receives (and, if asked, sends that wait for their receiver)."""
    p = place.p
    pc = [0] * p
    done: set[tuple] = set()  # (kind, microbatch, virtual stage) of finished actions
    arrived: set[tuple] = set()  # messages handed to their receiver
    sending: list[tuple | None] = [None] * p  # a blocking send waiting for its receiver

    def missing(s: int, i: int) -> tuple | None:
        """The input stage s's action i is still waiting for (None: it has it)."""
        a = schedule[s][i]
        inp = _input_of(a, s, place)
        if inp is None:
            return None
        message, src = inp
        if src == s:  # the neighbouring virtual stage lives here too: its action must be done already
            kinds = ("F",) if a.kind == "F" else ("B", "BW")
            return None if any((k, a.microbatch, message[2]) in done for k in kinds) else inp
        return None if message in arrived else inp

    def waiting_for(s: int) -> tuple | None:
        """What stage s needs before running its next action (None: it can run); a pair needs both inputs."""
        wait = missing(s, pc[s])
        if wait is None and _paired(schedule[s], pc[s], place):
            wait = missing(s, pc[s] + 1)
        return wait

    progressed = True
    while progressed:
        progressed = False
        for s in range(p):
            while True:
                if sending[s] is not None:
                    message, dst = sending[s]
                    if pc[dst] < len(schedule[dst]) and sending[dst] is None and \
                            _input_of(schedule[dst][pc[dst]], dst, place) == (message, s):
                        arrived.add(message)
                        sending[s] = None
                        progressed = True
                    else:
                        break
                if pc[s] == len(schedule[s]) or waiting_for(s) is not None:
                    break
                a = schedule[s][pc[s]]
                done.add((a.kind, a.microbatch, place.virtual(s, a.chunk)))
                out = _output_of(a, s, place)
                if out and out[1] != s:
                    if blocking_sends:
                        sending[s] = out
                    else:
                        arrived.add(out[0])
                pc[s] += 1
                progressed = True
    stuck = [s for s in range(p) if pc[s] < len(schedule[s]) or sending[s] is not None]
    if not stuck:
        return
    reasons = []
    for s in stuck:
        if sending[s] is not None:
            message, dst = sending[s]
            a = schedule[s][pc[s] - 1]
            reasons.append(f"{_where(s, pc[s] - 1, a)} waits to send {_describe(message)} until stage {dst} "
                           f"is ready to receive it")
        else:
            message, src = waiting_for(s)
            reasons.append(f"{_where(s, pc[s], schedule[s][pc[s]])} waits for {_describe(message)} "
                           f"from stage {src}")
    raise ValueError("deadlock: " + "; ".join(reasons) +
                     (" (sends wait for their receiver: blocking_sends=True)" if blocking_sends else ""))


def _is_list(x) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, str)


def check_schedule(schedule: Sequence[Sequence[Action]], num_microbatches: int, *,
                   blocking_sends: bool = False, layout: str = "interleaved") -> None:
    """Raise ValueError naming the first bad action unless `schedule` is a valid pipeline schedule.

    Valid: on every stage and chunk each micro-batch has one F, then one BW or a B followed by a W;
    messages between two stages are received in the order they are sent; and executing the stages
    with receives that wait (and, with `blocking_sends=True`, sends that wait for their receiver, as
    `dist.send` does) finishes without a deadlock. With `layout="bidirectional"` (DualPipe's) each
    micro-batch runs on one chunk, the one of its direction, and receives may come in any order."""
    if not _is_integer(num_microbatches) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
    if not _is_list(schedule) or not schedule or not all(_is_list(actions) for actions in schedule):
        raise ValueError("schedule must be a non-empty list with one list of actions per stage")
    seen = _check_actions(schedule, num_microbatches)
    place = _placement(schedule, layout)
    _check_complete(seen, num_microbatches, place)
    if not place.bidirectional:
        _check_message_order(schedule, place)
    _check_progress(schedule, place, blocking_sends)


# -- the simulator ------------------------------------------------------------------------------

@dataclass
class Interval:
    start: float
    end: float
    action: Action | None = None  # None for idle time


@dataclass
class Timeline:
    """What `simulate` (or a measurement) returns: per stage, the busy and idle intervals."""

    busy: list[list[Interval]]  # per stage, the actions in order
    idle: list[list[Interval]]  # per stage, the gaps between 0 and total_time
    total_time: float
    bubble_fraction: float  # idle time / (stages x total time)
    peak_in_flight: list  # per stage: the most micro-batches whose activations are alive at once
    num_messages: int = 0  # point-to-point messages between stages
    costs: dict = field(default_factory=dict)
    parameters: list | None = None  # per stage: the model's parameters it holds, in stages' worth (1/p of the model)
    layout: str = "interleaved"

    @property
    def num_stages(self) -> int:
        return len(self.busy)


def peak_in_flight(schedule: Sequence[Sequence[Action]], *, layout: str = "interleaved") -> list:
    """Per stage, the most micro-batches whose activations are alive at once, in units of one
    micro-batch through a whole stage (an interleaved chunk counts 1/v). Alive from the F until the
    backward that frees them: BW, or W when the backward is split (W still needs the stored inputs)."""
    place = _placement(schedule, layout)
    peaks = []
    for actions in schedule:
        split = {(a.microbatch, a.chunk) for a in actions if a.kind == "W"}
        alive = peak = 0
        for a in actions:
            if a.kind == "F":
                alive += 1
                peak = max(peak, alive)
            elif a.kind == "BW" or a.kind == "W" or (a.kind == "B" and (a.microbatch, a.chunk) not in split):
                alive -= 1
        peaks.append(place.per_chunk(peak))
    return peaks


def parameters_per_stage(schedule: Sequence[Sequence[Action]], *, layout: str = "interleaved") -> list:
    """Per stage, the model's parameters it holds, in stages' worth (1/p of the model): 1 for one chunk or
    v interleaved chunks of 1/v each; 2 for a bidirectional schedule, whose stages hold two whole stages."""
    place = _placement(schedule, layout)
    return [place.per_chunk(len({a.chunk for a in actions})) for actions in schedule]


def _per_stage(value, p: int, name: str) -> list:
    values = list(value) if isinstance(value, Sequence) else [value] * p
    if len(values) != p or any(x < 0 for x in values):
        raise ValueError(f"{name} must be a time >= 0 or one per stage ({p}), got {value!r}")
    return values


def simulate(schedule: Sequence[Sequence[Action]], t_f=1, t_b=1, t_w=1, t_comm=0, *,
             layout: str = "interleaved") -> Timeline:
    """The timeline of `schedule` when every action starts as soon as its stage is free and its input
    has arrived. Costs are for one micro-batch through a whole stage (a number, or one per stage): F
    takes t_f, B t_b, W t_w, BW t_b + t_w; with v interleaved chunks per stage an action on one chunk
    takes 1/v of that (in the bidirectional layout, all of it, and an F&B pair starts when both its
    inputs are there). A message between stages takes t_comm. Exact with ints or Fractions as costs."""
    m = 1 + max((a.microbatch for actions in schedule for a in actions), default=0)
    check_schedule(schedule, m, layout=layout)
    place = _placement(schedule, layout)
    p = place.p
    costs = {name: _per_stage(value, p, name) for name, value in
             (("t_f", t_f), ("t_b", t_b), ("t_w", t_w))}
    if t_comm < 0:
        raise ValueError(f"t_comm must be >= 0, got {t_comm!r}")

    def duration(a: Action, s: int):
        f, b, w = costs["t_f"][s], costs["t_b"][s], costs["t_w"][s]
        total = {"F": f, "B": b, "W": w, "BW": b + w}[a.kind]
        return place.per_chunk(total)

    end: dict[tuple, float] = {}  # (kind, microbatch, virtual stage) -> finish time
    arrival: dict[tuple, float] = {}  # message -> when it is at the receiver
    busy: list[list[Interval]] = [[] for _ in range(p)]
    free = [0] * p
    pc = [0] * p
    messages = 0

    def input_time(a: Action, s: int):
        """When stage s has the input of action `a` (0 if it needs none), or None if not yet known."""
        inp = _input_of(a, s, place)
        if inp is None:
            return 0
        message, src = inp
        if src == s:  # from this stage's other chunk: that action's end
            kinds = ("F",) if a.kind == "F" else ("B", "BW")
            return next((end[(k, a.microbatch, message[2])] for k in kinds if (k, a.microbatch, message[2]) in end),
                        None)
        return arrival.get(message)

    progressed = True
    while progressed:  # each pass runs every stage as far as its inputs allow (check_schedule: no deadlock)
        progressed = False
        for s in range(p):
            while pc[s] < len(schedule[s]):
                a = schedule[s][pc[s]]
                pair = [a, schedule[s][pc[s] + 1]] if _paired(schedule[s], pc[s], place) else [a]
                inputs = [input_time(b, s) for b in pair]
                if None in inputs:
                    break
                ready = max(free[s], *inputs)
                finish = ready + duration(a, s)
                busy[s].append(Interval(ready, finish, a))
                end[(a.kind, a.microbatch, place.virtual(s, a.chunk))] = finish
                out = _output_of(a, s, place)
                if out and out[1] != s:
                    arrival[out[0]] = finish + t_comm
                    messages += 1
                free[s] = finish
                pc[s] += 1
                progressed = True
    timeline = timeline_from_intervals(busy, peak_in_flight(schedule, layout=layout), num_messages=messages,
                                       costs={"t_f": t_f, "t_b": t_b, "t_w": t_w, "t_comm": t_comm})
    timeline.parameters, timeline.layout = parameters_per_stage(schedule, layout=layout), layout
    return timeline


def timeline_from_intervals(busy: list[list[Interval]], peaks: list | None = None, *, start=None,
                            num_messages: int = 0, costs: dict | None = None) -> Timeline:
    """A Timeline from per-stage busy intervals (simulated or measured): idle gaps, total time from
    `start` (default: the earliest start) to the last end, and the bubble fraction."""
    starts = [i.start for intervals in busy for i in intervals]
    origin = min(starts, default=0) if start is None else start
    shifted = [[Interval(i.start - origin, i.end - origin, i.action) for i in sorted(intervals, key=_start)]
               for intervals in busy]
    total = max((i.end for intervals in shifted for i in intervals), default=0)
    idle, busy_time = [], 0
    for intervals in shifted:
        gaps, t = [], 0
        for i in intervals:
            if i.start > t:
                gaps.append(Interval(t, i.start))
            t = max(t, i.end)
            busy_time += i.end - i.start
        if total > t:
            gaps.append(Interval(t, total))
        idle.append(gaps)
    p = len(busy)
    bubble = (p * total - busy_time) / (p * total) if total else 0
    return Timeline(shifted, idle, total, bubble, list(peaks) if peaks is not None else [None] * p,
                    num_messages, dict(costs or {}))


def _start(interval: Interval):
    return interval.start

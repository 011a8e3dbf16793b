"""DualPipe's order of actions as data, for the simulator in `schedules` (layout "bidirectional").

DualPipe (DeepSeek-V3 technical report, 2024, section 3.2.1; the order follows the eight steps of
deepseek-ai/DualPipe's `DualPipe.step`) feeds micro-batches from both ends of the pipeline: stage
(rank) s holds model stage s for the micro-batches that enter at stage 0 (chunk 0) and model stage
p-1-s for those that enter at stage p-1 (chunk 1). Micro-batches 0 .. m/2-1 go down, m/2 .. m-1 go
up, as in the repository's example. Each stage pairs a forward of one direction with a backward of
the other, so that one's communication can hide under the other's computation (what the simulator
does not model: a pair costs F + B here), and splits some backwards into B and W to fill bubbles.

Stage s's half-rank h = min(s, p-1-s) counts from the nearer end; "near" is the direction whose
micro-batches enter at that end (chunk 0 for the first half of the stages, chunk 1 for the second).
"""

from __future__ import annotations

from collections import deque

from .schedules import Action


def dualpipe_schedule(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """DualPipe on p stages (p even) with m micro-batches (m even, at least 2p, as its reference code
    requires), for `simulate(..., layout="bidirectional")`."""
    p, m = num_stages, num_microbatches
    if p < 2 or p % 2:
        raise ValueError(f"num_stages must be even and >= 2, got {p}")
    if m % 2 or m < 2 * p:
        raise ValueError(f"num_microbatches must be even and >= 2 x num_stages = {2 * p}, got {m}")
    return [_stage(s, p, m) for s in range(p)]


def _stage(s: int, p: int, m: int) -> list[Action]:
    half, h = p // 2, min(s, p - 1 - s)
    near = 0 if s < half else 1  # the chunk whose micro-batches enter at this stage's end
    actions: list[Action] = []
    forwards, backwards = [0, 0], [0, 0]  # per chunk, how many done: micro-batches run in order
    weights: deque[Action] = deque()  # W of each split backward, run first in, first out

    def forward(far: bool) -> None:
        c = near ^ far
        actions.append(Action("F", c * m // 2 + forwards[c], c))
        forwards[c] += 1

    def backward(far: bool, split: bool = False) -> None:
        c = near ^ far
        mb = c * m // 2 + backwards[c]
        backwards[c] += 1
        actions.append(Action("B" if split else "BW", mb, c))
        if split:
            weights.append(Action("W", mb, c))

    def weight() -> None:
        actions.append(weights.popleft())

    for _ in range(2 * (half - h - 1)):  # 1: the near direction fills the pipe
        forward(False)
    for _ in range(h + 1):  # 2: both directions' forwards in turn
        forward(False)
        forward(True)
    for _ in range(half - h - 1):  # 3: the far direction's first backwards, split, each W right after
        backward(True, split=True)
        weight()
        forward(True)
    for _ in range(m // 2 - p + h + 1):  # 4: the steady state, a forward of one direction with a backward of the other
        forward(False)
        backward(True)
        forward(True)
        backward(False)
    for _ in range(half - h - 1):  # 5: the near forwards are done
        backward(True)
        forward(True)
        backward(False)
    split = False
    for i in range(h + 1):  # 6: the last backwards; the second half of them split
        if i == (h + 1) // 2 and h % 2 == 1:
            split = True
        backward(True, split)
        if i == (h + 1) // 2 and h % 2 == 0:
            split = True
        backward(False, split)
    for _ in range(half - h - 1):  # 7: W fills the bubbles of the draining pipe
        weight()
        backward(False, split=True)
    while weights:  # 8: the remaining weight gradients
        weight()
    return actions

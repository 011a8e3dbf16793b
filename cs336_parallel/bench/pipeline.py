"""A pipeline's measured timeline against the simulator's: 1F1B on 4 CPU ranks, compute-balanced stages.

`TimedStage` wraps a stage's module and records when its forwards and backwards run (wall clock,
comparable across the processes of one machine), without any help from the code that runs the
pipeline. `python -m cs336_parallel.bench pipeline` loads `run_pipeline` and `one_f_one_b_schedule`
from a notebook's answer cells (default: the master solution of 05_pipeline_schedules), measures the
bubble fraction of real steps and prints it next to the simulated one for the measured action times.
Target: within 0.05 absolute.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cs336_parallel.costs import bubble_fraction
from cs336_parallel.devices import device
from cs336_parallel.models import MLPStack
from cs336_parallel.notebook import load_definitions
from cs336_parallel.schedules import Action, Interval, Timeline, simulate, timeline_from_intervals

MASTER = Path(__file__).resolve().parents[2] / "grading/source/05_pipeline_schedules/05_pipeline_schedules.ipynb"
TARGET = 0.05


class _Stamp(torch.autograd.Function):
    """Identity in forward; calls `hook()` when its backward runs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, hook: Callable[[], None]) -> torch.Tensor:
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.hook()
        return grad, None


class TimedStage(nn.Module):
    """`module`, recording an Interval per forward and per backward pass through it, in `intervals`.

    A backward starts when the gradient reaches the module's output and ends with the last of the
    input gradient and the parameter gradients it computes: BW when it computes both, B for the input
    gradient alone, W for the parameters alone, whether they are computed with `torch.autograd.backward`
    or `torch.autograd.grad` (tensor hooks see both). Forwards are numbered in order: the k-th forward of
    a chunk is micro-batch k (true of every schedule in the course). Where the input needs no gradient
    (the first stage), a backward is reported as BW."""

    def __init__(self, module: nn.Module, chunk: int = 0):
        super().__init__()
        self.module, self.chunk = module, chunk
        self.intervals: list[Interval] = []
        self._forwards = 0
        self._open: dict | None = None  # the backward in progress
        self._hooks = [param.register_hook(self._weights_touched) for param in module.parameters()
                       if param.requires_grad]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._close()
        start, microbatch = time.perf_counter(), self._forwards
        self._forwards += 1
        needs_input = x.requires_grad
        if needs_input:
            x = _Stamp.apply(x, lambda: self._backward_touched("input"))
        y = _Stamp.apply(self.module(x), lambda: self._backward_starts(microbatch, needs_input))
        self.intervals.append(Interval(start, time.perf_counter(), Action("F", microbatch, self.chunk)))
        return y

    def _backward_starts(self, microbatch: int, needs_input: bool) -> None:
        self._close()
        self._open = {"start": time.perf_counter(), "end": None, "microbatch": microbatch,
                      "parts": set() if needs_input else {"input"}}

    def _weights_touched(self, grad: torch.Tensor) -> None:
        self._backward_touched("weights")

    def _backward_touched(self, part: str) -> None:
        if self._open is not None:
            self._open["end"] = time.perf_counter()
            self._open["parts"].add(part)

    def _close(self) -> None:
        """File the backward in progress (called when the next pass through this module begins)."""
        b, self._open = self._open, None
        if b is not None and b["end"] is not None:
            kind = {frozenset({"input", "weights"}): "BW", frozenset({"input"}): "B"}.get(frozenset(b["parts"]), "W")
            self.intervals.append(Interval(b["start"], b["end"], Action(kind, b["microbatch"], self.chunk)))

    def finish(self) -> list[Interval]:
        """Stop recording; the intervals recorded."""
        self._close()
        for hook in self._hooks:
            hook.remove()
        return self.intervals


def balanced_stages(dim: int, layers_per_stage: int, num_stages: int, *, seed: int = 0) -> list[nn.Module]:
    """A residual MLP stack cut into `num_stages` stages of equal compute (same layers each)."""
    model = MLPStack(dim, layers_per_stage * num_stages, seed=seed)
    stages = []
    for s in range(num_stages):
        stage = copy.deepcopy(model)
        stage.layers = stage.layers[s * layers_per_stage:(s + 1) * layers_per_stage]
        stages.append(stage)
    return stages


def measure_steps(run_pipeline, schedule_fn, num_microbatches: int, dim: int, batch: int, layers_per_stage: int,
                  steps: int) -> list[list[Interval]]:
    """On each rank: `steps` pipeline steps of this rank's stage, timed; per step, this rank's intervals."""
    p, rank = dist.get_world_size(), dist.get_rank()
    stage = balanced_stages(dim, layers_per_stage, p, seed=1)[rank].to(device())
    schedule = schedule_fn(p, num_microbatches)
    xs = [torch.randn(batch, dim, generator=torch.Generator().manual_seed(i)).to(device())
          for i in range(num_microbatches)]
    ts = [torch.randn(batch, dim, generator=torch.Generator().manual_seed(1000 + i)).to(device())
          for i in range(num_microbatches)]
    per_step = []
    for step in range(steps + 1):  # the first step warms up
        timed = TimedStage(stage)
        dist.barrier()
        run_pipeline([timed], schedule, xs, ts, F.mse_loss)
        stage.zero_grad(set_to_none=True)
        if step:
            per_step.append(timed.finish())
    return per_step


def measured_and_simulated(per_rank: list[list[Interval]], schedule, *,
                           scale: float = 1e3) -> tuple[Timeline, Timeline]:
    """The measured timeline of one step (times x `scale`: milliseconds by default), and the simulator's
    for the same schedule with each stage's median measured forward and whole-backward times (messages
    free, as the closed form assumes). A micro-batch's backward is whatever its passes took together:
    one BW, or a B and a W, however the pipeline computed them."""
    scaled = [[Interval(i.start * scale, i.end * scale, i.action) for i in intervals] for intervals in per_rank]
    measured = timeline_from_intervals(scaled)
    forwards, backwards = [], []
    for intervals in scaled:
        backward: dict[tuple, float] = {}
        for i in intervals:
            if i.action.kind != "F":
                key = (i.action.microbatch, i.action.chunk)
                backward[key] = backward.get(key, 0.0) + i.end - i.start
        forwards.append(statistics.median(i.end - i.start for i in intervals if i.action.kind == "F"))
        backwards.append(statistics.median(backward.values()))
    simulated = simulate(schedule, t_f=forwards, t_b=backwards, t_w=0, t_comm=0)
    return measured, simulated


def main(args=None) -> None:
    notebook = Path(getattr(args, "notebook", None) or MASTER)
    names = ["run_pipeline", "one_f_one_b_schedule"]
    defs = load_definitions(notebook, names)
    run_pipeline, one_f_one_b = (defs[n] for n in names)
    p, m, dim, batch, layers, steps = 4, 8, 768, 64, 2, 5
    cores = os.cpu_count() or 1
    print(f"1F1B, {p} CPU ranks, {m} micro-batches of {batch} x {dim}, {layers} residual MLP layers per stage, "
          f"{steps} steps; run_pipeline from {notebook.name}")
    if cores < p:
        print(f"note: {cores} CPU cores for {p} ranks: ranks that compute at the same time share cores, which "
              f"stretches the steady state more than the warm-up; the comparison is only fair with >= {p} cores")
    from cs336_parallel import session_cluster  # here: the tests' code imports TimedStage, not the rank runtime

    results = session_cluster(p, backend="gloo").run(measure_steps, run_pipeline, one_f_one_b, m, dim, batch,
                                                     layers, steps)
    schedule = one_f_one_b(p, m)
    rows = []
    for step in range(steps):
        measured, simulated = measured_and_simulated([results[r][step] for r in range(p)], schedule)
        rows.append((measured.bubble_fraction, simulated.bubble_fraction, measured.total_time))
        print(f"step {step}: {measured.total_time:7.1f} ms; bubble measured {measured.bubble_fraction:.3f}, "
              f"simulated {simulated.bubble_fraction:.3f}")
    got, want = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
    formula = bubble_fraction(p, m)
    verdict = "met" if abs(got - want) <= TARGET else "MISSED"
    print(f"\nmedian bubble fraction: measured {got:.3f}, simulated {want:.3f} (closed form (p-1)/(m+p-1) = "
          f"{formula:.3f}); |difference| = {abs(got - want):.3f} (target <= {TARGET}: {verdict})")

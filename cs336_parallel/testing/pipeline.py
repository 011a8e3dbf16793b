"""Notebook 05's tests: the four schedules, the stage partition, and `run_pipeline` on ranks.

A schedule comes back from the notebook as data (an `Action` crosses as an `Action`, a plain tuple as a tuple); the
package's own checker and simulator judge it here, against the orders and closed forms the specs give.

`run_pipeline` runs on the grader's ranks, each holding only what a pipeline stage holds: the weights of its own
chunks (drawn here), the micro-batches on rank 0 alone, the targets on the last rank alone, and placeholders of the
right shape elsewhere. The ground truth is one process training the whole model on the same data; the activations
and gradients must be seen crossing between the ranks (`checks.assert_received`)."""

from __future__ import annotations

import math
from fractions import Fraction

import torch
import torch.nn.functional as F

from cs336_parallel import checks, models, probes
from cs336_parallel.bench.pipeline import TimedStage
from cs336_parallel.schedules import Action, check_schedule, parse, simulate
from cs336_parallel.testing.training import redraw


def _expect(ok: bool, message: str) -> None:
    """One counted comparison: AssertionError(`message`) unless `ok`."""
    checks.count_comparison()
    if not ok:
        raise AssertionError(message)


def line(actions: list) -> str:
    """'F0 F1 BW0 BW1': a stage's actions as `parse` reads them."""
    return " ".join(map(str, actions))


def lines(schedule: list) -> list[str]:
    return [line(actions) for actions in schedule]


# -- schedules, judged by the package's checker and simulator ------------------------------------------------------

def _called(schedule_fn, args: tuple) -> str:
    return f"{schedule_fn.__name__}({', '.join(map(repr, args))})"


def as_schedule(result, call: str, num_stages: int, m: int) -> list[list[Action]]:
    """What `call` returned, once it is a list of `num_stages` lists of `Action`s that the package's checker accepts
    (its error names the first bad action). A plain tuple is not an Action: the notebook's own `simulate` and
    `check_schedule` refuse it."""
    _expect(isinstance(result, list) and len(result) == num_stages,
            f"{call}: expected a list of {num_stages} lists of actions (one per stage), got "
            f"{len(result) if isinstance(result, list) else type(result).__name__}")
    for s, actions in enumerate(result):
        _expect(isinstance(actions, list), f"{call}: stage {s} should be a list of actions, got "
                                           f"{type(actions).__name__}")
        for i, a in enumerate(actions):
            _expect(isinstance(a, Action), f"{call}: stage {s}, action {i} is a {type(a).__name__} "
                                           f"{a!r}, not an Action(kind, microbatch, chunk) (simulate and "
                                           "check_schedule take Actions)")
    try:
        check_schedule(result, m)
    except ValueError as e:
        raise AssertionError(f"{call} is not a valid schedule: {e}") from None
    checks.count_comparison()
    return result


def valid(schedule_fn, num_stages: int, m: int, *more) -> list[list[Action]]:
    """`schedule_fn(num_stages, m, *more)`, a valid schedule (see `as_schedule`)."""
    args = (num_stages, m, *more)
    return as_schedule(schedule_fn(*args), _called(schedule_fn, args), num_stages, m)


def valid_each(schedule_fn, cases: list[tuple]) -> list[list[list[Action]]]:
    """`valid` for every case (num_stages, m, ...), in one request to the notebook."""
    results = checks.call_each(schedule_fn, cases)
    return [as_schedule(result, _called(schedule_fn, case), case[0], case[1])
            for case, result in zip(cases, results, strict=True)]


def assert_schedule(schedule_fn, args: tuple, expected: list[str]) -> None:
    """`schedule_fn(*args)` is exactly `expected`, one line per stage."""
    got = lines(valid(schedule_fn, *args))
    _expect(got == expected, f"{_called(schedule_fn, args)}: {got}, expected {expected}")


def idle_per_stage(schedule: list, t_f, t_b, t_w):
    """Total time minus each stage's own work, exactly (Fractions), and the timeline, with these costs."""
    timeline = simulate(schedule, t_f=Fraction(t_f), t_b=Fraction(t_b), t_w=Fraction(t_w))
    m = 1 + max(a.microbatch for actions in schedule for a in actions)
    return timeline.total_time - m * (Fraction(t_f) + Fraction(t_b) + Fraction(t_w)), timeline


def _in_order(actions: list, kind: str, m: int, call: str, chunk: int | None = None) -> None:
    """The stage's actions of `kind` (on `chunk`, if given) go through micro-batches 0 ... m-1 in order."""
    order = [a.microbatch for a in actions if a.kind == kind and chunk in (None, a.chunk)]
    _expect(order == list(range(m)), f"{call}: {kind} in the micro-batch order {order}, expected 0 ... {m - 1}")


def _forwards_before_backwards(actions: list, warmup: int, m: int, backward: str, call: str) -> None:
    """1F1B's shape: `warmup` forwards, then one forward before each backward while forwards remain, then the rest;
    so the j-th backward comes after min(warmup + 1 + j, m) forwards."""
    seen, counts = 0, []
    for a in actions:
        seen += a.kind == "F"
        if a.kind == backward:
            counts.append(seen)
    expected = [min(warmup + 1 + j, m) for j in range(m)]
    _expect(counts == expected, f"{call}: {line(actions)}: forwards before each {backward}: {counts}, expected "
                                f"{expected} ({warmup} warm-up forwards, then one forward and one backward in turn)")


def check_gpipe(gpipe_schedule, cases: list[tuple[int, int]], costs: list[tuple]) -> None:
    """Every stage: F0 ... F(m-1), then BW0 ... BW(m-1); bubble (p-1)/(m+p-1) exactly with these costs, and m
    micro-batches in flight on every stage."""
    for (p, m), schedule in zip(cases, valid_each(gpipe_schedule, cases), strict=True):
        call = f"gpipe_schedule({p}, {m})"
        order = " ".join([f"F{i}" for i in range(m)] + [f"BW{i}" for i in range(m)])
        for s, actions in enumerate(schedule):
            _expect(line(actions) == order, f"{call}, stage {s}: {line(actions)}, expected {order}")
        for t_f, t_b, t_w in costs:
            _, timeline = idle_per_stage(schedule, t_f, t_b, t_w)
            _expect(timeline.bubble_fraction == Fraction(p - 1, m + p - 1),
                    f"{call}, costs {t_f, t_b, t_w}: bubble {timeline.bubble_fraction}, expected (p-1)/(m+p-1)")
        _expect(timeline.peak_in_flight == [m] * p, f"{call}: in flight {timeline.peak_in_flight}, expected {m} "
                                                    "on every stage")


def check_one_f_one_b(one_f_one_b_schedule, cases: list[tuple[int, int]], costs: list[tuple]) -> None:
    """Stage s: min(p-s-1, m) warm-up forwards, then F and BW in turn, then the rest, each in micro-batch order;
    bubble (p-1)/(m+p-1) exactly, min(p-s, m) micro-batches in flight on stage s."""
    for (p, m), schedule in zip(cases, valid_each(one_f_one_b_schedule, cases), strict=True):
        call = f"one_f_one_b_schedule({p}, {m})"
        for s, actions in enumerate(schedule):
            where = f"{call}, stage {s}"
            _in_order(actions, "F", m, where)
            _in_order(actions, "BW", m, where)
            _forwards_before_backwards(actions, min(p - s - 1, m), m, "BW", where)
        for t_f, t_b, t_w in costs:
            _, timeline = idle_per_stage(schedule, t_f, t_b, t_w)
            _expect(timeline.bubble_fraction == Fraction(p - 1, m + p - 1),
                    f"{call}, costs {t_f, t_b, t_w}: bubble {timeline.bubble_fraction}, expected (p-1)/(m+p-1)")
        peaks = [min(p - s, m) for s in range(p)]
        _expect(timeline.peak_in_flight == peaks, f"{call}: in flight {timeline.peak_in_flight}, expected {peaks}")


def check_interleaved(interleaved_schedule, cases: list[tuple[int, int, int]], costs: list[tuple]) -> None:
    """The spec's forward and backward orders; bubble (p-1)/(vm+p-1) exactly, 2m(vp-1) messages, and the peak in
    flight the warm-up leaves (one more forward than the warm-up, 1/v of a micro-batch each)."""
    for (p, m, v), schedule in zip(cases, valid_each(interleaved_schedule, cases), strict=True):
        call = f"interleaved_schedule({p}, {m}, {v})"
        forwards = [Action("F", k // (p * v) * p + k % p, k // p % v) for k in range(m * v)]
        backwards = [Action("BW", k // (p * v) * p + k % p, v - 1 - k // p % v) for k in range(m * v)]
        for s, actions in enumerate(schedule):
            _expect([a for a in actions if a.kind == "F"] == forwards, f"{call}, stage {s}: forwards {line(actions)}")
            _expect([a for a in actions if a.kind == "BW"] == backwards,
                    f"{call}, stage {s}: backwards {line(actions)}")
            _forwards_before_backwards(actions, min(2 * (p - s - 1) + (v - 1) * p, m * v), m * v, "BW",
                                       f"{call}, stage {s}")
        for t_f, t_b, t_w in costs:
            _, timeline = idle_per_stage(schedule, t_f, t_b, t_w)
            _expect(timeline.bubble_fraction == Fraction(p - 1, v * m + p - 1),
                    f"{call}, costs {t_f, t_b, t_w}: bubble {timeline.bubble_fraction}, expected (p-1)/(vm+p-1)")
        _expect(timeline.num_messages == 2 * m * (v * p - 1),
                f"{call}: {timeline.num_messages} messages, expected 2m(vp-1) = {2 * m * (v * p - 1)}")


def zero_bubble_idle(p: int, t_f, t_b, t_w):
    """Idle time per stage of ZB-H1's order with m >= p: (p-1)(t_F + t_B - t_W) while a W fits the gaps it fills
    (t_W <= t_F and t_W <= t_B); a longer W fills only min(t_F, t_B) of each."""
    return (p - 1) * (t_f + t_b - min(t_w, t_f, t_b))


def _ws_after_each_b(actions: list) -> list[int]:
    """How many Ws follow each B directly, B by B (a W anywhere else counts for none)."""
    runs, previous = [], None
    for a in actions:
        if a.kind == "B":
            runs.append(0)
        elif a.kind == "W" and previous in ("B", "W"):
            runs[-1] += 1
        previous = a.kind
    return runs


def check_zero_bubble(zero_bubble_schedule, cases: list[tuple[int, int]], costs: list[tuple]) -> None:
    """Stage s: 1F1B with B for BW; right after the B of steady-state micro-batch i, a W if i >= s; after each B of
    the cool-down, a W; the rest at the end; every W the oldest still owed. Then the closed forms: idle time
    (`zero_bubble_idle`) with m >= p, and at most min(p, m) micro-batches in flight."""
    for (p, m), schedule in zip(cases, valid_each(zero_bubble_schedule, cases), strict=True):
        call = f"zero_bubble_schedule({p}, {m})"
        for s, actions in enumerate(schedule):
            where = f"{call}, stage {s}"
            _expect(not any(a.kind == "BW" for a in actions), f"{where}: {line(actions)}: split every BW into B and W")
            warmup = min(p - s - 1, m)
            _in_order(actions, "F", m, where)
            _in_order(actions, "B", m, where)
            _in_order(actions, "W", m, f"{where}: {line(actions)}: each W the oldest still owed;")
            _forwards_before_backwards(actions, warmup, m, "B", where)
            runs = _ws_after_each_b(actions)
            due = [j >= s or j >= m - warmup for j in range(m - 1)]  # steady state from micro-batch s; cool-down
            expected = [int(d) for d in due] + [m - sum(due)]  # the Ws still owed come last
            _expect(runs == expected, f"{where}: {line(actions)}: Ws right after each B: {runs}, expected {expected}")
        for t_f, t_b, t_w in costs:
            idle, timeline = idle_per_stage(schedule, t_f, t_b, t_w)
            if m >= p:
                want = zero_bubble_idle(p, t_f, t_b, t_w)
                _expect(idle == want, f"{call}, costs {t_f, t_b, t_w}: idle {idle} per stage, expected {want}")
        _expect(timeline.peak_in_flight == [min(p, m)] * p,
                f"{call}: in flight {timeline.peak_in_flight}, expected {min(p, m)} on every stage")


# -- partition_layers ----------------------------------------------------------------------------------------------

def _stages_below(costs: list[Fraction], limit: Fraction) -> float:
    """The fewest stages of consecutive pieces that each take less than `limit` (inf if one piece alone does not):
    filling each stage while it stays below the limit is the fewest, since a stage that stops earlier never helps."""
    stages, current = 1, Fraction(0)
    for c in costs:
        if c >= limit:
            return math.inf
        if current + c >= limit:
            stages, current = stages + 1, c
        else:
            current += c
    return stages


def check_partition(partition_layers, cases: list[tuple[list, int]]) -> None:
    """For every (costs, num_stages): num_stages whole counts, each at least 1, summing to len(costs); and no split
    of the pieces has a faster slowest stage (exact arithmetic on the costs)."""
    for (costs, p), counts in zip(cases, checks.call_each(partition_layers, cases), strict=True):
        shown = costs if len(costs) <= 8 else f"{len(costs)} pieces"
        call = f"partition_layers({shown}, {p})"
        _expect(isinstance(counts, (list, tuple)) and len(counts) == p,
                f"{call} returned {counts!r}: expected {p} counts, one per stage")
        for s, c in enumerate(counts):
            _expect(checks.is_number(c) and math.isfinite(c) and c == int(c) and c >= 1,
                    f"{call} returned {list(counts)}: stage {s} takes {c!r} pieces; every stage takes a whole number, "
                    "at least one")
        counts = [int(c) for c in counts]
        _expect(sum(counts) == len(costs), f"{call} returned {counts}: {sum(counts)} pieces, the model has "
                                           f"{len(costs)}")
        exact = [Fraction(c) for c in costs]
        starts = [sum(counts[:s]) for s in range(p)]
        slowest = max(sum(exact[a:a + c]) for a, c in zip(starts, counts, strict=True))
        _expect(_stages_below(exact, slowest) > p,
                f"{call} returned {counts}, whose slowest stage takes {float(slowest):g}: another split's slowest "
                "stage is faster")


# -- run_pipeline on ranks -----------------------------------------------------------------------------------------

DIM, HIDDEN, ROWS = 8, 16, 4  # the model's width, its layers' hidden size; a micro-batch is ROWS x DIM
LAYERS_PER_CHUNK = 2

PIPELINES = {  # name: (one schedule line per rank, chunks per rank, micro-batches)
    "GPipe, 2 ranks": (["F0 F1 F2 F3 BW0 BW1 BW2 BW3"] * 2, 1, 4),
    "1F1B, 4 ranks": (["F0 F1 F2 F3 BW0 BW1 BW2 BW3", "F0 F1 F2 BW0 F3 BW1 BW2 BW3", "F0 F1 BW0 F2 BW1 F3 BW2 BW3",
                       "F0 BW0 F1 BW1 F2 BW2 F3 BW3"], 1, 4),
    "1F1B, 2 ranks": (["F0 F1 BW0 F2 BW1 F3 BW2 BW3", "F0 BW0 F1 BW1 F2 BW2 F3 BW3"], 1, 4),
    "1F1B, 3 ranks, 5 micro-batches": (["F0 F1 F2 BW0 F3 BW1 F4 BW2 BW3 BW4", "F0 F1 BW0 F2 BW1 F3 BW2 F4 BW3 BW4",
                                        "F0 BW0 F1 BW1 F2 BW2 F3 BW3 F4 BW4"], 1, 5),
    "1F1B, 4 ranks, 2 micro-batches": (["F0 F1 BW0 BW1"] * 3 + ["F0 BW0 F1 BW1"], 1, 2),
    "B and W, 2 ranks": (["F0 F1 B0 F2 W0 B1 W1 B2 W2", "F0 F1 B0 W0 F2 B1 W1 B2 W2"], 1, 3),
    "B and W, 4 ranks": (["F0 F1 F2 F3 B0 B1 W1 B2 W0 B3 W3 W2", "F0 F1 F2 F3 B0 W0 B1 B2 W2 B3 W1 W3",
                          "F0 F1 F2 F3 B0 B1 B2 B3 W3 W2 W1 W0", "F0 F1 F2 F3 B0 W0 B1 W1 B2 W2 B3 W3"], 1, 4),
    "B and W, 3 ranks": (["F0 F1 B0 B1 W1 W0"] * 3, 1, 2),
    "2 chunks, 2 ranks": (["F0 F0c1 F1 F1c1 BW0c1 BW0 BW1c1 BW1"] * 2, 2, 2),
    "2 chunks, 4 ranks": (["F0 F0c1 F1 F1c1 F2 F2c1 F3 F3c1 BW0c1 BW0 BW1c1 BW1 BW2c1 BW2 BW3c1 BW3"] * 4, 2, 4),
    "2 chunks, 3 ranks, chunk by chunk": (["F0 F1 F0c1 F1c1 BW0c1 BW1c1 BW0 BW1"] * 3, 2, 2),
    "3 chunks, 2 ranks": (["F0 F0c1 F0c2 F1 F1c1 F1c2 BW0c2 BW0c1 BW0 BW1c2 BW1c1 BW1"] * 2, 3, 2),
}


def _chunk_model(dtype: torch.dtype) -> models.MLPStack:
    """One virtual stage: LAYERS_PER_CHUNK residual MLP layers (the weights are set by whoever builds it)."""
    return models.MLPStack(DIM, LAYERS_PER_CHUNK, hidden=HIDDEN).to(dtype)


def pipeline_driver(run_pipeline, name: str, dtype: torch.dtype, chunks: list, microbatches: list | None,
                    targets: list | None) -> dict:
    """On a rank: its chunks as a stage holds them (`chunks`: per chunk, the weights and the `.grad` each parameter
    starts with), each timed by TimedStage, and run_pipeline with the schedule PIPELINES[name]. Only rank 0 is given
    the micro-batches and only the last rank the targets (None here: zeros of their shape stand in). Returns the loss,
    the chunks' gradients, the messages this rank sent, and its passes as TimedStage saw them."""
    lines_, _, m = PIPELINES[name]
    mine = []
    for c, (state, grads) in enumerate(chunks):
        module = _chunk_model(dtype)
        module.load_state_dict(state)
        for n, q in module.named_parameters():
            q.grad = grads[n].clone()
        mine.append(TimedStage(module, c))
    placeholder = [torch.zeros(ROWS, DIM, dtype=dtype) for _ in range(m)]
    with probes.count_collectives() as comm:
        loss = run_pipeline(mine, [parse(text) for text in lines_], microbatches or placeholder,
                            targets or placeholder, F.mse_loss)
    return {"loss": loss, "grads": [{n: q.grad for n, q in chunk.module.named_parameters()} for chunk in mine],
            "comm": comm.record(), "passes": [str(i.action) for chunk in mine for i in chunk.finish()]}


def _piece(tensors: dict, k: int) -> dict:
    """Virtual stage k's entries of a whole model's {name: tensor}, named as in one chunk (layers.0, layers.1)."""
    piece = {}
    for j in range(LAYERS_PER_CHUNK):
        prefix = f"layers.{LAYERS_PER_CHUNK * k + j}."
        piece.update({f"layers.{j}.{n[len(prefix):]}": t for n, t in tensors.items() if n.startswith(prefix)})
    return piece


def check_pipeline(run_pipeline, name: str, dtype: torch.dtype = torch.float32) -> list:
    """Run the schedule PIPELINES[name] on its ranks, each holding its own chunks and data only: point-to-point
    messages only (checked by every test), as many as the schedule needs, and the activations and gradients seen
    crossing between the ranks; the loss on the last rank (None on the others) and every gradient, accumulated into
    the `.grad` it started with, as one process training the whole model computes them. Returns each rank's
    passes."""
    lines_, v, m = PIPELINES[name]
    p, last = len(lines_), len(lines_) * v - 1
    g = checks.generator()
    model = models.MLPStack(DIM, LAYERS_PER_CHUNK * p * v, hidden=HIDDEN).to(dtype)
    state = redraw(model, g)
    start = {n: checks.random_tensor(tuple(q.shape), dtype, generator=g) for n, q in model.named_parameters()}
    xs = [checks.random_tensor((ROWS, DIM), dtype, generator=g) for _ in range(m)]
    ts = [checks.random_tensor((ROWS, DIM), dtype, generator=g) for _ in range(m)]
    per_rank = [([(_piece(state, c * p + r), _piece(start, c * p + r)) for c in range(v)],
                 xs if r == 0 else None, ts if r == p - 1 else None) for r in range(p)]
    got = checks.run(p, pipeline_driver, run_pipeline, name, dtype, per_rank=per_rank)
    for rank, result in enumerate(got):
        checks.assert_point_to_point(result["comm"], "run_pipeline", rank=rank)

    for n, q in model.named_parameters():  # ground truth: one process, the whole model, the same .grad to start
        q.grad = start[n].clone()
    expected = sum(F.mse_loss(model(x), t) for x, t in zip(xs, ts, strict=True)) / m
    expected.backward()
    grads = {n: q.grad for n, q in model.named_parameters()}
    case = f"{name} ({dtype})"
    for rank, result in enumerate(got):
        if rank == p - 1:
            checks.assert_close(result["loss"], expected.detach(), name=f"{case}: the loss", rank=rank, rtol=1e-5,
                                atol=1e-6)  # float32 sums in another order
        else:
            _expect(result["loss"] is None, f"rank {rank}: {case}: only the last rank returns the loss, got "
                                            f"{type(result['loss']).__name__}")
        _expect(len(result["grads"]) == v, f"rank {rank}: {case}: {len(result['grads'])} chunks reported")
        for c, chunk_grads in enumerate(result["grads"]):
            for n, want in _piece(grads, c * p + rank).items():
                checks.assert_close(chunk_grads[n], want, name=f"{case}: chunk {c}'s {n}.grad (accumulated into the "
                                                               ".grad it held)", rank=rank, rtol=1e-5, atol=1e-6)
        virtual = [(a, a.chunk * p + rank) for a in parse(lines_[rank])]
        needed = sum((a.kind == "F" and k < last) or (a.kind in ("B", "BW") and k > 0) for a, k in virtual)
        sent = sum(op == "send" for op, _, _ in result["comm"]["calls"])
        _expect(sent == needed, f"rank {rank}: {case}: sent {sent} messages, the schedule needs {needed}")
    # A micro-batch's activation reaches every virtual stage but the first, its gradient every one but the last.
    message = ROWS * DIM * xs[0].element_size()
    received = [m * message * sum((c * p + r > 0) + (c * p + r < last) for c in range(v)) for r in range(p)]
    checks.assert_received(received, f"{case}: activations and gradients between the stages")
    return [result["passes"] for result in got]


def assert_split(passes: list, name: str) -> None:
    """Each B computed the input's gradient only, each W the parameters' only, when the schedule says (rank 0's
    input needs no gradient: its B computes nothing, and TimedStage reports its W as a whole backward, BW)."""
    for rank, (got, text) in enumerate(zip(passes, PIPELINES[name][0], strict=True)):
        expected = []
        for a in parse(text):
            if a.kind == "F" or rank > 0:
                expected.append(str(a))
            elif a.kind == "W":
                expected.append(f"BW{a.microbatch}")
        _expect(got == expected, f"rank {rank}: {name}: the passes ran as {' '.join(got)}, the schedule asks for "
                                 f"{' '.join(expected)} (B: the input's gradient only; W: the parameters' only)")


def refused_driver(run_pipeline, lines_: list, num_targets: int) -> dict:
    """On a rank: what run_pipeline did on 2 micro-batches with these schedule lines and `num_targets` targets (the
    test wants ValueError before any message), and the messages this rank sent."""
    stage = [_chunk_model(torch.float32)]
    xs, ts = [torch.zeros(ROWS, DIM)] * 2, [torch.zeros(ROWS, DIM)] * num_targets
    with probes.count_collectives() as comm:
        result = probes.outcome(run_pipeline, stage, [parse(text) for text in lines_], xs, ts, F.mse_loss)
    if "returned" in result:
        result["returned"] = type(result["returned"]).__name__
    return {**result, "comm": comm.record()}


def assert_refused(run_pipeline, lines_: list, num_targets: int, rule: str) -> None:
    """On 2 ranks, run_pipeline raises ValueError before sending anything: the call breaks `rule`."""
    for rank, result in enumerate(checks.run(2, refused_driver, run_pipeline, lines_, num_targets)):
        case = f"run_pipeline on 2 ranks with {rule}"
        checks.assert_raised(result, ValueError, case, rank=rank)
        checks.assert_point_to_point(result["comm"], "run_pipeline", rank=rank)
        _expect(not result["comm"]["calls"],
                f"rank {rank}: {case}: {len(result['comm']['calls'])} messages before the ValueError (check first)")

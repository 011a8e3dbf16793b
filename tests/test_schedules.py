"""The schedule toolkit against closed forms: bubble fractions, warm-up counts, peak in-flight
micro-batches; the checker's errors; DualPipe's bidirectional layout against DeepSeek-V3's Table 2; the
Gantt chart and the explorer.

The package ships no generators of the schedules the notebook asks for (they are its exercises), so the
reference ones used here live in this file; DualPipe's, which the notebook only draws, is the package's."""

from __future__ import annotations

import itertools
import statistics
import subprocess
import sys
from fractions import Fraction

import pytest

from common import ROOT
from cs336_parallel.dualpipe import dualpipe_schedule
from cs336_parallel.schedules import (
    Action,
    Interval,
    check_schedule,
    format_schedule,
    num_chunks,
    parameters_per_stage,
    parse,
    peak_in_flight,
    simulate,
    timeline_from_intervals,
)

# -- reference generators ------------------------------------------------------------------------


def gpipe(p: int, m: int) -> list[list[Action]]:
    return [[Action("F", i) for i in range(m)] + [Action("BW", i) for i in range(m)] for _ in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    schedule = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action("F", warmup + i), Action("BW", i)]
        schedule.append(actions + [Action("BW", i) for i in range(m - warmup, m)])
    return schedule


def interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    """Megatron's order: micro-batches in groups of p, chunk by chunk; backward chunks reversed."""
    if m % p:
        raise ValueError(f"num_microbatches ({m}) must be a multiple of num_stages ({p})")
    def forward(k: int) -> Action:
        return Action("F", k // (p * v) * p + k % p, k // p % v)

    def backward(k: int) -> Action:
        return Action("BW", k // (p * v) * p + k % p, v - 1 - k // p % v)

    schedule, total = [], m * v
    for s in range(p):
        warmup = min(2 * (p - s - 1) + (v - 1) * p, total)
        actions = [forward(k) for k in range(warmup)]
        for i in range(total - warmup):
            actions += [forward(warmup + i), backward(i)]
        schedule.append(actions + [backward(k) for k in range(total - warmup, total)])
    return schedule


def zero_bubble_h1(p: int, m: int) -> list[list[Action]]:
    """1F1B with B and W split; stage s lets its W lag s micro-batches behind (p in flight everywhere)."""
    schedule = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions, next_w = [Action("F", i) for i in range(warmup)], 0
        for i in range(m - warmup):
            actions += [Action("F", warmup + i), Action("B", i)]
            if i >= s:
                actions.append(Action("W", next_w))
                next_w += 1
        for i in range(m - warmup, m):
            actions.append(Action("B", i))
            actions.append(Action("W", next_w))
            next_w += 1
        schedule.append(actions + [Action("W", j) for j in range(next_w, m)])
    return schedule


STAGES = range(1, 9)
MICROBATCHES = [1, 2, 3, 4, 5, 7, 8, 12, 16]
COSTS = [(1, 2, 0), (1, 1, 1), (3, 1, 5), (2, 5, 1)]  # (t_f, t_b, t_w), exact as Fractions


def fr(*costs):
    return [Fraction(c) for c in costs]


# -- closed forms --------------------------------------------------------------------------------


@pytest.mark.parametrize("generator", [gpipe, one_f_one_b])
def test_gpipe_and_1f1b_bubble_is_exactly_p_minus_1_over_m_plus_p_minus_1(generator):
    for p, m, costs in itertools.product(STAGES, MICROBATCHES, COSTS):
        timeline = simulate(generator(p, m), *fr(*costs), t_comm=0)
        assert timeline.bubble_fraction == Fraction(p - 1, m + p - 1), (generator.__name__, p, m, costs)
        t_f, t_b, t_w = costs
        assert timeline.total_time == (m + p - 1) * (t_f + t_b + t_w)


def test_peak_in_flight_gpipe_m_and_1f1b_p_minus_s():
    for p, m in itertools.product(STAGES, MICROBATCHES):
        assert simulate(gpipe(p, m)).peak_in_flight == [m] * p
        assert simulate(one_f_one_b(p, m)).peak_in_flight == [min(p - s, m) for s in range(p)]


def test_1f1b_warmup_counts():
    for p, m in itertools.product(STAGES, MICROBATCHES):
        for s, actions in enumerate(one_f_one_b(p, m)):
            first_backward = next(i for i, a in enumerate(actions) if a.kind == "BW")
            assert first_backward == min(p - s, m)  # p - s - 1 warm-up forwards and the first steady one


def test_interleaved_divides_the_bubble_time_by_v():
    for p, v, (t_f, t_b, t_w) in itertools.product([2, 3, 4, 8], [1, 2, 3, 4], COSTS):
        for m in (p, 2 * p, 3 * p):
            work = m * (t_f + t_b + t_w)  # per stage, whatever the number of chunks
            inter = simulate(interleaved(p, m, v), *fr(t_f, t_b, t_w))
            plain = simulate(one_f_one_b(p, m), *fr(t_f, t_b, t_w))
            assert (inter.total_time - work) * v == plain.total_time - work
            assert inter.bubble_fraction == Fraction(p - 1, v * m + p - 1)
            if v > 1:
                assert inter.bubble_fraction < plain.bubble_fraction
            assert inter.num_messages == 2 * m * (v * p - 1)  # vs 2 m (p - 1): about v times more
            assert plain.num_messages == 2 * m * (p - 1)


def test_interleaved_keeps_more_activations_than_1f1b():
    p, m, v = 4, 8, 2
    peaks = simulate(interleaved(p, m, v)).peak_in_flight
    # Megatron's warm-up: 2 (p - s - 1) + (v - 1) p forwards, then one more; each chunk holds 1/v.
    assert peaks == [(2 * (p - s - 1) + (v - 1) * p + 1) / v for s in range(p)]


def test_zero_bubble_h1_bubble_and_memory():
    for p, m in itertools.product([2, 3, 4, 8], [1, 2, 3, 4, 8, 9, 16]):
        for t_f, t_b, t_w in [(1, 1, 1), (2, 2, 1), (1, 2, 1), (3, 1, 1)]:
            zb = simulate(zero_bubble_h1(p, m), *fr(t_f, t_b, t_w))
            plain = simulate(one_f_one_b(p, m), *fr(t_f, t_b, t_w))
            assert zb.bubble_fraction < plain.bubble_fraction
            assert max(zb.peak_in_flight) <= max(plain.peak_in_flight)
            if m >= p:  # ZB-H1 (Qi et al. 2023): bubble (p-1)(T_F + T_B - T_W) against (p-1)(T_F + T_B + T_W)
                assert zb.total_time - m * (t_f + t_b + t_w) == (p - 1) * (t_f + t_b - t_w)
                assert plain.total_time - m * (t_f + t_b + t_w) == (p - 1) * (t_f + t_b + t_w)
                assert zb.peak_in_flight == [p] * p


def test_every_reference_schedule_is_valid():
    for p, m in itertools.product(STAGES, MICROBATCHES):
        for schedule in (gpipe(p, m), one_f_one_b(p, m), zero_bubble_h1(p, m)):
            check_schedule(schedule, m)
        for v in (1, 2, 3):
            if m % p == 0:
                check_schedule(interleaved(p, m, v), m)


# -- DualPipe: the bidirectional layout -----------------------------------------------------------


def test_dualpipe_is_valid_and_sends_each_half_of_the_microbatches_one_way():
    for p, m in itertools.product([2, 4, 6, 8], [16, 18, 24]):
        schedule = dualpipe_schedule(p, m)
        check_schedule(schedule, m, layout="bidirectional")
        for actions in schedule:
            assert sorted((a.microbatch, a.chunk) for a in actions if a.kind == "F") == [
                (i, int(i >= m // 2)) for i in range(m)]  # the first half down (chunk 0), the second up


def test_dualpipe_bubble_is_deepseek_v3s_table_2_when_backward_for_input_is_the_longest():
    """Table 2 of the DeepSeek-V3 report: DualPipe's bubble (PP/2-1)(F&B + B - 3W), B the full backward, F&B
    a forward and a backward run as one overlapped pair (here F + B: the simulator overlaps nothing),
    against ZB1P's (PP-1)(F + B - 2W). It holds when t_F <= t_B and t_W <= t_B; otherwise the simulated
    bubble is larger, still no larger than ZB-H1's; and it does not grow with m."""
    for p, (t_f, t_b, t_w) in itertools.product([2, 4, 6, 8], itertools.product([1, 2, 3], repeat=3)):
        full = t_b + t_w
        table_2 = (p // 2 - 1) * ((t_f + full) + full - 3 * t_w)
        idle = set()
        for m in (2 * p, 2 * p + 2, 4 * p):
            work = m * (t_f + t_b + t_w)
            dual = simulate(dualpipe_schedule(p, m), *fr(t_f, t_b, t_w), layout="bidirectional")
            zb = simulate(zero_bubble_h1(p, m), *fr(t_f, t_b, t_w))
            idle.add(dual.total_time - work)
            if t_f <= t_b and t_w <= t_b:
                assert dual.total_time - work == table_2, (p, m, t_f, t_b, t_w)
            assert table_2 <= dual.total_time - work <= zb.total_time - work, (p, m, t_f, t_b, t_w)
        assert len(idle) == 1, (p, t_f, t_b, t_w, idle)


def test_dualpipe_holds_one_more_activation_and_twice_the_parameters():
    for p in (2, 4, 6, 8):
        dual = simulate(dualpipe_schedule(p, 2 * p), layout="bidirectional")
        assert dual.peak_in_flight == [p + 1] * p  # Table 2: PP + 1, against 1F1B's and ZB1P's PP
        assert dual.parameters == [2] * p  # Table 2: 2x
        assert simulate(one_f_one_b(p, 2 * p)).parameters == [1] * p
        assert simulate(interleaved(p, 2 * p, 2)).parameters == [1] * p  # v chunks of 1/v each
    assert parameters_per_stage([parse("F0 BW0"), parse("F0 BW0")]) == [1, 1]


def test_bidirectional_routes_and_pairs_by_hand():
    """p = 2: micro-batch 0 goes down on chunk 0, micro-batch 1 up on chunk 1 (stage 1 holds its first
    virtual stage, stage 0 its loss). On stage 1, F0 and BW1c1 form a pair: F0 waits for BW1c1's gradient."""
    schedule = [parse("F0 F1c1 BW1c1 BW0"), parse("F1c1 F0 BW1c1 BW0")]
    t = simulate(schedule, t_f=1, t_b=1, t_w=0, layout="bidirectional")
    assert [(i.start, i.end, str(i.action)) for i in t.busy[0]] == [
        (0, 1, "F0"), (1, 2, "F1c1"), (2, 3, "BW1c1"), (6, 7, "BW0")]
    assert [(i.start, i.end, str(i.action)) for i in t.busy[1]] == [
        (0, 1, "F1c1"), (3, 4, "F0"), (4, 5, "BW1c1"), (5, 6, "BW0")]
    assert t.num_messages == 4 and t.peak_in_flight == [2, 2] and t.parameters == [2, 2]


def test_bidirectional_layout_refusals():
    with pytest.raises(ValueError, match="micro-batch 0 runs on chunks \\[0, 1\\]"):
        check_schedule([parse("F0 BW0 F0c1 BW0c1")] * 2, 1, layout="bidirectional")
    with pytest.raises(ValueError, match="two chunks per stage"):
        check_schedule([parse("F0c2 BW0c2")] * 2, 1, layout="bidirectional")
    with pytest.raises(ValueError, match="layout must be one of"):
        simulate(gpipe(2, 2), layout="v-shape")
    with pytest.raises(ValueError, match="deadlock"):  # stage 1's pair needs stage 0's BW1c1, which waits for it
        check_schedule([parse("F0 BW0 F1c1 BW1c1"), parse("F1c1 F0 BW1c1 BW0")], 2, layout="bidirectional")
    for p, m in [(3, 12), (0, 4), (4, 6), (4, 9)]:
        with pytest.raises(ValueError, match="num_stages must be even|num_microbatches must be even"):
            dualpipe_schedule(p, m)


# -- the simulator on hand-built schedules -------------------------------------------------------


def test_one_microbatch_through_the_naive_pipeline():
    p, t_f, t_b, t_w, t_comm = 3, 2, 3, 1, Fraction(1, 2)
    timeline = simulate([[Action("F", 0), Action("BW", 0)]] * p, t_f, t_b, t_w, t_comm)
    hop = t_f + t_comm
    starts_f = [s * hop for s in range(p)]
    last_f_end = starts_f[-1] + t_f
    starts_b = [last_f_end + (p - 1 - s) * (t_b + t_w + t_comm) for s in range(p)]
    for s in range(p):
        f, b = timeline.busy[s]
        assert (f.start, f.end, f.action) == (starts_f[s], starts_f[s] + t_f, Action("F", 0))
        assert (b.start, b.end, b.action) == (starts_b[s], starts_b[s] + t_b + t_w, Action("BW", 0))
    assert timeline.total_time == starts_b[0] + t_b + t_w
    assert timeline.num_messages == 2 * (p - 1)
    busy = p * (t_f + t_b + t_w)
    assert timeline.bubble_fraction == (p * timeline.total_time - busy) / (p * timeline.total_time)
    # idle: before the forward, between forward and backward, after the backward
    assert [(i.start, i.end) for i in timeline.idle[1]] == [
        (0, starts_f[1]), (starts_f[1] + t_f, starts_b[1]), (starts_b[1] + t_b + t_w, timeline.total_time)]


def test_split_backward_sends_the_gradient_before_w():
    schedule = [parse("F0 B0 W0"), parse("F0 B0 W0")]
    t = simulate(schedule, t_f=1, t_b=1, t_w=5)
    assert [(i.start, i.end) for i in t.busy[1]] == [(1, 2), (2, 3), (3, 8)]
    assert [(i.start, i.end) for i in t.busy[0]] == [(0, 1), (3, 4), (4, 9)]  # B0 starts when stage 1's B ends
    assert t.peak_in_flight == [1, 1]


def test_per_stage_costs_and_chunks():
    t = simulate([parse("F0 BW0"), parse("F0 BW0")], t_f=[1, 3], t_b=[2, 2], t_w=0)
    assert [(i.start, i.end) for i in t.busy[1]] == [(1, 4), (4, 6)]
    one_stage_two_chunks = [parse("F0 F0c1 BW0c1 BW0")]  # local hand-over between chunks, no messages
    t = simulate(one_stage_two_chunks, t_f=2, t_b=4, t_w=0)
    assert num_chunks(one_stage_two_chunks) == 2
    assert t.total_time == 6 and t.bubble_fraction == 0 and t.num_messages == 0
    assert t.peak_in_flight == [1]  # two chunks' halves of one micro-batch


def test_timeline_from_measured_intervals():
    busy = [[Interval(10.0, 11.0, Action("F", 0)), Interval(13.0, 15.0, Action("BW", 0))],
            [Interval(11.0, 12.0, Action("F", 0)), Interval(12.0, 14.0, Action("BW", 0))]]
    t = timeline_from_intervals(busy)
    assert t.total_time == 5.0 and t.busy[0][0].start == 0.0
    assert t.bubble_fraction == pytest.approx(1 - 6 / 10)
    assert [(i.start, i.end) for i in t.idle[1]] == [(0.0, 1.0), (4.0, 5.0)]


def test_parse_and_format():
    actions = parse("F0 F1c1 B2 W2 BW3c2")
    assert actions == [Action("F", 0), Action("F", 1, 1), Action("B", 2), Action("W", 2), Action("BW", 3, 2)]
    assert " ".join(map(str, actions)) == "F0 F1c1 B2 W2 BW3c2"
    assert format_schedule([actions[:2], actions[2:]]) == "stage 0: F0 F1c1\nstage 1: B2 W2 BW3c2"
    with pytest.raises(ValueError, match="'X1' is not an action"):
        parse("F0 X1")


def test_peak_counts_activations_until_w():
    assert peak_in_flight([parse("F0 F1 B0 B1 W0 W1")]) == [2]
    assert peak_in_flight([parse("F0 B0 W0 F1 B1 W1")]) == [1]
    assert peak_in_flight([parse("F0 BW0 F1 BW1")]) == [1]


# -- the checker ---------------------------------------------------------------------------------

BAD = [
    ([parse("F0 BW0"), [("F", 0), ("BW", 0)]], 1, r"stage 1, action 0: \('F', 0\) is not an Action"),
    ([parse("F0 BW0"), [Action("X", 0), Action("BW", 0)]], 1, r"stage 1, action 0 \(X0\): kind must be"),
    ([parse("F0 BW0 F1 BW1")], 1, r"stage 0, action 2 \(F1\): micro-batch must be in 0..0"),
    ([parse("F0 F0 BW0")], 1, r"stage 0, action 1 \(F0\): .* comes twice"),
    ([parse("F0 BW0 W0")], 1, r"stage 0, action 2 \(W0\): .* comes twice"),
    ([parse("F0 B0 BW0")], 1, r"stage 0, action 2 \(BW0\): .* comes twice"),
    ([parse("BW0 F0")], 1, r"stage 0, action 0 \(BW0\): comes before F0"),
    ([parse("F0 W0 B0")], 1, r"stage 0, action 1 \(W0\): W needs its B first"),
    ([parse("F0 BW0"), parse("F0")], 1, r"stage 1, chunk 0: BW0 \(or B0 and W0\) missing"),
    ([parse("F0 B0")], 1, r"stage 0, chunk 0: W0 missing"),
    ([parse("F0 F1 BW0 BW1"), parse("F0 BW0")], 2, r"stage 1, chunk 0: F1 and BW1 .* missing"),
    ([parse("F0 F0c1 BW0c1 BW0"), parse("F0 BW0")], 1, r"stage 1, chunk 1: F0 and BW0 .* missing"),
    # Messages from stage 0 to stage 1 arrive in the order sent: activation 0 first.
    ([parse("F0 F1 BW0 BW1"), parse("F1 F0 BW0 BW1")], 2,
     r"stage 1, action 0 \(F1\): receives micro-batch 1's activation .* but stage 0 sends micro-batch 0's"),
    ([parse("F0 F1 BW1 BW0"), parse("F0 F1 BW0 BW1")], 2, r"stage 0, action 2 \(BW1\): receives micro-batch 1's"),
    # A cycle: stage 0 waits for gradient 0 before sending activation 1, which stage 1 needs first.
    ([parse("F0 BW0 F1 BW1"), parse("F0 F1 BW0 BW1")], 2,
     r"deadlock: stage 0, action 1 \(BW0\) waits for micro-batch 0's gradient .* from stage 1; "
     r"stage 1, action 1 \(F1\) waits for micro-batch 1's activation"),
    # One stage, two chunks: chunk 1's forward needs chunk 0's, which comes later.
    ([parse("F0c1 F0 BW0c1 BW0")], 1, r"deadlock: stage 0, action 0 \(F0c1\) waits for micro-batch 0's activation"),
]


@pytest.mark.parametrize("schedule, m, message", BAD)
def test_check_schedule_names_the_first_bad_action(schedule, m, message):
    with pytest.raises(ValueError, match=message):
        check_schedule(schedule, m)


def test_check_schedule_arguments():
    for m in (0, -1, 1.5):
        with pytest.raises(ValueError, match="num_microbatches must be an integer >= 1"):
            check_schedule(gpipe(2, 2), m)
    for schedule in ([], None, "F0 BW0"):
        with pytest.raises(ValueError, match="schedule must be a non-empty list"):
            check_schedule(schedule, 1)


def test_blocking_sends_deadlock_1f1b_but_not_gpipe():
    check_schedule(gpipe(4, 8), 8, blocking_sends=True)
    check_schedule(one_f_one_b(4, 8), 8)
    with pytest.raises(ValueError, match=r"deadlock: .*waits to send .* blocking_sends=True"):
        check_schedule(one_f_one_b(4, 8), 8, blocking_sends=True)


def test_simulate_refuses_an_invalid_schedule_and_bad_costs():
    with pytest.raises(ValueError, match="deadlock"):
        simulate([parse("F0 BW0 F1 BW1"), parse("F0 F1 BW0 BW1")])
    with pytest.raises(ValueError, match="t_f must be a time >= 0 or one per stage"):
        simulate(gpipe(2, 2), t_f=[1, 2, 3])
    with pytest.raises(ValueError, match="t_comm must be >= 0"):
        simulate(gpipe(2, 2), t_comm=-1)


# -- imports, pictures, widgets ------------------------------------------------------------------


def test_schedules_is_pure_python():
    """The module loads by itself with torch, matplotlib and ipywidgets unavailable."""
    blocked = "import sys\nfor m in ('torch', 'matplotlib', 'ipywidgets', 'IPython'): sys.modules[m] = None\n"
    load = ("import importlib.util\n"
            "spec = importlib.util.spec_from_file_location('schedules', 'cs336_parallel/schedules.py')\n"
            "module = importlib.util.module_from_spec(spec); sys.modules['schedules'] = module\n"
            "spec.loader.exec_module(module)\n"
            "print(module.simulate([module.parse('F0 BW0')] * 2).bubble_fraction)\n")
    done = subprocess.run([sys.executable, "-c", blocked + load], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "0.5", done.stderr


def test_gantt_chart_has_one_row_per_stage_and_labelled_axes():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from cs336_parallel import viz

    fig = viz.gantt(simulate(zero_bubble_h1(4, 8)), title="ZB-H1")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"stage {s}" for s in range(4)]
    assert ax.get_xlabel() == "time (time units)" and "bubble" in ax.get_title()
    stack = viz.gantt_stack([("1F1B", simulate(one_f_one_b(4, 8))), ("v=2", simulate(interleaved(4, 8, 2)))])
    assert len(stack.axes) == 2 and stack.axes[0].get_xlim() == stack.axes[1].get_xlim()
    bars = viz.activations_per_stage({"GPipe": [8] * 4, "1F1B": [4, 3, 2, 1]})
    assert bars.axes[0].get_ylabel().startswith("peak activations")
    curve = viz.bubble_vs_microbatches([1, 2, 4], {"1F1B": [0.75, 0.6, 0.43]}, {"formula": lambda m: 3 / (m + 3)})
    assert curve.axes[0].get_xlabel() == "micro-batches m"


def test_schedule_explorer_updates_with_its_sliders():
    pytest.importorskip("ipywidgets")
    import matplotlib

    matplotlib.use("Agg")
    from cs336_parallel.widgets import ScheduleExplorer

    explorer = ScheduleExplorer({"1F1B": one_f_one_b, "interleaved": interleaved}, num_stages=4,
                                num_microbatches=8)
    assert explorer.timeline.bubble_fraction == pytest.approx(3 / 11)
    assert explorer.controls["v"].disabled
    explorer.controls["m"].value = 12
    assert explorer.timeline.bubble_fraction == pytest.approx(3 / 15)
    assert "bubble 20.0%" in explorer.summary.value and "4 3 2 1" in explorer.summary.value
    explorer.controls["schedule"].value = "interleaved"
    assert not explorer.controls["v"].disabled
    assert explorer.timeline.bubble_fraction == pytest.approx(3 / (2 * 12 + 3))
    explorer.controls["m"].value = 7  # 7 is no multiple of 4: the generator's own error is shown
    assert explorer.timeline is None and explorer.error is not None
    explorer.controls["m"].value = 8
    explorer.controls["t_comm"].value = 0.5
    assert explorer.timeline.costs["t_comm"] == 0.5 and explorer.error is None


def test_timed_stage_records_forwards_and_each_kind_of_backward():
    import torch

    from cs336_parallel.bench.pipeline import TimedStage
    from cs336_parallel.models import MLPStack

    timed = TimedStage(MLPStack(8, 2, hidden=16, seed=0), chunk=1)
    x0, x1, x2 = (torch.randn(4, 8, requires_grad=True) for _ in range(3))
    y0, y1, y2 = timed(x0), timed(x1), timed(x2)
    torch.autograd.backward(y0, torch.ones_like(y0))  # full backward
    torch.autograd.backward(y1, torch.ones_like(y1), inputs=[x1], retain_graph=True)  # B
    torch.autograd.backward(y1, torch.ones_like(y1), inputs=list(timed.parameters()))  # W
    first_stage = TimedStage(MLPStack(8, 1, hidden=16, seed=0))
    first_stage(torch.randn(4, 8)).sum().backward()  # input needs no gradient: reported as BW
    intervals = timed.finish()
    assert [str(i.action) for i in intervals] == ["F0c1", "F1c1", "F2c1", "BW0c1", "B1c1", "W1c1"]
    assert all(i.start <= i.end for i in intervals)
    assert all(a.end <= b.start for a, b in zip(intervals, intervals[1:], strict=False))
    assert [str(i.action) for i in first_stage.finish()] == ["F0", "BW0"]
    assert y2.grad_fn is not None  # the wrapper keeps the graph intact


def test_timed_stage_sees_backwards_through_autograd_grad_and_split_ones_add_up():
    """A pipeline may compute its gradients with torch.autograd.grad and set .grad itself, or run a BW
    as two passes: the measured timeline still has every backward, and the simulator gets each
    micro-batch's whole backward time."""
    import torch

    from cs336_parallel.bench.pipeline import TimedStage, measured_and_simulated
    from cs336_parallel.models import MLPStack

    timed = TimedStage(MLPStack(8, 2, hidden=16, seed=0))
    params = list(timed.parameters())
    x0, x1 = (torch.randn(4, 8, requires_grad=True) for _ in range(2))
    y0, y1 = timed(x0), timed(x1)
    grads = torch.autograd.grad(y0, [x0, *params], torch.ones_like(y0))  # BW in one call, .grad set by hand
    for q, g in zip(params, grads[1:], strict=True):
        q.grad = g
    torch.autograd.grad(y1, [x1], torch.ones_like(y1), retain_graph=True)  # a BW as two passes
    torch.autograd.grad(y1, params, torch.ones_like(y1))
    intervals = timed.finish()
    assert [str(i.action) for i in intervals] == ["F0", "F1", "BW0", "B1", "W1"]
    schedule = [parse("F0 F1 BW0 BW1")]
    measured, simulated = measured_and_simulated([intervals], schedule, scale=1.0)
    backward_1 = sum(i.end - i.start for i in intervals[3:])
    assert simulated.costs["t_b"] == [pytest.approx(statistics.median([intervals[2].end - intervals[2].start,
                                                                       backward_1]))]
    assert measured.total_time > 0


def test_zero_bubble_h1_idles_more_when_a_w_outlasts_the_gap_it_fills():
    """ZB-H1's (p-1)(t_F + t_B - t_W) holds while t_W <= min(t_F, t_B); in general, with m >= p, a stage idles
    (p-1)(t_F + t_B - min(t_W, t_F, t_B)) (notebook 05's spec, and its tests' `zero_bubble_idle`)."""
    from cs336_parallel.testing.pipeline import zero_bubble_idle

    for p, m in itertools.product([2, 3, 4, 5], [5, 8, 11]):
        for costs in itertools.product([0, 1, 2, 3], repeat=3):
            if sum(costs) and m >= p:
                zb = simulate(zero_bubble_h1(p, m), *fr(*costs))
                assert zb.total_time - m * sum(costs) == zero_bubble_idle(p, *costs)
    assert zero_bubble_idle(4, 1, 3, 2) == 9  # the notebook's example: 3(p-1), not 2(p-1)


def test_numpy_integers_are_integers_to_the_checker_and_the_simulator():
    np = pytest.importorskip("numpy")
    schedule = [[Action(kind, np.int64(i)) for kind in ("F", "BW") for i in range(3)] for _ in range(2)]
    check_schedule(schedule, np.int64(3))
    assert simulate(schedule).bubble_fraction == pytest.approx(1 / 4)
    with pytest.raises(ValueError, match="micro-batch"):
        check_schedule([[Action("F", True), Action("BW", True)]], 2)


def test_the_partition_check_finds_a_faster_split_exactly_when_one_exists():
    """`testing.pipeline`'s certificate (greedy packing below the answer's slowest stage) against brute force."""
    import random

    from cs336_parallel.testing.pipeline import _stages_below

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        p = rng.randint(1, n)
        costs = [Fraction(rng.randint(0, 5)) for _ in range(n)]
        splits = list(itertools.combinations(range(1, n), p - 1))
        slowest = [max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, n), strict=True)) for cuts in splits]
        best = min(slowest)
        for value in set(slowest):
            assert (_stages_below(costs, value) > p) == (value == best)

"""Interactive explorers for the notebooks (ipywidgets is imported here only, never by the core).

`ScheduleExplorer(generators)`: pick a pipeline schedule, the number of stages p, micro-batches m,
chunks v and the relative costs of F, B, W and a message; the Gantt chart, the bubble fraction and the
peak activations per stage update as you move the sliders. The package ships no schedules: pass your
own generators, e.g. `{"1F1B": one_f_one_b_schedule}`.

`LayoutExplorer(plan, Layout, models, clusters)`: pick a model, a cluster and a parallel layout; memory
per GPU and step time update as you change it. Pass your own planner (notebook 07's `plan_parallelism`).
"""

from __future__ import annotations

import html
import inspect
import io
from collections.abc import Callable

import ipywidgets as w
import matplotlib.pyplot as plt

from . import viz
from .costs import bubble_fraction
from .schedules import Timeline, simulate


def _draw(image: w.Image, fig) -> None:
    """Show `fig` in `image` as a PNG. An Image widget, not an Output widget: headless executors (nbclient,
    so nbconvert and nbgrader) mimic Output widgets by messaging the kernel back, and can then wait forever
    for a cell to finish (jupyter/nbclient#312)."""
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    image.value = png.getvalue()


def _takes_chunks(generator: Callable) -> bool:
    """True for generator(num_stages, num_microbatches, num_chunks)."""
    try:
        return len(inspect.signature(generator).parameters) >= 3
    except (TypeError, ValueError):
        return False


class _Explorer(w.VBox):
    """Controls in two columns, a one-line summary and a picture, redrawn whenever a control changes.
    Subclasses set their state, then call this `__init__`; `_update` reads `values()` and redraws."""

    def __init__(self, controls: dict[str, w.Widget], left: list[str]):
        self.controls = controls
        self.summary = w.HTML()
        self.picture = w.Image(format="png")
        columns = [w.VBox([controls[k] for k in left]), w.VBox([c for k, c in controls.items() if k not in left])]
        super().__init__([w.HBox(columns), self.summary, self.picture])
        for control in controls.values():
            control.observe(self._update, names="value")
        self._update()

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def _update(self, _change=None) -> None:
        raise NotImplementedError


class ScheduleExplorer(_Explorer):
    """Sliders and a picture: the schedule chosen, simulated with the costs chosen (t_f = 1)."""

    def __init__(self, generators: dict[str, Callable], *, num_stages: int = 4, num_microbatches: int = 8,
                 num_chunks: int = 2, max_stages: int = 8, max_microbatches: int = 32):
        if not generators:
            raise ValueError("generators must name at least one schedule generator, e.g. {'1F1B': fn}")
        self.generators = dict(generators)
        self.timeline: Timeline | None = None
        self.error: str | None = None
        style = {"description_width": "110px"}
        controls = {
            "schedule": w.Dropdown(options=list(self.generators), description="schedule", style=style),
            "p": w.IntSlider(num_stages, min=1, max=max_stages, description="stages p", style=style),
            "m": w.IntSlider(num_microbatches, min=1, max=max_microbatches, description="micro-batches m",
                             style=style),
            "v": w.IntSlider(num_chunks, min=1, max=4, description="chunks v", style=style),
            "t_b": w.FloatSlider(1.0, min=0.25, max=3.0, step=0.25, description="t_B / t_F", style=style),
            "t_w": w.FloatSlider(1.0, min=0.0, max=3.0, step=0.25, description="t_W / t_F", style=style),
            "t_comm": w.FloatSlider(0.0, min=0.0, max=1.0, step=0.05, description="t_comm / t_F", style=style),
        }
        super().__init__(controls, left=["schedule", "p", "m", "v"])

    def _update(self, _change=None) -> None:
        c = self.values()
        generator = self.generators[c["schedule"]]
        chunked = _takes_chunks(generator)
        self.controls["v"].disabled = not chunked
        try:
            schedule = generator(c["p"], c["m"], c["v"]) if chunked else generator(c["p"], c["m"])
            self.timeline = simulate(schedule, t_f=1.0, t_b=c["t_b"], t_w=c["t_w"], t_comm=c["t_comm"])
            self.error = None
        except Exception as exc:  # noqa: BLE001 - shown to the learner, not raised into the widget machinery
            self.timeline, self.error = None, f"{type(exc).__name__}: {exc}"
        self.summary.value = self._summary(c)
        self.picture.layout.display = None if self.timeline is not None else "none"
        if self.timeline is not None:
            _draw(self.picture, viz.gantt(self.timeline, title=c["schedule"], time_unit="multiples of t_F"))

    def _summary(self, c: dict) -> str:
        if self.error is not None:
            return f"<span style='color:#C44E52'>{html.escape(self.error)}</span>"
        t = self.timeline
        p, m = c["p"], c["m"]
        peaks = " ".join(f"{x:g}" for x in t.peak_in_flight)
        return (f"<b>bubble {t.bubble_fraction:.1%}</b> (GPipe/1F1B closed form (p-1)/(m+p-1) = "
                f"{bubble_fraction(p, m):.1%}) &nbsp; total time {t.total_time:g} t_F &nbsp; "
                f"peak activations per stage (micro-batches): {peaks} &nbsp; messages: {t.num_messages}")


def schedule_explorer(generators: dict[str, Callable], **kwargs) -> ScheduleExplorer:
    """`schedule_explorer({"GPipe": gpipe_schedule, "1F1B": one_f_one_b_schedule})` as a cell's last line."""
    return ScheduleExplorer(generators, **kwargs)


# -- notebook 07: choosing a parallel layout ------------------------------------------------------------


class LayoutExplorer(_Explorer):
    """Pick a model, a cluster and a layout (tp, pp, cp, ep, ZeRO stage, micro-batches, recomputation);
    dp is what is left of the GPUs. Shows the plan's memory per GPU and step time, or why the layout is
    invalid. The package ships no planner: pass yours, `plan(model, cluster, layout) -> Plan`, and the
    `layout_type` it takes (called with keyword arguments dp, tp, pp, cp, ep, zero_stage, micro_batch,
    num_microbatches, virtual_stages, recompute)."""

    def __init__(self, plan: Callable, layout_type: Callable, models: dict, clusters: dict, *,
                 initial: dict | None = None):
        if not models or not clusters:
            raise ValueError("models and clusters must each name at least one entry, e.g. {'Llama 3 405B': spec}")
        self.plan_fn, self.layout_type = plan, layout_type
        self.models, self.clusters = dict(models), dict(clusters)
        self.plan = None
        self.error: str | None = None
        start = {"tp": 8, "pp": 16, "cp": 1, "ep": 1, "zero_stage": 1, "micro_batch": 1, "num_microbatches": 16,
                 "virtual_stages": 1, "recompute": "selective", **(initial or {})}
        style = {"description_width": "120px"}

        def choice(name, options, description):
            value = start.get(name, options[0])
            return w.Dropdown(options=options, value=value if value in options else options[0],
                              description=description, style=style)

        powers = [1, 2, 4, 8, 16, 32, 64]
        controls = {
            "model": w.Dropdown(options=list(self.models), description="model", style=style),
            "cluster": w.Dropdown(options=list(self.clusters), description="cluster", style=style),
            "tp": choice("tp", powers[:6], "tensor tp"),
            "pp": choice("pp", powers, "pipeline pp"),
            "cp": choice("cp", powers[:6], "context cp"),
            "ep": choice("ep", powers, "expert ep"),
            "zero_stage": choice("zero_stage", [0, 1, 2, 3], "ZeRO stage"),
            "micro_batch": choice("micro_batch", [1, 2, 4, 8], "micro-batch b"),
            "num_microbatches": w.IntSlider(start["num_microbatches"], min=1, max=256,
                                            description="micro-batches m", style=style),
            "virtual_stages": choice("virtual_stages", [1, 2, 4, 8], "chunks per stage v"),
            "recompute": choice("recompute", ["none", "selective", "full"], "recompute"),
        }
        super().__init__(controls, left=list(controls)[:6])

    def _update(self, _change=None) -> None:
        c = self.values()
        model, cluster = self.models[c["model"]], self.clusters[c["cluster"]]
        others = c["tp"] * c["pp"] * c["cp"]
        try:
            if cluster.num_gpus % others:
                raise ValueError(f"tp x pp x cp = {others} does not divide the {cluster.num_gpus} GPUs")
            layout = self.layout_type(dp=cluster.num_gpus // others, **{k: c[k] for k in (
                "tp", "pp", "cp", "ep", "zero_stage", "micro_batch", "num_microbatches", "virtual_stages",
                "recompute")})
            self.plan, self.error = self.plan_fn(model, cluster, layout), None
        except Exception as exc:  # noqa: BLE001 - shown to the learner, not raised into the widget machinery
            self.plan, self.error = None, f"{type(exc).__name__}: {exc}"
        self.summary.value = self._summary(cluster)
        self.picture.layout.display = None if self.plan is not None else "none"
        if self.plan is not None:
            _draw(self.picture, viz.plan_breakdown({f"{c['model']}, dp = {self.plan.layout.dp}": self.plan}))

    def _summary(self, cluster) -> str:
        if self.error is not None:
            return f"<span style='color:#C44E52'>{html.escape(self.error)}</span>"
        p = self.plan
        verdict = "fits" if p.fits else "<b style='color:#C44E52'>does not fit</b>"
        return (f"dp = {p.layout.dp} &nbsp; <b>{p.total_bytes / 1e9:,.1f} GB per GPU</b> of "
                f"{p.memory_limit_bytes / 1e9:g} GB: {verdict} &nbsp; step {p.step_s:.2f} s &nbsp; "
                f"<b>MFU {p.mfu:.1%}</b> (compute alone at {cluster.assumed_mfu:.0%} of peak)")


def layout_explorer(plan: Callable, layout_type: Callable, models: dict, clusters: dict, **kwargs) -> LayoutExplorer:
    """`layout_explorer(plan_parallelism, Layout, {"Llama 3 405B": spec}, {"16K H100": cluster})` as a cell's
    last line."""
    return LayoutExplorer(plan, layout_type, models, clusters, **kwargs)

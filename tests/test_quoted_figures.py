"""Figures that the markdown of notebook 07 quotes, checked against the computation they come from (the master's own
planner, loaded from its cells): prose and cells cannot drift apart."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from conftest import ROOT
from cs336_parallel.notebook import load_definitions
from cs336_parallel.planning import ClusterSpec, Layout, ModelSpec, Precision

MASTER = ROOT / "grading/source/07_4d_parallelism/07_4d_parallelism.ipynb"
# The toy of the worked examples (the tests' TOY, TOY_CLUSTER and TOY_LAYOUT).
TOY = ModelSpec("toy", num_params=48_000_000, num_layers=8, hidden=512, heads=8, seq_len=1024)
TOY_CLUSTER = ClusterSpec("toy", num_gpus=16, gpus_per_node=4, gpu_memory_bytes=1e9, peak_flops=1e14, assumed_mfu=0.5,
                          intra_node_bytes_per_s=100e9, inter_node_bytes_per_s=10e9, intra_node_latency_s=2e-6,
                          inter_node_latency_s=2e-5)
TOY_LAYOUT = Layout(dp=2, tp=4, pp=2, zero_stage=1, micro_batch=2, num_microbatches=4, recompute="selective")


@pytest.fixture(scope="module")
def planner() -> dict:
    return load_definitions(MASTER, ["layout_memory", "layout_compute", "layout_communication"])


@pytest.fixture(scope="module")
def prose() -> str:
    """The notebook's markdown, each run of white space one space (a figure may straddle a line break)."""
    cells = json.loads(MASTER.read_text())["cells"]
    return " ".join(" ".join("".join(c["source"]).split()) for c in cells if c["cell_type"] == "markdown")


def test_the_worked_example_of_memory_is_the_planners(planner, prose):
    got = planner["layout_memory"](TOY, TOY_CLUSTER, TOY_LAYOUT)
    per_layer = got["activations_bytes"] / (2 * 4)  # 2 micro-batches of 4 layers
    for figure in (f"{got['params_bytes']:,.0f} bytes of weights", f"{got['optimizer_bytes']:,.0f} of optimizer state",
                   f"{per_layer:,.0f} bytes a micro-batch", f"4 layers: {got['activations_bytes']:,.0f} bytes"):
        assert figure in prose, figure
    assert got["grads_bytes"] == got["params_bytes"]  # "and as many of gradients"


def test_the_worked_example_of_computation_is_the_planners(planner, prose):
    got = planner["layout_compute"](TOY, TOY_CLUSTER, TOY_LAYOUT)
    per_token = got["model_flops_per_gpu"] * 16 / (16 * 1024)
    for figure in (f"= {per_token:,.0f} FLOPs", f"so {got['model_flops_per_gpu']:,.0f} per GPU",
                   f"and {got['compute_s'] * 1e3:.2f} ms",
                   f"a quarter of the computation: {got['bubble_s'] * 1e3:.2f} ms",
                   f"(2/3 × {got['compute_s'] * 1e3:.2f} ms / 4)"):
        assert figure in prose, figure
    assert got["bubble_s"] == pytest.approx(got["compute_s"] / 4)


def test_the_worked_example_of_communication_names_the_planners_messages(prose):
    tokens = TOY_LAYOUT.micro_batch * TOY.seq_len
    assert tokens * TOY.hidden * 2 == 2 * 2**20 and "= 2 MiB" in prose  # a micro-batch's activations, BF16
    assert tokens * TOY.hidden * 2 / TOY_LAYOUT.tp == 512 * 2**10 and "sends of 512 KiB" in prose
    assert 2 * TOY.num_params / (TOY_LAYOUT.tp * TOY_LAYOUT.pp) == 2 * 6e6 and "2 × 6M bytes over 2 GPUs" in prose


def test_llama_3s_interleaved_first_stage_at_32_microbatches(planner, prose):
    """The commentary's '19.75' micro-batches' worth: the interleaved warm-up (notebook 05) once m v exceeds it."""
    llama = ModelSpec("Llama 3 405B", num_params=405e9, num_layers=126, hidden=16384, heads=128, seq_len=8192,
                      kv_heads=8)
    published = Layout(dp=128, tp=8, pp=16, zero_stage=2, num_microbatches=16, virtual_stages=4)
    h100s = ClusterSpec("16,384 H100", num_gpus=16384)
    held = {m: planner["layout_memory"](llama, h100s, replace(published, num_microbatches=m))["activations_bytes"]
            for m in (16, 32)}
    worth = 16 * held[32] / held[16]  # m = 16 holds 16 micro-batches' worth (all its forwards run first)
    assert f"with m = 32 it would hold {worth:g}" in prose
    assert f"{2 * llama.num_params / 1e9:.0f} GB of BF16 weights per GPU" in prose


def test_deepseek_v3s_plan_against_its_reported_throughput(planner, prose):
    """The commentary: DualPipe at PP 16 holds about what 1F1B holds at PP 8; the plan at 55% of the FP8 peak takes
    less than half the reported step; the report's throughput needs about a fifth of that peak; computation and
    all-to-alls are about even at 55%, about three to one at the report's rate."""
    deepseek = ModelSpec("DeepSeek-V3", num_params=671e9, num_layers=61, hidden=7168, heads=128, seq_len=4096,
                         num_experts=256, expert_params=58 * 256 * 3 * 7168 * 2048, active_params=37e9, top_k=8,
                         max_nodes_per_token=4)
    h800s = ClusterSpec("2,048 H800, FP8", num_gpus=2048, peak_flops=1979e12, intra_node_bytes_per_s=160e9)
    layout = Layout(dp=128, pp=16, ep=64, zero_stage=1, num_microbatches=120, schedule="dualpipe",
                    precision=Precision(param=2, grad=4, optimizer=8, activation=2, dispatch=1, combine=2))
    plan = load_definitions(MASTER, ["plan_parallelism"])["plan_parallelism"]

    def static_bytes(p) -> float:
        return p.params_bytes + p.grads_bytes + p.optimizer_bytes

    lecture = plan(deepseek, h800s, replace(layout, dp=256, pp=8, num_microbatches=60, schedule="1f1b"))
    assert static_bytes(plan(deepseek, h800s, layout)) == pytest.approx(static_bytes(lecture), rel=0.15)
    assert "take about what 1F1B's take at the lecture's PP 8" in prose
    reported_s = 180e3 * 3600 / 2048 * (128 * 120 * 4096) / 1e12  # 180K GPU-hours per trillion tokens

    def at(mfu: float):
        return plan(deepseek, replace(h800s, assumed_mfu=mfu), layout)

    assert at(0.55).step_s < reported_s / 2 and "takes less than half as long" in prose
    matched = next(m / 100 for m in range(100, 0, -1) if at(m / 100).step_s >= reported_s)
    assert 0.15 <= matched <= 0.25 and "about a fifth of the FP8 peak" in prose

    def compute_over_all_to_alls(mfu: float) -> float:
        cluster = replace(h800s, assumed_mfu=mfu)
        return at(mfu).compute_s / planner["layout_communication"](deepseek, cluster, layout, 0.0)["ep"]

    assert 0.8 <= compute_over_all_to_alls(0.55) <= 1.5 and "about even" in prose
    assert 2.5 <= compute_over_all_to_alls(matched) <= 3.5 and "about three times longer" in prose

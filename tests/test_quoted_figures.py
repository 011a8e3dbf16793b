"""Figures that the markdown of notebooks 07, 08 and 09 quotes, checked against the computation they come from (07's
master's own planner, loaded from its cells; 08's constants and the f-string its cell prints them with; 09's own
choose_layout and the tests' copies of its sourced figures): prose and cells cannot drift apart."""

from __future__ import annotations

import ast
import json
from dataclasses import replace

import pytest

from common import ROOT
from cs336_parallel import costs
from cs336_parallel.notebook import load_definitions
from cs336_parallel.planning import ClusterSpec, Layout, ModelSpec, Precision
from cs336_parallel.testing.scaling import ACTIVATION_BYTES, GPU, MODELS, llama_memory_bytes

MASTER = ROOT / "grading/source/07_4d_parallelism/07_4d_parallelism.ipynb"
MASTER_08 = ROOT / "grading/source/08_fault_tolerance/08_fault_tolerance.ipynb"
MASTER_09 = ROOT / "grading/source/09_scaling_limits/09_scaling_limits.ipynb"
# The toy of the worked examples (the tests' TOY, TOY_CLUSTER and TOY_LAYOUT).
TOY = ModelSpec("toy", num_params=48_000_000, num_layers=8, hidden=512, heads=8, seq_len=1024)
TOY_CLUSTER = ClusterSpec("toy", num_gpus=16, gpus_per_node=4, gpu_memory_bytes=1e9, peak_flops=1e14, assumed_mfu=0.5,
                          intra_node_bytes_per_s=100e9, inter_node_bytes_per_s=10e9, intra_node_latency_s=2e-6,
                          inter_node_latency_s=2e-5)
TOY_LAYOUT = Layout(dp=2, tp=4, pp=2, zero_stage=1, micro_batch=2, num_microbatches=4, recompute="selective")
# Llama 3 405B as the notebook plans it (Llama 3 paper, Tables 3 and 4; v = 4 is the notebook's assumption).
LLAMA = ModelSpec("Llama 3 405B", num_params=405e9, num_layers=126, hidden=16384, heads=128, seq_len=8192, kv_heads=8)
LLAMA_PUBLISHED = Layout(dp=128, tp=8, pp=16, zero_stage=2, num_microbatches=16, virtual_stages=4)
H100S = ClusterSpec("16,384 H100", num_gpus=16384)


@pytest.fixture(scope="module")
def planner() -> dict:
    return load_definitions(MASTER, ["layout_memory", "layout_compute", "layout_communication"])


def markdown(path) -> str:
    """A notebook's markdown, each run of white space one space (a figure may straddle a line break)."""
    cells = json.loads(path.read_text())["cells"]
    return " ".join(" ".join("".join(c["source"]).split()) for c in cells if c["cell_type"] == "markdown")


@pytest.fixture(scope="module")
def prose() -> str:
    return markdown(MASTER)


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
    held = {m: planner["layout_memory"](LLAMA, H100S, replace(LLAMA_PUBLISHED, num_microbatches=m))["activations_bytes"]
            for m in (16, 32)}
    worth = 16 * held[32] / held[16]  # m = 16 holds 16 micro-batches' worth (all its forwards run first)
    assert f"with m = 32 it would hold {worth:g}" in prose
    assert f"{2 * LLAMA.num_params / 1e9:.0f} GB of BF16 weights per GPU" in prose


def test_llama_3s_8k_row_with_and_without_the_attention_scores(planner, prose):
    """Table 4's 8,192-GPU row (DP 64, m = 32) as the planner counts it: a layer without the s x s scores
    (recompute="selective"), and with them ("none")."""
    row = replace(LLAMA_PUBLISHED, dp=64, num_microbatches=32)
    cluster = ClusterSpec("8,192 H100", num_gpus=8192)
    gb = {r: sum(planner["layout_memory"](LLAMA, cluster, replace(row, recompute=r)).values()) / 1e9
          for r in ("selective", "none")}
    assert f"puts that step at {gb['selective']:.1f} GB a GPU" in prose
    assert f"the step would need {gb['none']:.1f} GB" in prose


def test_llama_3s_exposed_gradient_reduction_is_dp_exposed_s(planner, prose):
    """The data-parallel bullet: the reduction, the last chunk's share and its last backward, and what
    costs.dp_exposed_s leaves exposed with v = 4 and v = 1 (the PP16 v=1 row's), against NeMo's count and the
    reduction in one piece."""
    compute_s = planner["layout_compute"](LLAMA, H100S, LLAMA_PUBLISHED)["compute_s"]
    reduce_s = planner["layout_communication"](LLAMA, H100S, LLAMA_PUBLISHED, 0.0)["dp"]
    v, m = LLAMA_PUBLISHED.virtual_stages, LLAMA_PUBLISHED.num_microbatches
    exposed = planner["layout_communication"](LLAMA, H100S, LLAMA_PUBLISHED, compute_s)["dp"]
    assert exposed == costs.dp_exposed_s(reduce_s, compute_s, m, virtual_stages=v, pp=LLAMA_PUBLISHED.pp)
    one_chunk = replace(LLAMA_PUBLISHED, virtual_stages=1)
    whole_stage = planner["layout_communication"](LLAMA, H100S, one_chunk, compute_s)["dp"]
    assert whole_stage == costs.dp_exposed_s(reduce_s, compute_s, m)
    for figure in (f"quarter of the reduction ({reduce_s / v:.2f} of {reduce_s:.2f} s)",
                   f"its own last backward ({2 / 3 * compute_s / (m * v):.2f} s) to hide under: "
                   f"{exposed * 1e3:.0f} ms exposed",
                   f"to hide under: {whole_stage * 1e3:.0f} ms (the `PP16 v=1` row)",
                   f"a virtual stage's layers): {reduce_s / v * 1e3:.0f} ms",
                   f"the whole {reduce_s * 1e3:.0f} ms would wait"):
        assert figure in prose, figure


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


def llama_405b_needs(gpus: int, *, grad_bytes: float = 4, grads_sharded: bool = False, chunks: int = 4) -> float:
    """Bytes a GPU of the first stage of Llama 3 405B at TP 8 x PP 16 holds, worked out here from 09's stated model:
    bf16 weights and (fp32) gradients over the replica's 128 GPUs, 12 bytes of optimizer state over all, and the
    interleaved warm-up's chunks of one-sequence micro-batches, 34 s h / 8 bytes a layer."""
    big, tp, pp, sequences = MODELS["405B"], 8, 16, 2048
    dp = gpus // (tp * pp)
    microbatches, v = sequences // dp, min(chunks, big["layers"] // pp)
    held = min(pp, microbatches) * v if v == 1 else min(2 * (pp - 1) + (v - 1) * pp + 1, microbatches * v)
    activations = held * big["layers"] / (pp * v) * ACTIVATION_BYTES["405B"] / tp
    gradients = grad_bytes * big["params"] / (tp * pp) / (dp if grads_sharded else 1)
    return 2 * big["params"] / (tp * pp) + gradients + 12 * big["params"] / gpus + activations


def test_notebook_09s_llama_3_405b_layout_from_its_memory():
    """09's commentary on its memory model against Llama 3's published TP 8 x PP 16: each figure it quotes, worked
    out from the model it states; and the layouts it says choose_layout picks are the master's picks."""
    prose = markdown(MASTER_09)
    reported = 81_559 * 2**20  # nvidia-smi's figure for an H100 80GB HBM3, as the notebook quotes it
    big16k, big8k = llama_405b_needs(16384), llama_405b_needs(8192)
    bf16 = llama_405b_needs(16384, grad_bytes=2)
    zero2 = llama_405b_needs(16384, grad_bytes=2, grads_sharded=True)
    for figure in (f"TP 8 × PP 16 needs {big16k / 1e9:.1f} GB a GPU on 16,384 GPUs and {big8k / 1e9:.1f} GB on 8,192",
                   f"take {4 * MODELS['405B']['params'] / 128 / 1e9:.1f} GB of a GPU at TP 8 × PP 16",
                   f"with {(reported - bf16) / 1e9:.1f} GB to spare ({bf16 / 1e9:.1f} GB)",
                   f"TP 8 × PP 16 fits 80 GB ({zero2 / 1e9:.1f} GB)",
                   f"{(2 * 15 + 3 * 16 + 1) / 4} micro-batches' worth",
                   f"Under 1F1B it would need {llama_405b_needs(8192, chunks=1) / 1e9:.1f} GB",
                   f"{(big16k - reported) / 1e9:.1f} GB a GPU on 16,384 GPUs and {(big8k - reported) / 1e9:.1f} GB"):
        assert figure in prose, figure
    assert zero2 <= GPU["memory"] < bf16 <= reported < big16k
    choose = load_definitions(MASTER_09, ["choose_layout"])["choose_layout"]
    tp_bound = 1 + 3 * MODELS["405B"]["ffn"] * GPU["nvlink"] / (2 * GPU["flops"])
    said = {(16384, GPU["memory"]): (8, 64), (16384, reported): (8, 32), (8192, GPU["memory"]): (8, 64),
            (8192, reported): (8, 64)}
    assert "PP 64 in 80 GB and PP 32 in 85.5 GB on 16,384 GPUs, PP 64 on 8,192 with either" in prose
    for (gpus, memory), layout in said.items():
        picked = choose(MODELS["405B"], GPU | {"memory": memory}, gpus=gpus, sequences=2048, tp_ceiling=tp_bound,
                        memory_bytes=llama_memory_bytes(MODELS["405B"], gpus, 2048))
        assert picked == layout, (gpus, memory, picked)


def code_cells(path) -> list[ast.Module]:
    """A notebook's code cells, parsed (lines of IPython magic left out)."""
    cells = json.loads(path.read_text())["cells"]
    return [ast.parse("\n".join(line for line in "".join(c["source"]).splitlines() if line.lstrip()[:1] not in "%!"))
            for c in cells if c["cell_type"] == "code"]


def test_notebook_08s_rate_of_all_interruptions_is_the_cells():
    """08's Young/Daly prose quotes the rate of all 419 unexpected interruptions "as the cell above printed": the
    figure comes from the master's GPUS, DAYS and INTERRUPTIONS, and the cell's own f-string prints it."""
    trees = code_cells(MASTER_08)
    names = {"GPUS", "DAYS", "INTERRUPTIONS"}
    constants = {target.id: value.value for tree in trees for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 for targets, values in [(node.targets[0], node.value)]
                 for target, value in (zip(targets.elts, values.elts, strict=True) if isinstance(targets, ast.Tuple)
                                       and isinstance(values, ast.Tuple) else [(targets, values)])
                 if isinstance(target, ast.Name) and target.id in names and isinstance(value, ast.Constant)}
    assert set(constants) == names, f"08's master assigns {sorted(constants)} of {sorted(names)}"
    figure = (f"one every {constants['DAYS'] * 24 / constants['INTERRUPTIONS']:.1f} h for the "
              f"{constants['GPUS']:,}-GPU job")
    assert figure in markdown(MASTER_08), figure
    printed = [eval(compile(ast.Expression(node), "08", "eval"), {}, constants)  # the f-strings of these names only
               for tree in trees for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
               and {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} <= names]
    assert any(figure in text for text in printed), f"no cell of 08 prints {figure!r}"

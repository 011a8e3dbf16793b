"""The cost formulas notebooks 07 (the planner) and 09 (scaling limits) share: one place, so that what the two
notebooks state about the same run agrees.

- `bubble_fraction`: the share of a pipelined step its stages sit idle, of the whole step (notebook 05's convention);
- `dp_exposed_s`: the part of data parallelism's gradient reduction that no computation hides (with interleaved
  stages, per chunk);
- `ep_bytes_per_token`: what expert parallelism moves for one token through one MoE layer, between nodes and inside
  them, as DeepSeek-V3 routes and sends tokens.
"""

from __future__ import annotations

import functools

SCHEDULES = ("1f1b", "dualpipe")


@functools.cache
def bubble_fraction(pp: int, num_microbatches: int, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """Idle time over the whole step (p stages x its length), with uniform stages and free messages.

    - "1f1b" (GPipe's bubble too) with v chunks per stage, interleaved 1F1B when v > 1 (Narayanan et al. 2021):
      (p - 1) / (v m + p - 1), which notebook 05's simulator reproduces exactly. The bubble over the computation
      alone, (p - 1) / (v m) (the Llama 3 paper's "bubble ratio", section 3.3.2), is the same idle time;
    - "dualpipe" (DeepSeek-V3 report, section 3.2.1): simulated, with the package's DualPipe order
      (`dualpipe.dualpipe_schedule`) and a backward split into B and W as long as the forward each."""
    p, m, v = pp, num_microbatches, virtual_stages
    if min(p, m, v) < 1:
        raise ValueError(f"pp, num_microbatches and virtual_stages must be >= 1, got {p}, {m}, {v}")
    if schedule == "1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule == "dualpipe":
        from .dualpipe import dualpipe_schedule
        from .schedules import simulate

        if v != 1:
            raise ValueError(f"DualPipe runs one chunk per direction: virtual_stages must be 1, got {v}")
        return float(simulate(dualpipe_schedule(p, m), 1, 1, 1, layout="bidirectional").bubble_fraction)
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


BACKWARD_SHARE = 2 / 3  # of a micro-batch's computation: the backward does twice the forward's FLOPs


def dp_exposed_s(reduce_s: float, compute_s: float, num_microbatches: int, *, virtual_stages: int = 1,
                 pp: int = 1) -> float:
    """Seconds of data parallelism's gradient reduction (`reduce_s`) left exposed in a step of `compute_s` seconds
    of computation over `num_microbatches` micro-batches, on a pipeline of `pp` stages of `virtual_stages` chunks.

    A gradient is final only after the last micro-batch's backward through its layer, so however many micro-batches
    the step accumulates, the reduction can overlap that backward alone (two thirds of one micro-batch's
    computation), and only if it runs in buckets, layer by layer, while the backward produces them (notebook 02).
    Reduced in one piece after the backward, none of it would hide.

    The model, with v chunks per stage (interleaved 1F1B when v > 1): each chunk's gradients are reduced in buckets
    while the last micro-batch's backward through that chunk runs, the chunks in turn on one link. The last
    micro-batches go back through chunk v-1 first and chunk 0 last, p of them per chunk, so chunk c's share
    (reduce_s / v) can start c p + 1 chunk-backwards before the end of the step: the other chunks' reductions hide
    under the backwards that follow, and chunk 0's share has its own last backward to hide under. Exposed is the
    larger of what that leaves of chunk 0's share and, when the link cannot keep up and the shares queue, what the
    backwards from chunk v-1's start on leave of the whole reduction. Megatron-LM keeps buckets for chunk 0 only
    (`disable_bucketing=(model_chunk_idx > 0)` in `get_model`, megatron/training/training.py) and reduces each other
    chunk in one piece after its last backward, which starts chunk v-1's share one chunk-backward later: only the
    queueing term would change. NeMo's communication-overlap guide counts chunk 0's share exposed in full ("exposes
    only one DP communication chunk", one virtual stage's layers with pipelining). The idle time of the cool-down,
    which would hide more, is left out."""
    m, v = num_microbatches, virtual_stages
    if min(m, v, pp) < 1:
        raise ValueError(f"num_microbatches, virtual_stages and pp must be >= 1, got {m}, {v}, {pp}")
    chunk_backward = BACKWARD_SHARE * compute_s / (m * v)  # one micro-batch's backward through one chunk
    # Chunk c's reduction (reduce_s / v) starts with its last backward, c p + 1 chunk-backwards before the end; one
    # link reduces the chunks in turn, so the exposed time is largest counted from chunk v - 1 or from chunk 0.
    return max(0.0, reduce_s / v - chunk_backward, reduce_s - ((v - 1) * pp + 1) * chunk_backward)


def ep_bytes_per_token(hidden: int, top_k: int, ep: int, ranks_per_node: int, *, max_nodes: int | None = None,
                       dispatch_bytes: float = 2, combine_bytes: float = 2) -> dict[str, float]:
    """Bytes one token sends through one MoE layer's forward (to its `top_k` experts and back), over the network
    between nodes and over NVLink inside them, for an expert-parallel group of `ep` ranks, `ranks_per_node` of them
    in each node. The backward moves as many (the gradients take the same routes, reversed).

    As DeepSeek-V3 sends tokens (report, sections 3.2.2 and 3.3.3; DeepEP's kernels):
    - across nodes, a token goes once to each node that holds one of its experts: at most `top_k` nodes, at most
      `max_nodes` (node-limited routing, 4 in DeepSeek-V3), at most the group's nodes; its own node is any of them
      alike, so (nodes - 1) / nodes of those copies leave it;
    - inside a node, NVLink takes each copy on to its experts' ranks: `top_k` copies, less the share that is
      already on the right rank (1 / ranks_per_node); none when each node holds one rank of the group;
    - toward the experts (dispatch) each element takes `dispatch_bytes` (1 in FP8), back (combine)
      `combine_bytes` (2 in BF16)."""
    if min(hidden, top_k, ep, ranks_per_node) < 1 or ep % ranks_per_node:
        raise ValueError(f"hidden, top_k, ep and ranks_per_node must be >= 1 and ranks_per_node must divide ep, "
                         f"got {hidden}, {top_k}, {ep}, {ranks_per_node}")
    nodes = ep // ranks_per_node
    reached = min(top_k, nodes, max_nodes or top_k)
    per_copy = hidden * (dispatch_bytes + combine_bytes)
    return {"network": reached * (nodes - 1) / nodes * per_copy,
            "nvlink": top_k * (1 - 1 / ranks_per_node) * per_copy}

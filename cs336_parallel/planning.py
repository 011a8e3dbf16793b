"""The records of notebook 07's planner: a model, a cluster and a layout (the question), and a plan (the answer).

They hold data and check it; they plan nothing (the notebook's exercises do). They live in the package so that a
plan is a value a test can trust: the grader rebuilds the records on `plain.REGISTRY` from their fields
(`plain.decode`), so a plan's `fits`, `step_s` and `mfu` are always these properties, computed from its
numbers. The cost formulas 07 shares with notebook 09 are in `costs`.

Defaults are datasheet figures, each with its source: the H100 SXM datasheet (989 dense BF16 TFLOP/s, 80 GB,
NVLink 4 at 900 GB/s per GPU counting both directions, so 450 GB/s each way) and a 400 Gb/s (50 GB/s) network
port per GPU, as on Llama 3 405B's RoCE cluster (Llama 3 paper, section 3.3.1). Latencies and the fraction of
peak the compute reaches are assumptions, and named so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .costs import SCHEDULES

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of the weights, gradients and optimizer state; per element of activations."""

    param: int = 2  # BF16 weights
    grad: int = 2  # BF16 gradients
    optimizer: int = 12  # Adam in mixed precision: an fp32 copy of the weights, momentum and variance
    activation: int = 2  # BF16 activations
    dispatch: float = 2  # per element an expert-parallel all-to-all sends toward the experts (DeepSeek-V3: FP8, 1)
    combine: float = 2  # per element it sends back from them (DeepSeek-V3: BF16, 2)


@dataclass(frozen=True)
class ModelSpec:
    """A transformer and its training sequences, as the planner sees it."""

    name: str
    num_params: float  # all parameters, Ψ
    num_layers: int
    hidden: int
    heads: int
    seq_len: int
    kv_heads: int | None = None  # grouped-query attention; None: as many as heads
    num_experts: int = 1  # routed experts per MoE layer; 1: a dense model
    expert_params: float = 0  # Ψₑ: parameters in routed experts, all layers, all experts (part of Ψ)
    active_params: float | None = None  # parameters each token uses; None: all of them
    top_k: int = 1  # experts per token
    max_nodes_per_token: int | None = None  # node-limited routing: at most this many nodes per token (None: no limit)

    def __post_init__(self):
        for name in ("num_params", "num_layers", "hidden", "heads", "seq_len", "num_experts", "top_k"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.heads % (self.kv_heads or self.heads):
            raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")
        if not 0 <= self.expert_params <= self.num_params:
            raise ValueError(f"expert_params must be in 0..num_params ({self.num_params:g}), "
                             f"got {self.expert_params:g}")
        if self.max_nodes_per_token is not None and self.max_nodes_per_token < 1:
            raise ValueError(f"max_nodes_per_token must be >= 1 or None, got {self.max_nodes_per_token}")
        if (self.num_experts > 1) != (self.expert_params > 0):
            raise ValueError(f"num_experts = {self.num_experts} and expert_params = {self.expert_params:g}: "
                             "an MoE model has both above their dense values (1 and 0), a dense model neither")

    @property
    def params_per_token(self) -> float:
        """The parameters one token's forward pass uses (all of them in a dense model)."""
        return self.num_params if self.active_params is None else self.active_params


@dataclass(frozen=True)
class ClusterSpec:
    """GPUs and links. Defaults: H100 SXM (datasheet) with a 400 Gb/s network port per GPU."""

    name: str
    num_gpus: int
    gpus_per_node: int = 8
    gpu_memory_bytes: float = 80e9
    peak_flops: float = 989e12  # dense BF16 (H100 SXM datasheet: 1,979 TFLOP/s is with 2:4 sparsity)
    assumed_mfu: float = 0.55  # the fraction of peak the compute reaches when nothing waits: an assumption
    intra_node_bytes_per_s: float = 450e9  # NVLink 4: 900 GB/s per GPU counting both directions
    inter_node_bytes_per_s: float = 50e9  # a 400 Gb/s InfiniBand or RoCE port per GPU
    intra_node_latency_s: float = 3e-6  # assumed
    inter_node_latency_s: float = 10e-6  # assumed

    def __post_init__(self):
        if self.num_gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"num_gpus and gpus_per_node must be >= 1, got {self.num_gpus} and {self.gpus_per_node}")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(f"num_gpus ({self.num_gpus}) must be a multiple of gpus_per_node ({self.gpus_per_node})")
        if not 0 < self.assumed_mfu <= 1:
            raise ValueError(f"assumed_mfu must be in (0, 1], got {self.assumed_mfu}")


@dataclass(frozen=True)
class Layout:
    """How one training step is split: the parallel degrees, ZeRO, batching, pipeline schedule, recomputation,
    precision. The mesh's axes, innermost first: tp, cp, ep, pp, then the rest of dp (expert parallelism is carved
    out of data parallelism, as in Megatron-Core (whose default order otherwise puts pp outermost) and DeepSeek-V3)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallelism: carved out of dp, which it must divide
    zero_stage: int = 0  # 1: optimizer state sharded; 2: and gradients; 3: and weights
    micro_batch: int = 1  # sequences per micro-batch, b
    num_microbatches: int = 1  # per optimizer step on each pipeline, m (gradient accumulation when pp = 1)
    virtual_stages: int = 1  # chunks per pipeline stage, v (interleaved 1F1B)
    schedule: str = "1f1b"  # "1f1b" (interleaved when virtual_stages > 1) or "dualpipe" (DeepSeek-V3)
    recompute: str = "selective"  # "none", "selective" (attention scores: what FlashAttention does), "full"
    precision: Precision = field(default_factory=Precision)
    tp_across_nodes: bool = False

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "num_microbatches", "virtual_stages"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.schedule == "dualpipe":
            p, m = self.pp, self.num_microbatches
            if self.virtual_stages != 1 or p < 2 or p % 2 or m % 2 or m < 2 * p:
                raise ValueError(f"DualPipe needs virtual_stages = 1, an even pp >= 2 and an even num_microbatches "
                                 f">= 2 pp, got virtual_stages = {self.virtual_stages}, pp = {p}, "
                                 f"num_microbatches = {m}")


@dataclass(frozen=True)
class Plan:
    """The planner's answer for one layout: memory per GPU (bytes) and time per step (seconds)."""

    layout: Layout
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    memory_limit_bytes: float
    compute_s: float
    bubble_s: float
    comm_s: dict[str, float]  # exposed communication per mesh axis: "tp", "cp", "ep", "pp", "dp"
    model_flops_per_gpu: float  # per step, without recomputation
    peak_flops: float  # the GPU's

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.memory_limit_bytes

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + sum(self.comm_s.values())

    @property
    def mfu(self) -> float:
        """Model FLOPs utilization: the model's FLOP/s per GPU as a fraction of the GPU's peak."""
        return self.model_flops_per_gpu / (self.step_s * self.peak_flops)


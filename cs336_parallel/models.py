"""Small deterministic single-device reference models: the ground truth that exercises shard and tests
compare against. The same `seed` gives the same weights in every process, whatever the global RNG.

Layers are plain `nn.Linear`, `nn.LayerNorm` and `nn.Embedding`, named as Megatron and torchtitan
name them (`fc1`/`fc2`, `q_proj`/`k_proj`/`v_proj`/`out_proj`), so a parallel version can take its
slice of each weight from the reference.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@contextmanager
def seeded(seed: int):
    """Draw random numbers from `seed` inside the block without disturbing the caller's random state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class MLP(nn.Module):
    """fc1 -> GELU -> fc2: (B, T, D) -> (B, T, D), hidden size 4D by default."""

    def __init__(self, dim: int, hidden: int | None = None, *, bias: bool = True, seed: int = 0):
        super().__init__()
        with seeded(seed):
            self.fc1 = nn.Linear(dim, hidden or 4 * dim, bias=bias)
            self.fc2 = nn.Linear(hidden or 4 * dim, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Attention(nn.Module):
    """Multi-head self-attention with separate q/k/v projections (so heads split by columns)."""

    def __init__(self, dim: int, heads: int, *, causal: bool = True, bias: bool = True, seed: int = 0):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.heads, self.causal = heads, causal
        with seeded(seed):
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=bias) for _ in range(3))
            self.out_proj = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, -1).transpose(1, 2)  # (B, H, T, D/H)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, D)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, dim: int, heads: int, *, hidden: int | None = None, causal: bool = True, seed: int = 0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)  # ones and zeros: no randomness
        self.attn = Attention(dim, heads, causal=causal, seed=seed + 1)
        self.mlp = MLP(dim, hidden, seed=seed + 2)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MLPStack(nn.Module):
    """`depth` residual MLP layers on (B, D) or (B, T, D): a model to split into units or stages."""

    def __init__(self, dim: int, depth: int, *, hidden: int | None = None, seed: int = 0):
        super().__init__()
        self.layers = nn.ModuleList(MLP(dim, hidden, seed=seed + i) for i in range(depth))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def expert_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float | None) -> int:
    """The most tokens one expert takes from a batch: ceil(capacity_factor x k x num_tokens / num_experts).

    Switch Transformer's capacity (tokens / experts x capacity factor), times k for top-k routing as in
    GShard. `capacity_factor=None` means no limit (`num_tokens`: no token is ever dropped)."""
    if capacity_factor is None:
        return num_tokens
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 (or None for no limit), got {capacity_factor}")
    return math.ceil(capacity_factor * k * num_tokens / num_experts)


class Routing(NamedTuple):
    """Where `MoE.route` sends each of N tokens (shapes for E experts and top-k routing)."""

    probs: Tensor  # (N, E) the router's softmax over experts
    indices: Tensor  # (N, k) int64: the chosen experts, most probable first
    weights: Tensor  # (N, k) their probabilities divided by their sum (each row sums to 1)
    kept: Tensor  # (N, k) bool: False where the expert was full and dropped this token


class MoE(nn.Module):
    """Mixture-of-experts feed-forward layer (Shazeer et al. 2017; GShard; Switch Transformer), one device.

    Forward, for each token x (the rows of a (..., D) input, in row-major order = token order):
    the router scores the experts, `softmax(router(x))`; the token goes to its k most probable experts;
    the output is sum_j w_j expert_j(x) over the chosen experts whose assignment was kept, with w the
    chosen probabilities divided by their sum. Backward reaches the experts and, through w, the router
    (with k = 1, w = 1 and the router learns only from an auxiliary loss).

    Dropping: each expert takes at most `expert_capacity(N, E, k, capacity_factor)` tokens of a batch
    of N, the first ones in token order (whichever of its k choices the expert was: a token's choices
    never repeat an expert); the rest of its tokens are dropped *by that expert*. A dropped assignment
    contributes zero (the weights of the token's other experts are not renormalized), so a token that
    all its experts dropped comes out as zero and the residual connection around the layer carries it
    through unchanged. Megatron-Core calls this drop policy "position".

    Every expert runs, on no tokens if none reached it, so every parameter gets a gradient (zero if
    unused). Experts are `MLP`s seeded `seed + 1 + e`; the router is `nn.Linear(dim, E, bias=False)`.

    Shared experts (DeepSeekMoE, Dai et al. 2024; DeepSeek-V3 has 1 beside 256 routed ones): with
    `num_shared > 0`, every token also goes through `shared_experts`, unweighted and never dropped, and its
    output is added. Like DeepSeek-V3's code, the shared experts are one `MLP` whose hidden size is
    `num_shared` times an expert's (seeded `seed + 1 + E`, so the routed part is the same with or without).
    """

    def __init__(self, dim: int, num_experts: int, *, k: int = 1, hidden: int | None = None,
                 capacity_factor: float | None = None, bias: bool = True, num_shared: int = 0, seed: int = 0):
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if not 1 <= k <= num_experts:
            raise ValueError(f"k must be between 1 and num_experts ({num_experts}), got {k}")
        if num_shared < 0:
            raise ValueError(f"num_shared must be >= 0, got {num_shared}")
        expert_capacity(1, num_experts, k, capacity_factor)  # validates capacity_factor
        self.num_experts, self.k, self.capacity_factor = num_experts, k, capacity_factor
        with seeded(seed):
            self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(dim, hidden, bias=bias, seed=seed + 1 + e) for e in range(num_experts))
        self.shared_experts = (MLP(dim, num_shared * (hidden or 4 * dim), bias=bias, seed=seed + 1 + num_experts)
                               if num_shared else None)

    def route(self, x: Tensor) -> Routing:
        """Route the tokens of `x` (..., D): probabilities, top-k choices, weights, and which were kept."""
        flat = x.reshape(-1, x.shape[-1])  # (N, D)
        probs = F.softmax(self.router(flat), dim=-1)  # (N, E)
        top, indices = probs.topk(self.k, dim=-1)  # (N, k), most probable first
        weights = top / top.sum(dim=-1, keepdim=True)
        # An assignment's position in its expert's queue: how many earlier (token, choice) pairs chose it.
        chosen = F.one_hot(indices.reshape(-1), self.num_experts)  # (N k, E), token order then choice order
        position = (chosen.cumsum(0) - 1).gather(1, indices.reshape(-1, 1)).view_as(indices)
        capacity = expert_capacity(flat.shape[0], self.num_experts, self.k, self.capacity_factor)
        return Routing(probs, indices, weights, position < capacity)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, D)
        routing = self.route(flat)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, choice = torch.nonzero((routing.indices == e) & routing.kept, as_tuple=True)  # token order
            y = expert(flat[token])  # (tokens kept by expert e, D)
            out = out.index_add(0, token, routing.weights[token, choice, None] * y)
        if self.shared_experts is not None:  # every token, unweighted
            out = out + self.shared_experts(flat)
        return out.view_as(x)

"""Small deterministic single-device reference models: the ground truth that exercises shard and tests
compare against. The same `seed` gives the same weights in every process, whatever the global RNG.

Layers are plain `nn.Linear`, `nn.LayerNorm` and `nn.Embedding`, named as Megatron and torchtitan
name them (`fc1`/`fc2`, `q_proj`/`k_proj`/`v_proj`/`out_proj`), so a parallel version can take its
slice of each weight from the reference.
"""

from __future__ import annotations

from contextlib import contextmanager

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

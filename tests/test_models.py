"""The reference models: deterministic by seed, and the shapes and maths their docstrings promise."""

import torch
import torch.nn.functional as F

from cs336_parallel import models


def test_same_seed_same_weights_and_the_global_rng_is_untouched():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = models.TransformerBlock(16, 4, seed=7)
    assert torch.equal(torch.rand(1), before)  # building a model drew nothing from the global RNG
    b = models.TransformerBlock(16, 4, seed=7)
    c = models.TransformerBlock(16, 4, seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if "ln" not in name:
            assert not torch.equal(pa, pc), name


def test_attention_matches_a_hand_written_causal_attention():
    attn = models.Attention(8, 2, seed=0)
    x = torch.randn(2, 5, 8)
    q, k, v = (p(x).view(2, 5, 2, 4).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    scores = q @ k.transpose(-1, -2) / 2.0  # sqrt(head dim 4)
    scores = scores.masked_fill(torch.triu(torch.ones(5, 5, dtype=torch.bool), 1), float("-inf"))
    expected = attn.out_proj((F.softmax(scores, -1) @ v).transpose(1, 2).reshape(2, 5, 8))
    torch.testing.assert_close(attn(x), expected)


def test_block_and_stack_keep_the_shape():
    x = torch.randn(3, 4, 16)
    assert models.TransformerBlock(16, 4).to(torch.float64)(x.double()).shape == x.shape
    stack = models.MLPStack(16, depth=3, hidden=32)
    assert stack(x).shape == x.shape and len(stack.layers) == 3

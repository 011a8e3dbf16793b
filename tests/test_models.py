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


def moe_by_hand(moe: models.MoE, x: torch.Tensor, capacity: int) -> tuple[torch.Tensor, list[list[bool]]]:
    """The MoE layer one token at a time: top-k of the router's softmax, weights renormalized, and each
    expert taking its first `capacity` tokens in token order. Returns the output and who was kept."""
    flat = x.reshape(-1, x.shape[-1])
    taken = [0] * moe.num_experts
    rows, kept = [], []
    for token in flat:
        probs = F.softmax(token @ moe.router.weight.T, dim=-1)
        top, experts = probs.topk(moe.k)
        y, kept_here = torch.zeros_like(token), []
        for p, e in zip(top / top.sum(), experts.tolist(), strict=True):
            kept_here.append(taken[e] < capacity)
            if taken[e] < capacity:
                taken[e] += 1
                y = y + p * moe.experts[e](token)
        rows.append(y)
        kept.append(kept_here)
    return torch.stack(rows).view_as(x), kept


def test_moe_matches_a_loop_over_tokens_with_and_without_dropping():
    x = torch.randn(3, 8, 8)  # 24 tokens
    for k, capacity_factor, capacity in [(1, None, 24), (2, None, 24), (1, 1.0, 6), (2, 0.5, 6), (2, 1.25, 15)]:
        moe = models.MoE(8, 4, k=k, hidden=16, capacity_factor=capacity_factor, seed=3)
        assert models.expert_capacity(24, 4, k, capacity_factor) == capacity
        expected, kept = moe_by_hand(moe, x, capacity)
        torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-6)
        assert moe.route(x).kept.tolist() == kept
        if capacity_factor is None or capacity_factor > 1:
            assert all(all(row) for row in kept)
        else:
            assert not all(all(row) for row in kept)  # the case drops something


def test_moe_drops_exactly_the_late_tokens_of_a_full_expert():
    moe = models.MoE(4, 4, k=1, hidden=8, capacity_factor=1.0, seed=0)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2, 0] = 10.0  # every token with x[:, 0] > 0 prefers expert 2
    x = torch.randn(8, 4)
    x[:, 0] = 1.0
    routing = moe.route(x)
    assert (routing.indices == 2).all()
    capacity = models.expert_capacity(8, 4, 1, 1.0)  # 2
    assert routing.kept[:, 0].tolist() == [True] * capacity + [False] * (8 - capacity)
    out = moe(x)
    assert torch.equal(out[capacity:], torch.zeros(8 - capacity, 4))  # dropped: zero, the residual carries them
    torch.testing.assert_close(out[:capacity], moe.experts[2](x[:capacity]))


def test_moe_gradients_reach_router_and_experts_and_unused_experts_get_zeros():
    moe = models.MoE(8, 4, k=2, hidden=16, seed=1)
    x = torch.randn(10, 8, requires_grad=True)
    (moe(x) * torch.randn(10, 8)).sum().backward()
    assert moe.router.weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0
    for e, expert in enumerate(moe.experts):
        used = bool((moe.route(x).indices == e).any())
        assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) == used for p in expert.parameters()), e


def test_moe_is_deterministic_by_seed_and_checks_its_arguments():
    a, b = models.MoE(8, 4, k=2, seed=5), models.MoE(8, 4, k=2, seed=5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.experts[0].fc1.weight, a.experts[1].fc1.weight)  # experts differ
    assert a.router.bias is None and a.router.weight.shape == (4, 8)
    for kwargs in [{"k": 0}, {"k": 5}, {"capacity_factor": 0.0}, {"capacity_factor": -1.0}, {"num_shared": -1}]:
        try:
            models.MoE(8, 4, **kwargs)
        except ValueError as e:
            assert next(iter(kwargs)) in str(e)
        else:
            raise AssertionError(f"MoE(8, 4, **{kwargs}) should raise ValueError")
    assert models.expert_capacity(10, 4, 2, None) == 10 and models.expert_capacity(10, 4, 2, 1.0) == 5


def test_shared_experts_add_one_mlp_for_every_token_to_the_same_routed_layer():
    routed = models.MoE(8, 4, k=2, hidden=16, capacity_factor=0.5, seed=2)
    moe = models.MoE(8, 4, k=2, hidden=16, capacity_factor=0.5, num_shared=2, seed=2)
    assert routed.shared_experts is None and moe.shared_experts.fc1.out_features == 2 * 16
    x = torch.randn(12, 8, requires_grad=True)
    assert not moe.route(x).kept.all()  # some tokens are dropped by the routed experts, never by the shared ones
    y = moe(x)
    torch.testing.assert_close(y, routed(x) + moe.shared_experts(x), rtol=1e-5, atol=1e-6)
    y.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in moe.shared_experts.parameters())

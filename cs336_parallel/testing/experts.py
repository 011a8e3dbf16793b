"""Notebook 06's tests: top-k routing, the load-balancing loss, dispatch and combine with uneven splits, dispatch
into fixed slots, and the expert-parallel layer.

Every check draws its data from the test's own seed and sends each rank only what a rank of a real job holds: its
own tokens and their routing, the rows its own experts produced, and (for the layer) the weights of its own experts,
the router and the shared experts (the other experts' weights are NaN). The expected values are computed here, with
plain loops over every rank's data. What the ranks exchanged is checked twice: as each rank reports it (`probes`),
and as measured outside the ranks (`checks.assert_received`, `checks.assert_pairs`)."""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

from cs336_parallel import checks, models, probes
from cs336_parallel.testing.training import redraw

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
# A weight's gradient is a sum of products over rows (or features) that may cancel: float32 rounding scales with
# the terms, not with the sum, so its absolute part is torch's float32 default. (At 1e-6, a correct layer's expert
# gradient once missed by 1.08e-6: 0.0037529 for 0.0037540.)
GRADIENT_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
COUNT_BYTES = 8  # one int64 count


# -- top_k_route and load_balancing_loss (one process) -------------------------------------------------------------

def top_k_route_driver(top_k_route, logits: torch.Tensor, k: int, upstream: torch.Tensor) -> dict:
    """In the kernel: route these logits, then backpropagate `upstream` through the weights; what came out, whether
    the weights carry a gradient, and the logits' gradient (None if none reached them)."""
    logits = logits.clone().requires_grad_()
    indices, weights = top_k_route(logits, k)
    if weights.requires_grad and weights.shape == upstream.shape:
        (weights * upstream).sum().backward()
    return {"indices": indices, "weights": weights, "requires_grad": weights.requires_grad, "grad": logits.grad}


def check_top_k_route(top_k_route, shape: tuple, k: int, dtype: torch.dtype = torch.float32) -> None:
    """Ground truth: torch's softmax and topk, renormalized, and the gradient through the weights."""
    g = checks.generator()
    logits = checks.random_tensor(shape, dtype, generator=g)
    upstream = checks.random_tensor((*shape[:-1], k), dtype, generator=g)
    got = checks.call(top_k_route_driver, top_k_route, logits, k, upstream)
    logits.requires_grad_()
    top, indices = torch.softmax(logits, -1).topk(k)
    weights = top / top.sum(-1, keepdim=True)
    (weights * upstream).sum().backward()
    case = f"logits {shape} {dtype}, k={k}"
    checks.assert_equal(got["indices"], indices, name=f"{case}: expert indices (most probable first)")
    checks.assert_close(got["weights"], weights.detach(), name=f"{case}: weights", **TOLERANCE)
    checks.count_comparison()
    assert got["requires_grad"] and got["grad"] is not None, (
        f"{case}: the weights carry no gradient to the logits (the router could not learn through them)")
    checks.assert_close(got["grad"], logits.grad, name=f"{case}: gradient of the weights w.r.t. the logits",
                        **TOLERANCE)


def random_probs(n_tokens: int, num_experts: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Router probabilities of `n_tokens` tokens (softmax rows), drawn from the test's own seed."""
    return torch.softmax(checks.random_tensor((n_tokens, num_experts), dtype, generator=checks.generator()), -1)


def balancing_loss_driver(load_balancing_loss, probs: torch.Tensor, indices: torch.Tensor, num_experts: int) -> dict:
    """In the kernel: the loss of these probabilities and choices, and the gradient it sends back to the
    probabilities (None if it carries none)."""
    probs = probs.clone().requires_grad_()
    loss = load_balancing_loss(probs, indices, num_experts)
    carries = isinstance(loss, torch.Tensor) and loss.requires_grad and loss.dim() == 0
    if carries:
        loss.backward()
    return {"loss": loss, "requires_grad": carries, "grad": probs.grad}


def check_balancing_loss(load_balancing_loss, probs: torch.Tensor, indices: torch.Tensor, num_experts: int) -> None:
    """Ground truth, one expert at a time: f_i = share of the N k choices, P_i = mean probability; the gradient
    flows through P only."""
    got = checks.call(balancing_loss_driver, load_balancing_loss, probs, indices, num_experts)
    case = f"router_probs {tuple(probs.shape)} {probs.dtype}, expert_indices {tuple(indices.shape)}"
    leaf = probs.clone().requires_grad_()
    expected = leaf.new_zeros(())
    for i in range(num_experts):
        expected = expected + (indices == i).sum().item() / indices.numel() * leaf[:, i].mean()
    expected = num_experts * expected
    expected.backward()
    checks.assert_close(got["loss"], expected.detach(), name=f"{case}: loss", **TOLERANCE)
    checks.count_comparison()
    assert got["requires_grad"], f"{case}: the loss carries no gradient (the router could not learn from it)"
    checks.assert_close(got["grad"], leaf.grad, name=f"{case}: gradient w.r.t. router_probs", **TOLERANCE)


# -- shared by dispatch, combine, dispatch_padded and the layer -------------------------------------------------

def grad_of(t: torch.Tensor) -> torch.Tensor:
    """`t.grad`, where no gradient at all counts as zeros (as autograd means it)."""
    return torch.zeros_like(t) if t.grad is None else t.grad


def backward(loss: torch.Tensor) -> None:
    """Backpropagate, unless nothing this rank computed needs a gradient (everything dropped, say)."""
    if loss.requires_grad:
        loss.backward()


def kept_assignments(indices: torch.Tensor, num_experts: int, capacity: int) -> list[tuple[int, int]]:
    """Ground truth for one rank, by a plain loop: its kept (expert, assignment) pairs, sorted by expert and
    then token order; assignment a is choice a % k of token a // k."""
    taken, kept = [0] * num_experts, []
    for a, e in enumerate(indices.flatten().tolist()):
        if taken[e] < capacity:
            taken[e] += 1
            kept.append((e, a))
    return sorted(kept)


def rows_between(kept: list[list[tuple[int, int]]], num_experts: int) -> list[list[int]]:
    """`rows[s][r]`: how many kept assignments rank s sends to rank r (the owner of their experts)."""
    n = len(kept)
    per = num_experts // n
    return [[sum(1 for e, _ in kept[s] if e // per == r) for r in range(n)] for s in range(n)]


def routing_data(sizes: list[int], dim: int, num_experts: int, k: int, skew: float = 1.0,
                 dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's tokens and expert choices, drawn from the test's own seed; `skew` favours high experts."""
    g = checks.generator()
    data = []
    for size in sizes:
        tokens = checks.random_tensor((size, dim), dtype, generator=g)
        scores = torch.rand(size, num_experts, generator=g) * torch.linspace(1, 1 + skew, num_experts)
        data.append((tokens, scores.topk(k).indices))
    return data


def assert_all_to_alls(record: dict, exercise: str, *, rank: int) -> list[int]:
    """The rule of dispatch, combine and dispatch_padded, checked in each of their tests: they communicate with
    all-to-alls only, every one visible to the test. Returns the bytes of each call (the rank's own word)."""
    checks.assert_nothing_hidden(record, exercise, rank=rank)
    ops = list(checks.collective_counts(record))
    checks.count_comparison()
    assert all(op == "all_to_all" for op in ops), (
        f"rank {rank}: {exercise} called {ops}; it communicates with all-to-alls only")
    return [nbytes for _, nbytes, _ in record["calls"]]


def assert_exchanged(expected: list[list[int]], messages: int, counts: int, what: str) -> None:
    """Measured outside the ranks: rank r sent rank s `expected[r][s]` bytes (give or take a little per message, and
    the `counts` bytes of its counts, which may be of any integer type), and nothing else."""
    n = len(expected)
    checks.assert_pairs({(r, s): expected[r][s] for r in range(n) for s in range(n) if r != s},
                        {(r, s): messages for r in range(n) for s in range(n) if r != s}, what, spread=counts)


# -- dispatch -------------------------------------------------------------------------------------------------------

def dispatch_driver(dispatch, num_experts: int, capacity: int, gradients: bool, tokens: torch.Tensor,
                    indices: torch.Tensor) -> dict:
    """On a rank: dispatch its tokens, then (with `gradients`) backpropagate half the squared rows (each row's
    gradient is the row, and must come back to its token); the rows, the plan, the tokens' gradient and the
    collectives."""
    tokens = tokens.clone().requires_grad_()
    with probes.count_collectives() as comm:
        received, plan = dispatch(tokens, indices, num_experts, capacity)
    if gradients:
        backward((received ** 2 / 2).sum())
    order, send_counts, recv_counts = plan
    return {"received": received, "order": order, "send_counts": send_counts, "recv_counts": recv_counts,
            "grad": grad_of(tokens), "comm": comm.record()}


def expected_dispatch(data: list[tuple], num_experts: int, k: int, capacity: int) -> list[dict]:
    """What every rank should get, by plain loops over every rank's data."""
    n, per, dim, dtype = len(data), num_experts // len(data), data[0][0].shape[1], data[0][0].dtype
    kept = [kept_assignments(indices, num_experts, capacity) for _, indices in data]
    expected = []
    for rank in range(n):
        rows, recv_counts = [], torch.zeros(n, per, dtype=torch.long)
        for s, (tokens, _) in enumerate(data):
            for e, a in kept[s]:
                if e // per == rank:
                    rows.append(tokens[a // k])
                    recv_counts[s, e % per] += 1
        mine = torch.tensor(kept[rank], dtype=torch.long).view(-1, 2)  # (expert, assignment) rows
        copies = torch.bincount(mine[:, 1] // k, minlength=len(data[rank][0]))
        expected.append({"received": torch.stack(rows) if rows else torch.zeros(0, dim, dtype=dtype),
                         "order": mine[:, 1], "send_counts": torch.bincount(mine[:, 0], minlength=num_experts),
                         "recv_counts": recv_counts, "grad": copies[:, None].to(dtype) * data[rank][0]})
    return expected


def check_dispatch(dispatch, sizes: list, dim: int, num_experts: int, k: int, capacity: int, skew: float = 1.0,
                   dtype: torch.dtype = torch.float32, *, compare: bool = True) -> dict:
    """Run dispatch on len(sizes) ranks, each given its own tokens and choices; check its rule (all-to-alls only)
    and that each rank received the rows the others kept for its experts; with `compare`, each rank's rows, plan and
    gradient (`compare=False`: forward only). Returns what the traffic test needs: each rank's calls (bytes each),
    the rows between each pair by the ranks' own plans, the bytes of a row and of the counts a rank sends another."""
    n, per = len(sizes), num_experts // len(sizes)
    data = routing_data(sizes, dim, num_experts, k, skew, dtype)
    got = checks.run(n, dispatch_driver, dispatch, num_experts, capacity, compare, per_rank=data)
    case = f"tokens per rank {sizes}, {num_experts} experts, k={k}, capacity {capacity}, {dtype}"
    calls = [assert_all_to_alls(result["comm"], "dispatch", rank=rank) for rank, result in enumerate(got)]
    rows = rows_between([kept_assignments(indices, num_experts, capacity) for _, indices in data], num_experts)
    row_bytes = dim * dtype.itemsize
    # The counts of the others, and the rows they kept for this rank's experts.
    checks.assert_received([sum((per * COUNT_BYTES + rows[s][r] * row_bytes) for s in range(n) if s != r)
                            for r in range(n)], f"dispatch, {case}")
    if compare:
        for rank, (result, want) in enumerate(zip(got, expected_dispatch(data, num_experts, k, capacity),
                                                  strict=True)):
            for key, name in [("received", "received rows"), ("order", "plan.order"),
                              ("send_counts", "plan.send_counts"), ("recv_counts", "plan.recv_counts")]:
                checks.assert_equal(result[key], want[key], name=f"{case}: {name}", rank=rank)
            checks.assert_close(result["grad"], want["grad"], name=f"{case}: tokens.grad", rank=rank, **TOLERANCE)
    return {"calls": calls, "rows": _planned_rows(got, num_experts) or rows, "row_bytes": row_bytes,
            "count_bytes": per * COUNT_BYTES}


def _planned_rows(got: list, num_experts: int) -> list[list[int]] | None:
    """`rows[s][r]`, the rows rank s's own plan sends rank r (its `send_counts` by owner); None if a plan is not
    one (the main tests say what is wrong with it)."""
    n = len(got)
    try:
        return [torch.as_tensor(result["send_counts"]).reshape(n, num_experts // n).sum(1).tolist() for result in got]
    except (RuntimeError, TypeError, ValueError):
        return None


def assert_two_all_to_alls(traffic: dict, case: str) -> None:
    """Dispatch's traffic, forward: two all-to-alls, the counts and then the rows its plan counts (as each rank
    reports); measured outside the ranks, each pair exchanged those counts and rows and nothing else: no all-gather
    of the tokens."""
    rows, row_bytes = traffic["rows"], traffic["row_bytes"]
    n = len(rows)
    for rank, calls in enumerate(traffic["calls"]):
        moved = max(sum(rows[rank]), sum(rows[s][rank] for s in range(n))) * row_bytes
        checks.count_comparison()
        assert len(calls) == 2 and calls[1] == moved, (
            f"{case}, rank {rank}: dispatch should make two all-to-alls, the counts and then the {moved} bytes of "
            f"rows its plan counts; it made {len(calls)}, of {calls} bytes")
    assert_exchanged([[traffic["count_bytes"] + rows[s][r] * row_bytes for r in range(n)] for s in range(n)], 2,
                     traffic["count_bytes"], f"dispatch's counts and rows ({case})")


def refused(exercise, num_experts: int) -> dict:
    """On a rank: what dispatch (or dispatch_padded) does with 4 tokens for `num_experts` experts, 4 per expert."""
    return probes.outcome(exercise, torch.zeros(4, 2), torch.zeros(4, 1, dtype=torch.long), num_experts, 4)


# -- combine --------------------------------------------------------------------------------------------------------

class Plan(tuple):
    """A plan as dispatch makes it, (order, send_counts, recv_counts), made by the test's own loops."""

    def __new__(cls, order: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor):
        return super().__new__(cls, (order, send_counts, recv_counts))

    order = property(lambda self: self[0])
    send_counts = property(lambda self: self[1])
    recv_counts = property(lambda self: self[2])


def plan_of(kept: list[tuple[int, int]], recv_counts: torch.Tensor, num_experts: int) -> tuple:
    """A rank's plan, from its kept (expert, assignment) pairs: (order, send_counts, recv_counts)."""
    return (torch.tensor([a for _, a in kept], dtype=torch.long),
            torch.bincount(torch.tensor([e for e, _ in kept], dtype=torch.long), minlength=num_experts), recv_counts)


def expert_rows(data: list[tuple], rank: int, num_experts: int, k: int) -> tuple[list, list, torch.Tensor]:
    """What rank `rank`'s experts hand to combine: every row they received, scaled by (1 + expert id), in
    dispatch's order; the gradient each row should get back; and the plan's recv_counts."""
    n = len(data)
    per = num_experts // n
    rows, row_grads, recv_counts = [], [], torch.zeros(n, per, dtype=torch.long)
    for s, (tokens, weights, g_out, kept) in enumerate(data):
        for e, a in kept:
            if e // per == rank:
                rows.append(tokens[a // k] * (1 + e))
                row_grads.append(weights.flatten()[a] * g_out[a // k])
                recv_counts[s, e % per] += 1
    return rows, row_grads, recv_counts


def combine_driver(combine, gradients: bool, expert_outputs: torch.Tensor, weights: torch.Tensor,
                   order: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor,
                   g_out: torch.Tensor) -> dict:
    """On a rank: combine the rows its experts produced (made by the test, not by your dispatch) with its own
    routing weights and plan, then (with `gradients`) backpropagate `g_out`; the output, the two gradients and the
    collectives."""
    expert_outputs = expert_outputs.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    with probes.count_collectives() as comm:
        out = combine(expert_outputs, weights, Plan(order, send_counts, recv_counts))
    if gradients:
        backward((out * g_out).sum() if out.shape == g_out.shape else out.sum())
    return {"out": out, "grad_outputs": grad_of(expert_outputs), "grad_weights": grad_of(weights),
            "comm": comm.record()}


def combine_case(sizes: list, dim: int, num_experts: int, k: int, capacity: int) -> list[tuple]:
    """Every rank's (tokens, weights, output gradient, kept assignments), drawn from the test's own seed."""
    g = checks.generator()
    data = []
    for size in sizes:
        indices = torch.rand(size, num_experts, generator=g).topk(k).indices
        weights = torch.softmax(torch.randn(size, k, generator=g, dtype=torch.float64), -1).float()
        data.append((checks.random_tensor((size, dim), generator=g), weights,
                     checks.random_tensor((size, dim), generator=g), kept_assignments(indices, num_experts, capacity)))
    return data


def check_combine(combine, sizes: list, dim: int, num_experts: int, k: int, capacity: int, *,
                  compare: bool = True) -> dict:
    """Run combine on len(sizes) ranks, each given the rows its experts produced and its own weights and plan;
    check its rule (all-to-alls only) and that each rank received its rows back; with `compare`, each rank's output
    and gradients against plain loops (`compare=False`: forward only). Returns what the traffic test needs: each
    rank's calls (bytes each), the rows each rank sends each other home, and the bytes of a row."""
    n, per = len(sizes), num_experts // len(sizes)
    data = combine_case(sizes, dim, num_experts, k, capacity)
    per_rank = []
    for rank, (_, weights, g_out, kept) in enumerate(data):
        rows, _, recv_counts = expert_rows(data, rank, num_experts, k)
        outputs = torch.stack(rows) if rows else torch.zeros(0, dim)
        per_rank.append((outputs, weights, *plan_of(kept, recv_counts, num_experts), g_out))
    got = checks.run(n, combine_driver, combine, compare, per_rank=per_rank)
    sent = rows_between([kept for *_, kept in data], num_experts)  # at dispatch: rank s sent sent[s][r] rows to r
    traffic = {"calls": [assert_all_to_alls(result["comm"], "combine", rank=rank) for rank, result in enumerate(got)],
               "home": [[sent[s][r] for s in range(n)] for r in range(n)], "row_bytes": dim * 4}
    case = f"tokens per rank {sizes}, {num_experts} experts, k={k}, capacity {capacity}"
    # The rows of this rank's tokens that other ranks' experts produced.
    checks.assert_received([sum(1 for e, _ in kept if e // per != rank) * dim * 4 for rank, (*_, kept) in
                            enumerate(data)], f"combine, {case}")
    if not compare:
        return traffic
    for rank, result in enumerate(got):
        tokens, weights, g_out, kept = data[rank]
        expected = torch.zeros(sizes[rank], dim)
        expected_wgrad = torch.zeros(sizes[rank], k)
        for e, a in kept:
            expected[a // k] += weights.flatten()[a] * tokens[a // k] * (1 + e)
            expected_wgrad.view(-1)[a] = (g_out[a // k].double() * tokens[a // k].double() * (1 + e)).sum().float()
        _, row_grads, _ = expert_rows(data, rank, num_experts, k)
        checks.assert_close(result["out"], expected, name=f"{case}: combined output", rank=rank, **TOLERANCE)
        checks.assert_close(result["grad_outputs"], torch.stack(row_grads) if row_grads else torch.zeros(0, dim),
                            name=f"{case}: gradient w.r.t. expert_outputs", rank=rank, **TOLERANCE)
        checks.assert_close(result["grad_weights"], expected_wgrad, name=f"{case}: gradient w.r.t. weights",
                            rank=rank, **GRADIENT_TOLERANCE)
    return traffic


def assert_one_all_to_all(traffic: dict, case: str) -> None:
    """Combine's traffic, forward: the rows go home in one all-to-all (as each rank reports); measured outside the
    ranks, each rank sent each other rank the rows of its tokens, and nothing else."""
    for rank, sizes in enumerate(traffic["calls"]):
        checks.count_comparison()
        assert len(sizes) == 1, (
            f"{case}, rank {rank}: combine sends the rows home in one all-to-all, it made {len(sizes)}")
    home, row_bytes = traffic["home"], traffic["row_bytes"]
    assert_exchanged([[rows * row_bytes for rows in row] for row in home], 1, 0, f"combine's rows home ({case})")


# -- dispatch_padded ------------------------------------------------------------------------------------------------

def dispatch_padded_driver(dispatch_padded, num_experts: int, capacity: int, gradients: bool, tokens: torch.Tensor,
                           indices: torch.Tensor) -> dict:
    """On a rank: dispatch its tokens into slots, then (with `gradients`) backpropagate half the squared slots; the
    slots, the counts, the tokens' gradient and the collectives."""
    tokens = tokens.clone().requires_grad_()
    with probes.count_collectives() as comm:
        received, recv_counts = dispatch_padded(tokens, indices, num_experts, capacity)
    if gradients:
        backward((received ** 2 / 2).sum())
    return {"received": received, "recv_counts": recv_counts, "grad": grad_of(tokens), "comm": comm.record()}


def check_dispatch_padded(dispatch_padded, sizes: list, dim: int, num_experts: int, k: int, capacity: int,
                          dtype: torch.dtype = torch.float32, *, compare: bool = True) -> list[list[int]]:
    """Run dispatch_padded on len(sizes) ranks, each given its own tokens and choices; check its rule (all-to-alls
    only) and that each rank received the rows the others kept for its experts; with `compare`, the slots, counts,
    padding and gradients against the loops of the dispatch tests (`compare=False`: forward only). Returns the bytes
    of each rank's calls."""
    n, per = len(sizes), num_experts // len(sizes)
    data = routing_data(sizes, dim, num_experts, k, 1.0, dtype)
    got = checks.run(n, dispatch_padded_driver, dispatch_padded, num_experts, capacity, compare, per_rank=data)
    calls = [assert_all_to_alls(result["comm"], "dispatch_padded", rank=rank) for rank, result in enumerate(got)]
    case = f"tokens per rank {sizes}, {num_experts} experts, k={k}, capacity {capacity}, {dtype}"
    rows = rows_between([kept_assignments(indices, num_experts, capacity) for _, indices in data], num_experts)
    checks.assert_received([sum((per * COUNT_BYTES + rows[s][r] * dim * dtype.itemsize) for s in range(n) if s != r)
                            for r in range(n)], f"dispatch_padded, {case}")
    if not compare:
        return calls
    for rank, result in enumerate(got):
        expected = torch.zeros(n, per, capacity, dim, dtype=dtype)
        counts = torch.zeros(n, per, dtype=torch.long)
        for s, (tokens, indices) in enumerate(data):
            for e, a in kept_assignments(indices, num_experts, capacity):
                if e // per == rank:
                    expected[s, e % per, counts[s, e % per]] = tokens[a // k]
                    counts[s, e % per] += 1
        mine = kept_assignments(data[rank][1], num_experts, capacity)
        copies = torch.bincount(torch.tensor([a // k for _, a in mine], dtype=torch.long), minlength=sizes[rank])
        checks.assert_equal(result["received"], expected, name=f"{case}: received slots (padding zero)", rank=rank)
        checks.assert_equal(result["recv_counts"], counts, name=f"{case}: recv_counts", rank=rank)
        checks.assert_close(result["grad"], copies[:, None].to(dtype) * data[rank][0], name=f"{case}: tokens.grad",
                            rank=rank, **TOLERANCE)
    return calls


def assert_fixed_exchange(calls: list[list[int]], num_experts: int, capacity: int, dim: int, case: str) -> None:
    """dispatch_padded's traffic, forward: two all-to-alls, the counts and the whole buffer of slots, whatever the
    routing (as each rank reports); measured outside the ranks, each pair exchanged its share of the counts and of
    the buffer, and nothing else."""
    n = len(calls)
    buffer_bytes = num_experts * capacity * dim * 4
    for rank, sizes in enumerate(calls):
        checks.count_comparison()
        assert len(sizes) == 2 and sizes.count(buffer_bytes) == 1, (
            f"{case}, rank {rank}: dispatch_padded should make two all-to-alls, the counts and the whole "
            f"{buffer_bytes}-byte buffer of slots, whatever the routing; it made {len(sizes)}, of {sizes} bytes")
    counts = num_experts // n * COUNT_BYTES
    share = counts + num_experts // n * capacity * dim * 4
    assert_exchanged([[share] * n for _ in range(n)], 2, counts, f"dispatch_padded's counts and slots ({case})")


# -- ExpertParallelMoE ----------------------------------------------------------------------------------------------

def make_moe(dim: int, num_experts: int, k: int, capacity_factor, steer: dict | None, num_shared: int,
             generator: torch.Generator) -> models.MoE:
    """The reference layer, its weights drawn from `generator`; `steer` = {expert: strength} makes the router
    follow feature 0 (tokens with x[:, 0] > 0 then prefer experts with positive strength)."""
    moe = models.MoE(dim, num_experts, k=k, hidden=2 * dim, capacity_factor=capacity_factor, num_shared=num_shared)
    redraw(moe, generator)
    if steer:
        with torch.no_grad():
            moe.router.weight.mul_(0.01)
            for e, strength in steer.items():
                moe.router.weight[e, 0] = strength
    return moe


def only_my_experts(moe: models.MoE, rank: int, world_size: int) -> dict:
    """What rank `rank` is handed of `moe`: its state_dict with every other rank's experts NaN."""
    per = moe.num_experts // world_size
    state = {name: t.detach().clone() for name, t in moe.state_dict().items()}
    for name, t in state.items():
        if name.startswith("experts.") and int(name.split(".")[1]) // per != rank:
            t.fill_(math.nan)
    return state


class _Exchange(torch.autograd.Function):
    """The test's own all-to-all of rows (fixed splits); backward sends each gradient row back."""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits):
        ctx.splits = (output_splits, input_splits)
        out = rows.new_empty((sum(output_splits), rows.shape[1]))
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _Exchange.apply(grad, input_splits, output_splits), None, None


class StepsOfTheTest:
    """On a rank: route, dispatch and combine for ExpertParallelMoE, made from this rank's plan (which the test
    computed from every rank's routing): they record what the layer hands them, and move the rows themselves."""

    def __init__(self, k: int, order: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor,
                 sends: list[int], receives: list[int]):
        self.k, self.plan, self.sends, self.receives = k, Plan(order, send_counts, recv_counts), sends, receives
        self.calls = {"route": 0, "dispatch": [], "combine": 0}

    def route(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls["route"] += 1
        top, indices = torch.softmax(logits, -1).topk(k, -1)
        return indices, top / top.sum(-1, keepdim=True)

    def dispatch(self, tokens: torch.Tensor, expert_indices: torch.Tensor, num_experts: int,
                 capacity: int) -> tuple[torch.Tensor, Plan]:
        self.calls["dispatch"].append({"num_experts": num_experts, "capacity": capacity,
                                       "expert_indices": expert_indices.detach().clone()})
        return _Exchange.apply(tokens[self.plan.order // self.k], self.receives, self.sends), self.plan

    def combine(self, expert_outputs: torch.Tensor, weights: torch.Tensor, plan: Plan) -> torch.Tensor:
        self.calls["combine"] += 1
        back = _Exchange.apply(expert_outputs, self.sends, self.receives)  # in the order of plan.order
        weighted = weights.reshape(-1)[self.plan.order][:, None] * back
        return back.new_zeros(len(weights), back.shape[1]).index_add(0, self.plan.order // self.k, weighted)


def parameters_and_grads(module) -> dict | None:
    """{name: (value, gradient or None)} of a module's parameters; None for no module."""
    if module is None:
        return None
    return {name: (p.detach(), p.grad) for name, p in module.named_parameters()}


def layer_driver(ExpertParallelMoE, sizes: tuple, capacity_factor, state: dict, x: torch.Tensor, g_out: torch.Tensor,
                 steps: tuple) -> dict:
    """On a rank: build the layer from a models.MoE holding this rank's `state` (its own experts, the router and
    the shared experts) with the test's steps, run its tokens forward and `g_out` backward; the output, the
    gradients, the layer's parameters, and the steps' calls. `sizes`: (dim, experts, k, hidden, shared hidden)."""
    dim, num_experts, k, hidden, shared = sizes
    moe = models.MoE(dim, num_experts, k=k, hidden=hidden, capacity_factor=capacity_factor,
                     num_shared=shared // hidden)
    moe.load_state_dict(state)
    test = StepsOfTheTest(k, *steps)
    layer = ExpertParallelMoE.from_dense(moe, capacity_factor, route=test.route, dispatch=test.dispatch,
                                         combine=test.combine)
    dense = {id(p) for p in moe.parameters()}
    copies = not any(id(p) in dense for p in layer.parameters())
    x = x.clone().requires_grad_()
    y = layer(x)
    backward((y * g_out).sum() if y.shape == g_out.shape else y.sum())
    return {"y": y, "x_grad": grad_of(x), "router": parameters_and_grads(layer.router),
            "experts": [parameters_and_grads(e) for e in layer.experts],
            "shared_experts": parameters_and_grads(layer.shared_experts), "calls": test.calls, "copies": copies}


def assert_parameters(got: dict, reference, what: str, rank: int) -> None:
    """A module's parameters (a driver's parameters_and_grads) equal the reference's, gradients close."""
    expected = dict(reference.named_parameters())
    checks.count_comparison()
    assert list(got) == list(expected), f"rank {rank}: {what} has the parameters {list(got)}, expected {list(expected)}"
    for name, (value, grad) in got.items():
        checks.assert_equal(value, expected[name].detach(), name=f"{what}.{name}", rank=rank)
        assert grad is not None, f"rank {rank}: {what}.{name} got no gradient"
        checks.assert_close(grad, expected[name].grad, name=f"{what}.{name}.grad", rank=rank, **GRADIENT_TOLERANCE)


def _kept_per_rank(moe: models.MoE, xs: list[torch.Tensor], capacity_factor) -> list[list[tuple[int, int]]]:
    """Each rank's kept (expert, assignment) pairs under the reference router and its capacity."""
    flat = [x.reshape(-1, x.shape[-1]) for x in xs]
    capacities = [models.expert_capacity(len(x), moe.num_experts, moe.k, capacity_factor) for x in flat]
    with torch.no_grad():
        return [kept_assignments(moe.route(x).indices, moe.num_experts, c) for x, c in zip(flat, capacities,
                                                                                           strict=True)]


def _steps_per_rank(moe: models.MoE, xs: list[torch.Tensor], capacity_factor) -> list[tuple]:
    """Each rank's plan for the test's steps: (order, send_counts, recv_counts, rows it sends to each rank, rows it
    receives from each rank), from every rank's routing (what the count exchange tells a real rank)."""
    n, num_experts = len(xs), moe.num_experts
    per = num_experts // n
    kept = _kept_per_rank(moe, xs, capacity_factor)
    rows = rows_between(kept, num_experts)
    steps = []
    for rank in range(n):
        recv_counts = torch.tensor([[sum(1 for e, _ in kept[s] if e == rank * per + j) for j in range(per)]
                                    for s in range(n)], dtype=torch.long)
        steps.append((*plan_of(kept[rank], recv_counts, num_experts), rows[rank], [rows[s][rank] for s in range(n)]))
    return steps


def check_expert_parallel(ExpertParallelMoE, sizes: list, dim: int, num_experts: int, k: int, capacity_factor,
                          steer: dict | None = None, signs: list | None = None, num_shared: int = 0,
                          batch: int = 1) -> int:
    """Rank r runs its tokens through the expert-parallel layer, handed its own experts' weights only; ground truth:
    the reference MoE on the same tokens (rank r's alone for the output and the gradients of the input, the router
    and the shared experts; every rank's for the experts' gradients). `batch` > 1 gives each rank a (batch, T, D)
    input. Unsteered, the draw is repeated until every expert keeps a row: an idle expert is the concern of the
    cases that steer the router only. Returns how many choices the ranks dropped."""
    n, per = len(sizes), num_experts // len(sizes)
    g = checks.generator()
    for _ in range(100):
        moe = make_moe(dim, num_experts, k, capacity_factor, steer, num_shared, g)
        xs = [checks.random_tensor((size, dim), generator=g) for size in sizes]
        if signs:  # feature 0 positive or negative per rank, to steer each rank's tokens
            for s, x in enumerate(xs):
                x[:, 0] = signs[s] * (1 + x[:, 0].abs())
        busy = {e for kept in _kept_per_rank(moe, xs, capacity_factor) for e, _ in kept}
        if steer or len(busy) == num_experts:
            break
    else:
        raise RuntimeError(f"no draw of {sizes} tokens kept every one of {num_experts} experts busy")
    gs = [checks.random_tensor((size, dim), generator=g) for size in sizes]
    if batch > 1:
        xs, gs = ([t.view(batch, -1, dim) for t in ts] for ts in (xs, gs))
    shapes = (dim, num_experts, k, 2 * dim, num_shared * 2 * dim)
    per_rank = [(only_my_experts(moe, rank, n), xs[rank], gs[rank], steps)
                for rank, steps in enumerate(_steps_per_rank(moe, xs, capacity_factor))]
    got = checks.run(n, layer_driver, ExpertParallelMoE, shapes, capacity_factor, per_rank=per_rank)
    case = f"tokens per rank {sizes}, {num_experts} experts, k={k}, capacity factor {capacity_factor}"
    # The others' rows for this rank's experts (the test's dispatch moves them once the layer calls it).
    checks.assert_received([sum(step[4][s] for s in range(n) if s != rank) * dim * 4 for rank, (*_, step) in
                            enumerate(per_rank)], f"ExpertParallelMoE, {case}")
    pristine = copy.deepcopy(moe)
    for x, grad in zip(xs, gs, strict=True):  # the experts see every rank's tokens
        (moe(x) * grad).sum().backward()
    dropped = 0
    for rank, result in enumerate(got):
        mine = copy.deepcopy(pristine)  # the router, the shared experts and the input see this rank's tokens only
        x = xs[rank].clone().requires_grad_()
        (mine(x) * gs[rank]).sum().backward()
        routing = mine.route(xs[rank])
        capacity = models.expert_capacity(sizes[rank], num_experts, k, capacity_factor)
        calls = result["calls"]
        checks.count_comparison()
        assert calls["route"] == 1 and len(calls["dispatch"]) == 1 and calls["combine"] == 1, (
            f"{case}: rank {rank}'s forward should call the route, dispatch and combine it was given once each; it "
            f"called them {calls['route']}, {len(calls['dispatch'])} and {calls['combine']} times")
        handed = calls["dispatch"][0]
        assert (handed["num_experts"], handed["capacity"]) == (num_experts, capacity), (
            f"{case}: rank {rank} should hand dispatch {num_experts} experts and the capacity for its {sizes[rank]} "
            f"tokens, {capacity}; it handed {handed['num_experts']} and {handed['capacity']}")
        checks.assert_equal(handed["expert_indices"], routing.indices, name=f"{case}: the expert choices passed to "
                            "dispatch", rank=rank)
        assert len(result["experts"]) == per, (
            f"{case}: rank {rank} should keep {per} experts, it has {len(result['experts'])}")
        assert result["copies"], (f"{case}: rank {rank}'s layer holds parameters of the MoE it was made from; it "
                                  "should keep copies")
        checks.assert_close(result["y"], mine(xs[rank]).detach(), name=f"{case}: output", rank=rank, **TOLERANCE)
        checks.assert_close(result["x_grad"], x.grad, name=f"{case}: input gradient", rank=rank, **TOLERANCE)
        assert_parameters(result["router"], mine.router, f"{case}: router", rank)
        for j, expert in enumerate(result["experts"]):
            assert_parameters(expert, moe.experts[rank * per + j], f"{case}: expert {rank * per + j}", rank)
        if num_shared:
            assert result["shared_experts"] is not None, f"{case}: rank {rank}'s layer has no shared_experts"
            assert_parameters(result["shared_experts"], mine.shared_experts, f"{case}: shared_experts", rank)
        else:
            assert result["shared_experts"] is None, (
                f"{case}: moe has no shared experts, but rank {rank}'s are not None")
        dropped += int((~routing.kept).sum())
    return dropped


def never(*args, **kwargs):
    raise RuntimeError("from_dense should not route, dispatch or combine anything")


def refused_layer(ExpertParallelMoE, num_experts: int) -> dict:
    """On a rank: what from_dense does with a MoE of `num_experts` experts on these ranks."""
    return probes.outcome(ExpertParallelMoE.from_dense, models.MoE(8, num_experts, k=2), None, route=never,
                          dispatch=never, combine=never)

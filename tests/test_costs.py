"""The cost formulas notebooks 07 and 09 share (`cs336_parallel.costs`), against the schedules simulated step by step
and against sums done by hand."""

from __future__ import annotations

import pytest
from test_schedules import interleaved, one_f_one_b

from cs336_parallel import costs
from cs336_parallel.dualpipe import dualpipe_schedule
from cs336_parallel.schedules import simulate


@pytest.mark.parametrize("p, m, v", [(2, 2, 1), (4, 8, 1), (4, 4, 2), (4, 8, 4), (3, 9, 3), (8, 8, 2)])
def test_the_bubble_is_the_simulated_idle_share_of_the_whole_step(p, m, v):
    schedule = one_f_one_b(p, m) if v == 1 else interleaved(p, m, v)
    for t_f, t_b, t_w in [(1, 1, 1), (1, 2, 0)]:
        simulated = simulate(schedule, t_f, t_b, t_w).bubble_fraction
        assert costs.bubble_fraction(p, m, v) == pytest.approx(float(simulated), rel=1e-12)


def test_the_bubble_over_the_step_and_over_the_computation_are_the_same_idle_time():
    """Llama 3's (pp - 1) / (v m) is the bubble over the computation: f / (1 - f) of the fraction of the step."""
    f = costs.bubble_fraction(16, 16, 4)
    assert f == pytest.approx(15 / 79) and f / (1 - f) == pytest.approx(15 / 64)


@pytest.mark.parametrize("p, m", [(4, 8), (8, 16), (16, 32)])
def test_dualpipe_bubble_comes_from_its_simulated_schedule(p, m):
    simulated = simulate(dualpipe_schedule(p, m), 1, 1, 1, layout="bidirectional").bubble_fraction
    assert costs.bubble_fraction(p, m, schedule="dualpipe") == pytest.approx(float(simulated), rel=1e-12)
    assert costs.bubble_fraction(p, m, schedule="dualpipe") < costs.bubble_fraction(p, m)


@pytest.mark.parametrize("args, kwargs", [((0, 4), {}), ((4, 0), {}), ((4, 4, 0), {}), ((4, 8), {"schedule": "gpipe"}),
                                          ((4, 8, 2), {"schedule": "dualpipe"})])
def test_bubble_refuses_what_no_schedule_runs(args, kwargs):
    with pytest.raises(ValueError):
        costs.bubble_fraction(*args, **kwargs)


def test_only_the_last_microbatchs_backward_hides_the_gradient_reduction():
    # 3 s of computation over m micro-batches: the last one's backward is 2/3 x 3 / m s
    assert costs.dp_exposed_s(1.0, 3.0, 1) == 0.0  # 2 s of backward hide 1 s of reduction
    assert costs.dp_exposed_s(1.0, 3.0, 4) == pytest.approx(0.5)  # 0.5 s of backward hide half of it
    assert costs.dp_exposed_s(0.0, 3.0, 4) == 0.0
    with pytest.raises(ValueError):
        costs.dp_exposed_s(1.0, 3.0, 0)


def test_expert_traffic_of_deepseek_v3_node_limited_fp8_dispatch_bf16_combine():
    """EP 64 over 8 whole nodes, 8 experts a token on at most 4 nodes: 3.5 of the 4 copies leave the node (its own
    node is one of the 8 alike), 1 + 2 bytes an element; 7 of the 8 copies move on over NVLink."""
    got = costs.ep_bytes_per_token(7168, 8, 64, 8, max_nodes=4, dispatch_bytes=1, combine_bytes=2)
    assert got == {"network": pytest.approx(4 * 7 / 8 * 7168 * 3), "nvlink": pytest.approx(8 * 7 / 8 * 7168 * 3)}
    unlimited = costs.ep_bytes_per_token(7168, 8, 64, 8)  # 8 nodes, BF16 both ways
    assert unlimited["network"] == pytest.approx(8 * 7 / 8 * 7168 * 4)


def test_expert_traffic_stays_on_nvlink_inside_a_node_and_off_it_with_one_rank_a_node():
    assert costs.ep_bytes_per_token(100, 2, 8, 8) == {"network": 0.0, "nvlink": pytest.approx(2 * 7 / 8 * 400)}
    spread = costs.ep_bytes_per_token(100, 2, 8, 1)  # each rank of the group in a node of its own
    assert spread == {"network": pytest.approx(2 * 7 / 8 * 400), "nvlink": 0.0}
    assert costs.ep_bytes_per_token(100, 1, 1, 1) == {"network": 0.0, "nvlink": 0.0}
    with pytest.raises(ValueError, match="divide"):
        costs.ep_bytes_per_token(100, 2, 8, 3)


def test_with_interleaved_stages_only_the_last_chunks_reduction_waits():
    # v = 4 chunks on 16 stages: one micro-batch's backward through a chunk is 2/3 x 3 / (4 x 4) = 0.125 s
    assert costs.dp_exposed_s(1.0, 3.0, 4, virtual_stages=4, pp=16) == pytest.approx(0.5 / 4)  # a quarter of v = 1's
    assert costs.dp_exposed_s(1.0, 3.0, 4, virtual_stages=1, pp=16) == costs.dp_exposed_s(1.0, 3.0, 4)
    # a link too slow for the chunks' turns: the reductions queue, (v - 1) p + 1 chunk-backwards hide them
    assert costs.dp_exposed_s(10.0, 3.0, 4, virtual_stages=4, pp=2) == pytest.approx(10.0 - 7 * 0.125)
    with pytest.raises(ValueError):
        costs.dp_exposed_s(1.0, 3.0, 4, virtual_stages=0)

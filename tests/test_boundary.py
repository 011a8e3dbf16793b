"""The trust boundary's requests, without a kernel: how references name what may cross, how a failure becomes
data, and how a learner's own `%%test` cell makes the same requests as the grader (`kernel_side.InProcess`)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cs336_parallel import boundary, checks, plain, testcell
from cs336_parallel.boundary import Exercise, RemoteError
from cs336_parallel.kernel_side import InProcess, KernelSide
from cs336_parallel.testing import collectives


def test_references_name_the_exercise_and_importable_functions_and_resolve_back():
    request = [Exercise("ring", None, "function"), collectives.all_gather_driver, F.mse_loss, torch.optim.SGD,
               functools.partial(collectives.refused, 3), 4]
    wire = boundary.to_wire(request)
    assert wire[:4] == [{"__ref__": "exercise", "name": "ring"},
                        {"__ref__": "import", "module": "cs336_parallel.testing.collectives",
                         "name": "all_gather_driver"},
                        {"__ref__": "import", "module": "torch.nn.functional", "name": "mse_loss"},
                        {"__ref__": "import", "module": "torch.optim.sgd", "name": "SGD"}]
    back = boundary.resolve(plain.decode(plain.encode(wire)), {"ring": "the exercise"})
    assert back[:4] == ["the exercise", collectives.all_gather_driver, F.mse_loss, torch.optim.SGD]
    assert back[4].func is collectives.refused and back[4].args == (3,) and back[5] == 4
    assert boundary.exercises_named(wire) == {"ring"}


def test_code_defined_in_a_test_cannot_cross():
    with pytest.raises(TypeError, match="cannot cross"):
        boundary.to_wire([lambda x: x])


def test_each_rank_is_asked_with_its_own_share_only():
    shares = [(torch.full((2,), float(r)),) for r in range(3)]
    asked = boundary.rank_requests(collectives.all_gather_driver, (Exercise("ring", None, "function"),), {}, shares)
    for rank, request in enumerate(asked):
        tensors = [a for a in request["args"] if isinstance(a, torch.Tensor)]
        assert len(tensors) == 1 and torch.equal(tensors[0], shares[rank][0])


def test_a_failure_becomes_data_with_the_learners_frames_only():
    def answer(n):
        raise ValueError(f"n must be >= 0, got {n}")

    try:
        answer(-1)
    except ValueError as e:
        info = boundary.describe(e, is_cell=lambda filename: filename == __file__)
    error = RemoteError(info)
    assert error.is_a(ValueError) and error.is_a(Exception) and not error.is_a(TypeError)
    assert error.headline == "ValueError: n must be >= 0, got -1"
    assert any("raise ValueError" in line for line in error.frames)


def test_a_reply_of_another_shape_is_refused():
    for reply in ({"ok": 1, "error": {}}, [1], {"value": 1}):
        with pytest.raises(RemoteError, match="not one the test asked for"):
            boundary.unpack(reply)


def test_in_process_requests_behave_as_the_graders():
    def shard(n, rank, world_size):
        if n < 0:
            raise ValueError("n < 0")
        return np.int64(n // world_size * rank), n // world_size * (rank + 1)

    side = InProcess(KernelSide({"shard": shard, "answer": 42}))
    found = side.begin(["shard", "answer", "missing"])
    assert found["shard"]["kind"] == "function" and found["answer"] == {"kind": "value", "value": 42}
    assert found["missing"] == {"kind": "missing"}
    handle = Exercise("shard", side, "function")
    assert handle(8, 1, 4) == (2, 4)
    with checks.using(side):
        assert checks.call_each(handle, [(8, 0, 4), (8, 3, 4)]) == [(0, 2), (6, 8)]
        checks.assert_raises(ValueError, handle, -1, 0, 2)
        checks.assert_each_raises(ValueError, handle, [(-1, 0, 2), (-5, 1, 3)])
        with pytest.raises(AssertionError, match="should raise ValueError"):
            checks.assert_each_raises(ValueError, handle, [(4, 0, 2)])


def test_the_blank_stub_is_reported_as_not_done_yet():
    def stub(*args):
        raise NotImplementedError()

    side = InProcess(KernelSide({"stub": stub}))
    with checks.using(side), pytest.raises(RemoteError) as info:
        checks.assert_raises(ValueError, Exercise("stub", side, "function"), 1)
    assert info.value.unfilled


def test_checks_run_outside_a_test_cell_says_where_it_works():
    with pytest.raises(RuntimeError, match="inside a %%test cell"):
        checks.run(2, print)


class Replies(boundary.Boundary):
    """A boundary whose kernel answers what it is told to."""

    def __init__(self, results):
        self.results = results

    def begin(self, names):
        return {n: {"kind": "function"} for n in names}

    def run(self, world_size, fn, args, kwargs, per_rank, timeout, fresh=False):
        return self.results


@pytest.mark.parametrize("results", [[], [{"x": 1}], [{"x": 1}] * 3, "nothing"])
def test_a_reply_without_exactly_one_result_per_rank_fails_the_test(results):
    source = "\nfor r in checks.run(2, print, f):\n    assert r['x'] == 1, 'x'\n"
    with pytest.raises(testcell.TestFailed, match="results for 2 ranks"):
        testcell.run_test(source, ["f"], boundary=Replies(results), filename="<t>")


def test_a_test_that_compared_nothing_fails():
    with pytest.raises(testcell.TestFailed, match="compared nothing"):
        testcell.run_test("\nfor r in []:\n    assert r, 'r'\n", ["f"], boundary=Replies([]), filename="<t>")
    testcell.run_test("\nassert 1 == 1, 'one'\n", ["f"], boundary=Replies([]), filename="<t>")  # an assert counts

"""The trust boundary's pieces, without a kernel: what counts as plain data, how it travels and is read, how
references name what may cross, and how a failure becomes data."""

from __future__ import annotations

import dataclasses
import functools
import io
import pickle
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cs336_parallel import boundary, checks, planning
from cs336_parallel.boundary import Exercise, InProcess, KernelSide, NotPlainError, RemoteError


class AlwaysEqual(float):
    def __eq__(self, other):
        return True

    __hash__ = float.__hash__


def test_plain_values_cross_as_they_are_and_come_back_equal():
    value = {"n": 3, "ranges": [(0, 2), (2, 4)], 1: torch.arange(4.0), "dtype": torch.bfloat16, "none": None,
             "big": 2**70, "text": "ok", "ratio": Fraction(1, 3), "flag": True, "size": torch.Size([2, 3])}
    back = boundary.round_trip(value)
    assert back.keys() == value.keys() and back["ranges"] == [(0, 2), (2, 4)] and back["ratio"] == Fraction(1, 3)
    assert torch.equal(back[1], value[1]) and back["dtype"] is torch.bfloat16 and back["size"] == (2, 3)


def test_honest_types_become_their_plain_values():
    back = boundary.round_trip([np.int64(7), np.float64(0.5), np.bool_(True), torch.nn.Parameter(torch.ones(2))])
    assert back[:3] == [7, 0.5, True] and [type(v) for v in back[:3]] == [int, float, bool]
    assert type(back[3]) is torch.Tensor and not back[3].requires_grad


def test_a_value_that_claims_to_equal_anything_loses_its_methods():
    back = boundary.round_trip(AlwaysEqual(1.0))
    assert type(back) is float and back != 2.0


@pytest.mark.parametrize("value", [object(), np.zeros(3), {1, 2}, lambda: 0, torch.nn.Linear(2, 2)])
def test_anything_else_is_refused_with_a_reason(value):
    with pytest.raises(NotPlainError, match="plain values"):
        boundary.to_plain(value)


def test_the_packages_dataclasses_are_rebuilt_by_the_receivers_own_classes():
    spec = planning.Precision(param=4)
    encoded = boundary.to_plain(spec)
    assert encoded["__dataclass__"] == "cs336_parallel.planning:Precision"
    assert encoded["fields"] == dataclasses.asdict(spec) and encoded["fields"]["param"] == 4
    assert boundary.decode(boundary.encode(encoded)) == spec


def test_a_tagged_dict_cannot_name_a_class_outside_the_package():
    with pytest.raises(NotPlainError, match="not the package's"):
        boundary.from_plain({"__dataclass__": "os:system", "fields": {}})


def test_reading_a_reply_runs_none_of_the_senders_code():
    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    data = io.BytesIO()
    pickle.dump(Payload(), data, protocol=2)
    with pytest.raises(pickle.UnpicklingError):
        boundary.decode(data.getvalue())


def test_references_name_the_exercise_helpers_and_importable_functions_and_resolve_back():
    def mlp(seed):
        return seed

    request = [Exercise("ring", None, "function"), mlp, F.mse_loss, torch.optim.SGD, functools.partial(mlp, 3), 4]
    wire = boundary.to_wire(request, {id(mlp): "mlp"})
    assert wire[:4] == [{"__ref__": "exercise", "name": "ring"}, {"__ref__": "helper", "name": "mlp"},
                        {"__ref__": "import", "module": "torch.nn.functional", "name": "mse_loss"},
                        {"__ref__": "import", "module": "torch.optim.sgd", "name": "SGD"}]
    back = boundary.resolve(boundary.decode(boundary.encode(wire)), {"ring": "the exercise"}, {"mlp": mlp})
    assert back[:4] == ["the exercise", mlp, F.mse_loss, torch.optim.SGD] and back[4]() == 3 and back[5] == 4


def test_code_defined_in_a_test_cannot_cross():
    with pytest.raises(TypeError, match="cannot cross to the kernel"):
        boundary.to_wire([lambda x: x], {})


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


def test_in_process_requests_behave_as_the_graders():
    def shard(n, rank, world_size):
        if n < 0:
            raise ValueError("n < 0")
        return np.int64(n // world_size * rank), n // world_size * (rank + 1)

    side = InProcess(KernelSide({"shard": shard, "answer": 42}, {}))
    assert side.begin(["shard", "answer", "missing"]) == {
        "shard": {"kind": "function"}, "answer": {"kind": "value", "value": 42}, "missing": {"kind": "missing"}}
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

    side = InProcess(KernelSide({"stub": stub}, {}))
    with checks.using(side), pytest.raises(RemoteError) as info:
        checks.assert_raises(ValueError, Exercise("stub", side, "function"), 1)
    assert info.value.unfilled


def test_checks_run_outside_a_test_cell_says_where_it_works():
    with pytest.raises(RuntimeError, match="inside a %%test cell"):
        checks.run(2, print)

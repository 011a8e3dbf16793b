"""Plain data: what may cross the trust boundary, how it is written without pickle, and how a reader refuses
anything else, within bounds of size and time, importing and running nothing."""

from __future__ import annotations

import io
import json
import struct
import time
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch

from cs336_parallel import plain, planning, schedules
from cs336_parallel.checkpoint import Shard
from cs336_parallel.plain import NotPlainError


class AlwaysEqual(float):
    def __eq__(self, other):
        return True

    __hash__ = float.__hash__


def test_plain_values_cross_as_they_are_and_come_back_equal():
    value = {"n": 3, "ranges": [(0, 2), (2, 4)], 1: torch.arange(4.0), "dtype": torch.bfloat16, "none": None,
             "big": 2**70, "text": "ok", "ratio": Fraction(1, 3), "flag": True, "size": torch.Size([2, 3]),
             (1, "a"): b"\x00\xff", "inf": float("-inf"), "z": 1 - 2j, "scalar": torch.tensor(2.5),
             "empty": torch.zeros(0, 3, dtype=torch.int64), "half": torch.ones(3, dtype=torch.bfloat16)}
    back = plain.round_trip(value)
    assert back.keys() == value.keys() and back["ranges"] == [(0, 2), (2, 4)] and back["ratio"] == Fraction(1, 3)
    assert torch.equal(back[1], value[1]) and back["dtype"] is torch.bfloat16 and back["size"] == (2, 3)
    assert back[1, "a"] == b"\x00\xff" and back["inf"] == float("-inf") and back["z"] == 1 - 2j
    assert back["scalar"].shape == () and back["empty"].shape == (0, 3) and back["half"].dtype == torch.bfloat16


def test_every_honest_kind_of_number_becomes_an_exact_python_number():
    back = plain.round_trip([np.int64(7), np.float64(0.5), np.bool_(True), Decimal("0.1"), Fraction(4097, 1),
                             torch.nn.Parameter(torch.ones(2))])
    assert back[:5] == [7, 0.5, True, Fraction(1, 10), 4097]
    assert [type(v) for v in back[:5]] == [int, float, bool, Fraction, Fraction]
    assert type(back[5]) is torch.Tensor and not back[5].requires_grad


def test_a_value_that_claims_to_equal_anything_loses_its_methods():
    back = plain.round_trip(AlwaysEqual(1.0))
    assert type(back) is float and back != 2.0


@pytest.mark.parametrize("value", [object(), np.zeros(3), {1, 2}, lambda: 0, torch.nn.Linear(2, 2)])
def test_anything_else_is_refused_with_a_reason(value):
    with pytest.raises(NotPlainError, match="plain values"):
        plain.to_plain(value)


def test_the_records_on_the_list_are_rebuilt_from_their_fields():
    layout = planning.Layout(dp=2, tp=4, precision=planning.Precision(param=4))
    action = schedules.Action("F", 3, 1)
    shard = Shard(torch.arange(3.0), (2, 3))
    back = plain.round_trip([layout, action, shard, tuple(action)])
    assert back[0] == layout and back[1] == action and type(back[1]) is schedules.Action
    assert type(back[2]) is Shard and torch.equal(back[2].local, shard.local)
    assert type(back[3]) is tuple  # a plain tuple where an Action was asked for stays a tuple


def _encoded(tree, blob: bytes = b"") -> bytes:
    header = json.dumps(tree).encode()
    return plain.MAGIC + struct.pack("<Q", len(header)) + header + blob


@pytest.mark.parametrize("tree", [
    {"t": "record", "type": "RankProcess", "v": {}},  # not on the list
    {"t": "record", "type": "Layout", "v": {"dp": 0}},  # on the list, but its constructor refuses it
    {"t": "import", "v": "os:system"},
    {"__dataclass__": "cs336_parallel.in_rank_server:main", "fields": {}},  # the old format names modules
    {"t": "tensor", "dtype": "float32", "shape": [4], "nbytes": 16},  # no bytes behind it
    {"t": "tensor", "dtype": "object", "shape": [1], "nbytes": 8},
    {"t": "fraction", "v": ["1", "0"]},
])
def test_a_reply_cannot_name_a_type_or_module_of_its_choosing(tree):
    with pytest.raises(NotPlainError):
        plain.decode(_encoded(tree))


def test_reading_pickle_is_refused_without_running_it():
    import pickle

    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    with pytest.raises(NotPlainError, match="not an encoded plain value"):
        plain.decode(pickle.dumps(Payload()))


def test_size_is_bounded_before_anything_is_read():
    data = plain.encode(torch.zeros(2**20))  # 4 MiB
    with pytest.raises(NotPlainError, match="more than"):
        plain.decode(data, max_bytes=2**20)
    stream = io.BytesIO()
    plain.write_message(stream, torch.zeros(2**20))
    stream.seek(0)
    with pytest.raises(NotPlainError, match="more than"):
        plain.read_message(stream, max_bytes=2**20)
    assert stream.tell() == 8  # only the length was read


def test_decoding_takes_time_in_proportion_to_size_and_deep_nesting_is_refused():
    nested = "[" * 100_000 + "]" * 100_000
    data = plain.MAGIC + struct.pack("<Q", len(nested)) + nested.encode()
    with pytest.raises(NotPlainError):
        plain.decode(data)
    wide = plain.encode([[i, str(i), (i,)] for i in range(200_000)])  # about 5 MB of small values
    start = time.process_time()
    plain.decode(wide)
    assert time.process_time() - start < 5.0  # linear: well under a second on a laptop

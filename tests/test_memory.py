"""cs336_parallel.memory: the tracker counts exactly the tensor bytes a block allocates, on the CPU as on a
GPU, and the formulas say what the ZeRO paper says."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from common import PATIENCE_S, ROOT
from cs336_parallel import memory, session_cluster

F32 = 4


def test_peak_start_and_end_count_the_tensors_a_block_allocates():
    with memory.track("cpu") as mem:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.empty(500, dtype=torch.float64)  # 4000 bytes: the peak, 8000, is here
        del a
        c = torch.ones(250)  # 1000 bytes
    assert mem.peak_bytes - mem.start_bytes == 8000
    assert mem.end_bytes - mem.start_bytes == 5000
    del b, c


def test_reset_peak_forgets_what_came_before():
    with memory.track("cpu") as mem:
        a = torch.empty(1000)
        del a
        mem.reset_peak()
        b = torch.empty(10)
    assert mem.peak_bytes - mem.start_bytes == 40
    del b


def test_tensors_alive_before_the_block_count_in_start_and_leave_when_freed():
    x = torch.empty(10_000)
    with memory.track("cpu") as mem:
        view = x.view(100, 100)[::2]  # a view: no new storage
        del x, view
        y = torch.empty(10)
    assert mem.peak_bytes == mem.start_bytes  # nothing grew
    assert mem.start_bytes - mem.end_bytes == 40_000 - 40
    del y


def test_gradients_created_by_backward_are_counted_and_existing_ones_found():
    w = torch.nn.Parameter(torch.ones(1000))
    with memory.track("cpu") as mem:
        loss = (w * 2).sum()  # w * 2 lives until sum has read it
        loss.backward()
    assert mem.end_bytes - mem.start_bytes == 1000 * F32 + F32  # w.grad and the scalar loss
    # w * 2 is freed once summed; the peak is in backward: w.grad, the loss and its seed gradient (ones)
    assert mem.peak_bytes - mem.start_bytes == 1000 * F32 + 2 * F32
    with memory.track("cpu") as again:  # w.grad lives only in C++: the tracker finds it through w
        w.grad = None
    assert again.start_bytes - again.end_bytes == 1000 * F32


def test_storage_resize_is_seen_as_fsdp_frees_and_refills_parameters():
    t = torch.empty(1000)
    with memory.track("cpu") as mem:
        t.untyped_storage().resize_(0)
        after_free = mem.current_bytes
        t.untyped_storage().resize_(4 * 1000)
        torch.empty(500)  # freed at once
    assert mem.start_bytes - after_free == 4000
    assert mem.peak_bytes - mem.start_bytes == 2000  # the refilled storage was already counted at the start
    assert torch.UntypedStorage.resize_ is memory._original_resize  # unwrapped after the block


def test_without_counting_what_existed_the_count_starts_at_zero_and_sees_only_the_block():
    before = torch.empty(10_000)
    with memory.track("cpu", count_existing=False) as mem:
        a = torch.empty(1000)  # 4000 bytes
        del a
        b = torch.ones(500)  # 2000 bytes
        del before  # made before the block and never touched in it: not counted, not subtracted
    assert (mem.start_bytes, mem.peak_bytes, mem.end_bytes) == (0, 4000, 2000)
    del b


def test_other_devices_and_nested_trackers():
    with memory.track("cpu") as outer:
        torch.empty(10**9, device="meta")  # no memory on the CPU
        with memory.track("cpu") as inner:
            z = torch.empty(256)
        del z
    assert outer.peak_bytes - outer.start_bytes == 1024 and inner.peak_bytes - inner.start_bytes == 1024
    assert outer.end_bytes == outer.start_bytes


def test_live_tensor_bytes_and_tensor_bytes():
    before = memory.live_tensor_bytes("cpu")
    x = torch.empty(12_345, dtype=torch.uint8)
    assert memory.live_tensor_bytes("cpu") - before == 12_345
    assert memory.tensor_bytes([x, x[:10], None, torch.empty(3)]) == 12_345 + 12
    model = torch.nn.Linear(10, 20)
    assert memory.tensor_bytes(model.parameters()) == (10 * 20 + 20) * F32


def _all_gather_peak(numel: int) -> tuple[int, int]:
    mine = torch.ones(numel)
    with memory.track() as mem:
        out = torch.empty(dist.get_world_size() * numel)
        dist.all_gather_single(out, mine)
        del out
        # gloo's thread lets go of a finished work (and the tensors it holds) a little later
        deadline = time.monotonic() + PATIENCE_S
        while mem.current_bytes != mem.start_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
    return mem.peak_bytes - mem.start_bytes, mem.end_bytes - mem.start_bytes


def test_each_rank_measures_its_own_memory():
    assert session_cluster(2, backend="gloo").run(_all_gather_peak, 1000) == [(2 * 1000 * F32, 0)] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU, and PyTorch sees none here")
def test_on_a_gpu_the_allocator_statistics_are_read():
    dev = torch.device("cuda", 0)
    with memory.track(dev) as mem:
        a = torch.empty(2**20, device=dev)
        del a
        b = torch.empty(2**19, device=dev)
    assert mem.peak_bytes - mem.start_bytes == 4 * 2**20  # sizes that the caching allocator does not round
    assert mem.end_bytes - mem.start_bytes == 2 * 2**20
    del b


def test_memory_imports_with_torch_and_cloudpickle_alone():
    blocked = "import sys\nfor m in ('matplotlib', 'ipywidgets', 'IPython', 'tqdm'): sys.modules[m] = None\n"
    done = subprocess.run([sys.executable, "-c", blocked + "import cs336_parallel.memory, cs336_parallel.trace"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_an_fsdp_units_life_holds_its_shard_the_whole_parameters_while_needed_then_two_shards():
    import matplotlib

    matplotlib.use("Agg")
    from cs336_parallel import viz

    fig = viz.fsdp_unit_life(world_size=4)
    held = fig.axes[1].patches[0].get_data().values  # in the unit's parameter bytes, phase by phase
    n = 4
    shard, whole, gradient = 1 / n, 1, 1  # gradient: the unit's whole gradient, as big as its parameters
    expected = [shard, shard + whole, shard + whole, shard,  # gather, forward, free
                shard + whole, shard + whole + gradient,  # gather again, backward
                shard + gradient + shard,  # reduce-scatter: the whole parameters are already freed (PyTorch's FSDP too)
                shard + shard]  # parameter and gradient shards
    assert list(held) == pytest.approx(expected)
    assert fig.axes[1].get_ylabel() and fig.axes[1].get_xlabel() == "time (schematic)"

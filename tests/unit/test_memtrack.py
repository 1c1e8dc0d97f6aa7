"""MemTracker counts live tensor bytes exactly: storages once, frees, resizes, autograd.

All sizes are float32 (4 bytes an element) unless said otherwise.
"""

import pytest
import torch
import torch.nn as nn

from shardkit.dtensor.storage import alloc_storage, free_storage
from shardkit.memtrack import MemTracker


def test_views_count_their_storage_once_until_the_last_view_dies():
    with MemTracker() as tracker:
        base = torch.empty(100)  # 400 B
        view = base[10:20].view(2, 5)
        alias = base.detach()
        assert tracker.current_bytes == 400
        del base, alias
        assert tracker.current_bytes == 400  # the view keeps the storage alive
        del view
        assert tracker.current_bytes == 0
    assert tracker.peak_bytes == 400


def test_storage_resize_outside_the_dispatcher_is_seen_at_once():
    # shardkit frees and refills the unsharded parameters with UntypedStorage.resize_, which
    # is not an aten op: the peak must still see the refilled bytes before the next op.
    with MemTracker() as tracker:
        flat = torch.empty(64)  # 256 B
        free_storage(flat)
        assert tracker.current_bytes == 0
        alloc_storage(flat)
        assert tracker.current_bytes == 256
        flat.untyped_storage().resize_(1024)
        assert tracker.current_bytes == 1024
        free_storage(flat)
        assert tracker.current_bytes == 0
    assert tracker.peak_bytes == 1024


def test_tensor_resize_through_the_dispatcher_is_seen():
    with MemTracker() as tracker:
        t = torch.empty(10)  # 40 B
        t.resize_(30)  # aten.resize_ grows the storage to 120 B
        assert tracker.current_bytes == 120
        t.set_(torch.empty(5))  # the old storage dies, the new one (20 B) is counted
        assert tracker.current_bytes == 20


def test_resize_of_a_storage_allocated_before_the_tracker_starts_counting_it():
    flat = torch.empty(16)
    free_storage(flat)  # like an unsharded parameter between steps
    with MemTracker() as tracker:
        alloc_storage(flat)
        assert tracker.current_bytes == 64


def test_tensors_alive_at_entry_count_when_tracked_or_used():
    kept, used, ignored = torch.empty(10), torch.empty(20), torch.empty(30)
    tracker = MemTracker().track(kept, category="input")
    with tracker:
        assert tracker.current_bytes == 40
        used.add_(1)  # an op's input is alive: counted from here on
        assert tracker.current_bytes == 40 + 80
        assert tracker.by_category() == {"input": 40, "other": 80}
    del ignored


def test_module_and_optimizer_state_are_tracked_by_category():
    lin = nn.Linear(8, 4)  # weight 128 B, bias 16 B
    optimizer = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(2, 8)).sum().backward()
    optimizer.step()  # exp_avg, exp_avg_sq like each parameter, plus a 4 B step each
    tracker = MemTracker().track(lin, optimizer)
    assert tracker.by_category() == {"parameter": 144, "gradient": 144, "optimizer_state": 2 * 144 + 2 * 4}


def test_exit_restores_untyped_storage_resize():
    original = torch.UntypedStorage.resize_
    with MemTracker():
        assert torch.UntypedStorage.resize_ is not original
    assert torch.UntypedStorage.resize_ is original


def test_mark_records_the_peak_of_each_interval():
    with MemTracker() as tracker:
        tracker.mark("start")
        a = torch.empty(100)  # 400 B
        del a
        first = tracker.mark("first")
        b = torch.empty(50)  # 200 B
        second = tracker.mark("second")
        del b
    assert (first.peak_bytes, first.current_bytes) == (400, 0)
    assert (second.peak_bytes, second.current_bytes) == (200, 200)
    assert tracker.phase_peak("first") == 400
    assert tracker.peak_bytes == 400
    with pytest.raises(KeyError, match="no mark named 'third'"):
        tracker.phase_peak("third")


def test_linear_relu_forward_and_backward_bytes_by_hand():
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)  # parameters: 128 + 16 = 144 B
    x = torch.randn(2, 8)  # 64 B, no grad
    tracker = MemTracker().track(lin).track(x, category="input")
    with tracker:
        tracker.mark("start")
        loss = torch.relu(lin(x)).sum()
        forward = tracker.mark("forward")
        loss.backward()
        backward = tracker.mark("backward")
    # Forward: addmm's output y (2, 4) = 32 B and relu's r = 32 B are both alive at relu; y
    # dies after it (relu saves its output, and addmm saves x and the weight, which we hold).
    # What stays: r (the one saved activation) and the loss (4 B).
    assert forward.peak_bytes == 144 + 64 + 32 + 32
    assert forward.current_bytes == 144 + 64 + 32 + 4
    assert forward.current_by_category == {"parameter": 144, "input": 64, "other": 32 + 4}
    # Backward: the seed gradient ones_like(loss) (4 B) lives to the end; relu's backward
    # makes its grad (32 B) and frees r; addmm's backward then makes the weight grad (mm,
    # 128 B) and the bias grad (sum, 16 B) while relu's grad is still alive: the peak.
    assert backward.peak_bytes == 144 + 64 + 4 + 4 + 32 + 128 + 16
    # After: parameters, their grads (accumulated without a copy), x and the loss.
    assert backward.current_bytes == 144 + 144 + 64 + 4
    assert lin.weight.grad is not None and lin.bias.grad is not None


def test_default_category_labels_new_storages():
    with MemTracker() as tracker:
        tracker.default_category = "forward"
        a = torch.empty(10)
        tracker.default_category = "backward"
        b = torch.empty(20)
        assert tracker.by_category() == {"forward": 40, "backward": 80}
        tracker.track(a, category="kept")  # relabel
        assert tracker.by_category() == {"kept": 40, "backward": 80}
    assert [s.nbytes for s in tracker.live_storages()] == [80, 40]


def test_device_filter_skips_other_devices():
    with MemTracker(device="cuda") as tracker:
        torch.empty(10)
        t = torch.empty(4)
        t.untyped_storage().resize_(100)
        assert tracker.current_bytes == 0


def test_meta_tensors_cost_nothing():
    with MemTracker() as tracker:
        t = torch.empty(1000, device="meta")
        t.add_(1)
        assert tracker.current_bytes == 0

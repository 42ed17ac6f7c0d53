"""The storage-counting memory tracker against hand-counted bytes."""

from __future__ import annotations

import torch

from autopar.runtime.memory_stats import track_memory


def test_peak_is_the_largest_sum_of_live_storages():
    w = torch.ones(64, 64)  # 16 KiB, alive throughout
    x = torch.ones(32, 64)  # 8 KiB
    with track_memory({"parameters": [w], "activations": [x]}) as tracker:
        h = x @ w  # +8 KiB  (32 KiB live)
        g = torch.relu(h)  # +8 KiB  (40 KiB live: the peak)
        del h  # -8 KiB
        s = g.sum()  # +4 B
        del g
    stats = tracker.stats
    assert stats is not None
    assert stats.peak_bytes == 16384 + 8192 + 8192 + 8192
    assert stats.breakdown["parameters"] == 16384
    assert stats.breakdown["activations"] == 8192 * 3
    assert s.item() > 0


def test_views_share_their_storage_and_frees_are_seen():
    w = torch.ones(1024)  # 4 KiB
    with track_memory({"parameters": [w]}) as tracker:
        for _ in range(5):  # each iteration's temporaries die before the next one
            t = w * 2  # 4 KiB
            v = t.view(32, 32)  # a view: no new storage
            del t, v
    stats = tracker.stats
    assert stats is not None
    assert stats.peak_bytes == 4096 * 2
    # a freed storage's Python id is reused by the next one: the peak's breakdown still
    # counts the storage alive at the peak
    assert stats.breakdown["activations"] == 4096 and stats.breakdown["parameters"] == 4096


def test_gradients_are_named_after_the_step():
    w = torch.ones(256, requires_grad=True)  # 1 KiB
    with track_memory({"parameters": [w]}) as tracker:
        loss = (w * w).sum()
        (grad,) = torch.autograd.grad(loss, [w])
        tracker.gradients([grad])
    stats = tracker.stats
    assert stats is not None
    assert stats.breakdown["gradients"] == 1024
    assert stats.breakdown["parameters"] == 1024


def test_recategorize_charges_a_storage_made_during_the_step():
    w = torch.ones(256)  # 1 KiB
    with track_memory({"parameters": [w]}) as tracker:
        state = torch.zeros_like(w)  # e.g. an optimizer state created by the first step
        tracker.recategorize([state], "optimizer_state")
    stats = tracker.stats
    assert stats is not None
    assert stats.breakdown["optimizer_state"] == 1024 and stats.breakdown["activations"] == 0


def test_a_collective_output_is_held_by_the_program_alone():
    """The backend's work holds a functional collective's output until it is waited for and
    its worker thread lets go; under tracking the output comes back held by nothing else,
    so it is freed (and seen freed) exactly when the program drops it."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD.group_name
        x = torch.ones(4096)  # 16 KiB
        with track_memory({"activations": [x]}) as tracker:
            for _ in range(20):
                out = torch.ops._c10d_functional.all_reduce(x, "sum", group)
                assert out._use_count() == 1
                out = torch.ops._c10d_functional.wait_tensor(out)
                del out
        assert tracker.stats is not None
        assert tracker.stats.peak_bytes == 2 * 16384
    finally:
        if owned:
            dist.destroy_process_group()

"""The transport's buffer pool: a buffer is handed out again only once nothing views it."""

from __future__ import annotations

import torch

from smp_fx.runtime.buffers import BufferPool


def test_buffer_is_reused_only_when_no_view_is_alive() -> None:
    pool = BufferPool(torch.device("cpu"))
    assert pool.reuse  # this torch exposes storage use counts
    a = pool.take(256)
    view = a[64:128].view(torch.float32)
    view.fill_(7.0)
    pool.give(a)
    b = pool.take(256)
    assert b.data_ptr() != a.data_ptr()  # ``view`` still reads a: a new buffer
    assert torch.equal(view, torch.full((16,), 7.0))
    del view
    c = pool.take(256)
    assert c.data_ptr() == a.data_ptr()  # the view is gone: a is handed out again
    assert pool.take(128).numel() == 128  # another size: a new one


def test_kept_buffers_are_bounded() -> None:
    pool = BufferPool(torch.device("cpu"))
    held = [pool.take(8) for _ in range(100)]
    views = [h[:4] for h in held]  # all still viewed
    for h in held:
        pool.give(h)
    assert len(pool._kept[8]) == 64
    assert len(views) == 100

"""The transport's buffer pool: a buffer is handed out again only once nothing views it."""

from __future__ import annotations

import torch

from smp_fx.runtime.transport.buffers import BufferPool


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


def test_kept_buffers_are_bounded_and_viewed_ones_stay_out() -> None:
    """Of 100 buffers given back, the newest 64 are kept; a kept one comes out again only
    once no tensor views it, so while some views live, only the others are handed out."""
    pool = BufferPool(torch.device("cpu"))
    held = [pool.take(8) for _ in range(100)]
    ptrs = [h.data_ptr() for h in held]
    views = [h[:4] for h in held]
    for h in held:
        pool.give(h)
    del held, h  # from here only the views (and the pool) hold the buffers
    assert len(pool._kept[8, torch.uint8]) == 64
    # every view is alive (so no address of ours is free): a new buffer, the pool untouched
    assert pool.take(8).data_ptr() not in ptrs and len(pool._kept[8, torch.uint8]) == 64
    freed = range(37, 100, 2)  # every other kept buffer loses its view
    for i in freed:
        views[i] = None
    out = [pool.take(8) for _ in freed]
    assert sorted(t.data_ptr() for t in out) == sorted(ptrs[i] for i in freed)
    assert len(pool._kept[8, torch.uint8]) == 64 - len(freed)
    # the rest are still viewed: the next one is new again
    assert pool.take(8).data_ptr() not in ptrs

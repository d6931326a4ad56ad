"""Ranks played by threads, for code whose only collective is an ``all_gather_object``
(the checkpoint commit protocol): fast, in one process, and able to make one rank fail at
a chosen point, which real processes cannot do as cheaply."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class ThreadGroup:
    """An all_gather_object for ranks played by threads (bounded waits)."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=20)
        self.slots: list[Any] = [None] * n

    def gather_for(self, rank: int) -> Callable[[Any], list[Any]]:
        def gather(value: Any) -> list[Any]:
            self.slots[rank] = value
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out
        return gather


def run_thread_ranks(n: int, fn: Callable[[int, Callable[[Any], list[Any]]], None],
                     wrap: dict[int, Callable[[Callable], Callable]] | None = None
                     ) -> list[Any]:
    """Run ``fn(rank, gather)`` on ``n`` threads sharing one ``ThreadGroup``; ``wrap``
    replaces a rank's gather (to make it fail). Returns each rank's exception, or None."""
    group = ThreadGroup(n)
    errors: list[Any] = [None] * n

    def body(rank: int) -> None:
        gather = group.gather_for(rank)
        if wrap and rank in wrap:
            gather = wrap[rank](gather)
        try:
            fn(rank, gather)
        except BaseException as exc:  # collected and checked by the test
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    return errors

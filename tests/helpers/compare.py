"""Name the tensors that differ, so a failing check says what differed.

A multi-process test body runs in another process and can only report back a value; a
bare ``True``/``False`` tells the test that something differed but not what. These return
the *names* of the tensors that differ (empty when all agree); the test asserts the list is
empty, and a failure prints it:

    >>> import torch
    >>> got = {"a.weight": torch.ones(2), "a.bias": torch.zeros(2), "b.weight": None}
    >>> want = {"a.weight": torch.ones(2), "a.bias": torch.ones(2), "b.weight": None,
    ...         "c.weight": torch.ones(1)}
    >>> mismatched(got, want)
    ['a.bias']
    >>> mismatched({"a.bias": torch.zeros(2)}, want, atol=1.0)
    []

Nothing to compare is an error, not agreement (an empty stage or a filter that dropped
every name would otherwise pass):

    >>> mismatched({}, want)
    Traceback (most recent call last):
    ...
    ValueError: nothing to compare: got holds no tensors
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def mismatched(got: Mapping[str, torch.Tensor | None], want: Mapping[str, torch.Tensor | None],
               *, atol: float = 0.0, rtol: float = 0.0) -> list[str]:
    """Names of ``got`` whose tensor differs from ``want``'s (``torch.testing.assert_close``
    with these tolerances, exact by default; shape, dtype and device count too).

    Only ``got``'s names are checked, so ``want`` may hold more (one stage's parameters
    against the whole model's). A name ``want`` lacks, or ``None`` on one side only
    (a gradient that exists on one side), is a mismatch; ``None`` on both sides is not.
    An empty ``got`` raises ``ValueError``: a check of nothing cannot pass.
    """
    if not got:
        raise ValueError("nothing to compare: got holds no tensors")
    bad = []
    for name, a in got.items():
        b = want.get(name)
        if a is None or b is None:
            if a is not None or b is not None or name not in want:
                bad.append(name)
            continue
        try:
            torch.testing.assert_close(a.detach(), b.detach(), atol=atol, rtol=rtol)
        except AssertionError:
            bad.append(name)
    return bad


def state_dict_mismatches(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor],
                          *, atol: float = 0.0, rtol: float = 0.0) -> list[str]:
    """What differs between two full ``state_dict()``s: the names and their order (a line
    naming up to 4 names on one side only), then each tensor (``mismatched``)."""
    bad = []
    if list(got) != list(want):
        bad.append(f"state_dict keys {sorted(set(got) ^ set(want))[:4]}")
    return bad + [f"state_dict {n}" for n in mismatched(got, want, atol=atol, rtol=rtol)]


def optimizer_state_mismatches(got: Mapping[str, Any], want: Mapping[str, Any], *,
                               atol: float = 0.0, rtol: float = 0.0) -> list[str]:
    """What differs between two full optimizer ``state_dict()``s: the param groups, the
    parameters holding state, then each state tensor (``mismatched``, named ``id.key``)."""
    if got["param_groups"] != want["param_groups"]:
        return ["param_groups"]
    if set(got["state"]) != set(want["state"]):
        return [f"state of parameters {sorted(set(got['state']) ^ set(want['state']))[:4]}"]

    def flat(sd: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return {f"{i}.{k}": v for i, entry in sd["state"].items() for k, v in entry.items()}

    return [f"optimizer {n}" for n in mismatched(flat(got), flat(want), atol=atol, rtol=rtol)]


def mismatched_across(named: Mapping[str, torch.Tensor], group: Any = None) -> list[str]:
    """Names whose tensor is not bitwise equal on every rank of the process ``group``
    (the world by default): e.g. a stage's parameters across its data-parallel replicas.

    A collective: every rank of ``group`` calls it with the same names (in any order).
    An empty ``named`` raises ``ValueError``, as in ``mismatched``.
    """
    import torch.distributed as dist

    if not named:
        raise ValueError("nothing to compare: named holds no tensors")

    bad = []
    for name in sorted(named):
        mine = named[name].detach().contiguous()
        peers = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(peers, mine, group=group)
        if not all(torch.equal(q, mine) for q in peers):
            bad.append(name)
    return bad


class Checks:
    """Named checks a multi-process body makes; it returns ``report()``, the number made
    and the names of those that failed, so the test says which check failed on which rank.

    >>> c = Checks()
    >>> c.expect(1 + 1 == 2, "sum"); c.expect([] == [0], "empty list")
    >>> c.report()
    (2, ['empty list'])
    """

    def __init__(self) -> None:
        self.count = 0
        self.failed: list[str] = []

    def expect(self, ok: bool, name: str) -> None:
        self.count += 1
        if not ok:
            self.failed.append(name)

    def report(self) -> tuple[int, list[str]]:
        return self.count, self.failed

"""Tell an error a rule predicts from a crash that merely looks like an ``SMPError``.

A fuzzer that accepts any ``SMPError`` accepts smp-fx's own bugs too: the pass runner
turns any exception inside a compiler pass into ``SMPPassError`` (keeping it as
``__cause__``), and ``SMPInternalError`` (a broken invariant) is an ``SMPError`` as well.
``assert_refusal`` accepts only the class and message the rule predicts, raised on purpose:
not a pass's contract error, not an internal error, not a conversion of a foreign exception.

    >>> from cost_model.errors import SMPPartitionError, SMPPassError
    >>> assert_refusal(SMPPartitionError("stages must form a pipeline"), SMPPartitionError,
    ...                "form a pipeline")
    >>> crash = SMPPassError("pass 'auto_partition' failed")
    >>> crash.__cause__ = IndexError("list index out of range")
    >>> assert_refusal(crash, SMPPartitionError, "form a pipeline")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    AssertionError: a crash, ...: SMPPassError: ... (caused by IndexError: ...)
"""

from __future__ import annotations

import re

from cost_model.errors import SMPError, SMPInternalError, SMPPassError


def assert_refusal(exc: BaseException, kind: type[SMPError], match: str) -> None:
    """``exc`` is the refusal a rule predicts: an instance of ``kind`` whose text matches
    ``match`` (a regular expression), raised as such (its ``__cause__``, if any, an
    ``SMPError`` too), and neither an ``SMPPassError`` nor an ``SMPInternalError``."""
    cause = exc.__cause__
    crashed = isinstance(exc, (SMPPassError, SMPInternalError)) or (
        cause is not None and not isinstance(cause, SMPError))
    if crashed or not isinstance(exc, kind):
        why = f" (caused by {type(cause).__name__}: {cause})" if cause is not None else ""
        raise AssertionError(f"{'a crash' if crashed else 'another error'}, not a refusal "
                             f"the rules predict: {type(exc).__name__}: {exc}{why}")
    if not re.search(match, str(exc)):
        raise AssertionError(f"{type(exc).__name__} without {match!r}: {exc}")

"""The smp-fx error hierarchy.

It lives in the lowest layer so every layer can raise it without an upward import;
``smp_fx`` re-exports it and each class names ``smp_fx`` as its module. Failures of the
user's job get the area's class, a broken invariant ``SMPInternalError``. A message states
the rule, the value, the place and the fix (``SMPError.build``).
"""

from __future__ import annotations

from typing import TypeVar

_E = TypeVar("_E", bound="SMPError")


class SMPError(Exception):
    """Base class of every error smp-fx raises on purpose."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.__module__ = "smp_fx"

    @classmethod
    def build(cls: type[_E], rule: str, value: object = None, where: str | None = None,
              fix: str | None = None) -> _E:
        """Make an error whose text reads: rule (got value) [at where]. Fix: fix."""
        parts = [rule]
        if value is not None:
            parts.append(f"(got {value!r})")
        if where:
            parts.append(f"at {where}")
        text = " ".join(parts)
        if fix:
            text += f". Fix: {fix}"
        return cls(text)


class SMPConfigError(SMPError, ValueError):
    """Invalid configuration; raised by ``smp.init`` on every rank before any collective."""


class SMPNotImplementedError(SMPError, NotImplementedError):
    """A known SMP parameter or API whose feature smp-fx does not implement yet."""


class SMPTracingError(SMPError):
    """A model, or a part of it, cannot be captured as a graph."""


class SMPPartitionError(SMPError):
    """No valid partition exists for the graph, costs and configuration given."""


class SMPRuntimeError(SMPError, RuntimeError):
    """Misuse of the runtime API (calls outside ``smp.step``, bad batch, ...) or its failure.

    ``peer_rank``: the rank this failure points at (a peer that died or did not answer),
    when there is one; ``smp-fx run`` follows it to the rank that failed first."""

    peer_rank: int | None = None


class SMPTimeoutError(SMPRuntimeError, TimeoutError):
    """A blocking wait ran past its timeout; the message names what it waited for."""


class SMPPeerError(SMPRuntimeError, ConnectionError):
    """A peer rank's process is gone (its connection closed or reset): it died or exited.
    The message names that rank and stage, and what this rank was doing."""


class SMPOrderError(SMPRuntimeError):
    """Under ``SMP_FX_CHECK_ORDER=1``: the ranks of a process group issued different
    collectives, or a pair different sends and receives, in one step; NCCL would hang."""


class SMPCheckpointError(SMPError):
    """A checkpoint cannot be saved or loaded as asked."""


class ScheduleError(SMPConfigError):
    """A pipeline schedule is malformed, incomplete or would deadlock."""


class SMPPassError(SMPError):
    """A compiler pass failed or broke its contract; the message names it and the passes
    before it."""


class SMPInternalError(SMPError, AssertionError):
    """An invariant of smp-fx itself does not hold: a bug in smp-fx, not misuse."""

    @classmethod
    def build(cls: type[_E], rule: str, value: object = None, where: str | None = None,
              fix: str | None = "report this as an smp-fx bug") -> _E:
        return super().build(rule, value, where, fix)


SMPError.__module__ = "smp_fx"


def not_implemented(feature: str, parameter: str | None = None,
                    fix: str | None = None) -> SMPNotImplementedError:
    """The one way to say 'known, but not built yet'; never silently ignore a parameter."""
    what = f"'{parameter}' ({feature})" if parameter else feature
    return SMPNotImplementedError(
        f"{what} is not implemented in smp-fx yet. "
        + (fix or "Remove the setting or use its default; see README 'Not supported yet'.")
    )


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """What a log line or a command's error quotes of an exception: its message's first
    line (at most ``limit`` characters), or its type's name when it says nothing. A
    traceback's worth of text (torch.export's, transformers') stays in the exception."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__


def one_line(exc: BaseException, limit: int | None = 300) -> str:
    """An exception in one line for a log that names what failed: its type, then its
    message's first line (``first_line``)."""
    said = first_line(exc, limit)
    name = type(exc).__name__
    return name if said == name else f"{name}: {said}"

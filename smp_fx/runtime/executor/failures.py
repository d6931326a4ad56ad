"""What a failed wait on a peer rank means, told in words: the peer is gone, or it is silent.

See docs/runtime.md, 'When a step fails'.

>>> err = wait_failed(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1"),
...                   "stage 1 (rank 1)", 1, True, 20.0, "rank 0 (stage 0)")
>>> type(err).__name__, err.peer_rank
('SMPPeerError', 1)
"""

from __future__ import annotations

from cost_model.errors import SMPPeerError, SMPRuntimeError, SMPTimeoutError

# Lower-case fragments of backend errors that mean the peer's process is gone.
LOST_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe",
                "connection refused", "remote process exited", "socket closed",
                "econnreset", "epipe")
TIMEOUT_MARKERS = ("timed out", "timeout")


def classify(text: str) -> str:
    """``"lost"`` (the peer's process is gone), ``"timeout"`` or ``"other"``."""
    low = text.lower()
    if any(m in low for m in LOST_MARKERS):
        return "lost"
    if any(m in low for m in TIMEOUT_MARKERS):
        return "timeout"
    return "other"


def backend_words(exc: BaseException) -> str | None:
    """The backend's message without its source location (``[pair.cc:553] ...``)."""
    text = str(exc).strip()
    if not text:
        return None
    first = text.splitlines()[0]
    if first.startswith("[") and "] " in first:
        first = first.split("] ", 1)[1]
    return first.split(". This is typically")[0]


def wait_failed(exc: BaseException, peer: str, peer_rank: int, receiving: bool,
                timeout_s: float, where: str) -> SMPRuntimeError:
    """The error for a transfer with ``peer`` (``stage 1 (rank 1)``) that failed with
    ``exc``; ``where``: this rank and what it was doing."""
    kind = classify(str(exc))
    got = backend_words(exc)
    err: SMPRuntimeError
    if kind == "lost":
        err = SMPPeerError.build(
            f"lost the connection to {peer}: its process died or exited", got, where,
            f"rank {peer_rank} failed first and its log says why (an error, a kill, running "
            "out of memory); this rank stopped because of it")
    elif kind == "timeout":
        silent = "sent nothing" if receiving else "took no message"
        err = SMPTimeoutError.build(
            f"{peer} {silent} for {timeout_s:g} s", got, where,
            f"rank {peer_rank} is stuck or far behind: its flight record (in its log, and in "
            "$SMP_FX_DUMP_DIR if set) shows where; every rank must make the same smp.step "
            "calls; raise SMP_FX_TIMEOUT_S if the work is just slow")
    else:
        err = SMPRuntimeError.build(
            f"torch.distributed failed {'receiving from' if receiving else 'sending to'} "
            f"{peer}", got, where, "see the error from torch.distributed below")
    err.peer_rank = peer_rank
    return err

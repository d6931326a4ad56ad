"""A failed wait on a peer: a lost connection is told from a timeout, and both name the peer."""

from __future__ import annotations

import pytest

import smp_fx as smp
from smp_fx.runtime.executor.failures import backend_words, classify, wait_failed

GLOO_CLOSED = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
               "by peer [127.0.0.1]:47308. This is typically caused by a remote worker "
               "crashing. Check the logs of the remote worker before reporting an error.")
GLOO_RESET = "[pair.cc:598] Read error [127.0.0.1]:940: Connection reset by peer"
GLOO_TIMEOUT = ("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                "waiting 20000ms for recv operation to complete")


@pytest.mark.parametrize("text, kind", [(GLOO_CLOSED, "lost"), (GLOO_RESET, "lost"),
                                        (GLOO_TIMEOUT, "timeout"),
                                        ("NCCL error: remote process exited", "lost"),
                                        ("unhandled cuda error", "other")])
def test_classify(text: str, kind: str) -> None:
    assert classify(text) == kind


def test_backend_words_drop_source_location_and_boilerplate() -> None:
    words = backend_words(RuntimeError(GLOO_CLOSED))
    assert words == "Connection closed by peer [127.0.0.1]:47308"
    assert backend_words(RuntimeError("")) is None


def test_lost_peer_is_a_peer_error_naming_rank_stage_and_what_this_rank_did() -> None:
    where = "rank 0 (stage 0) in step 3, while receiving the gradients of microbatch 1"
    err = wait_failed(RuntimeError(GLOO_RESET), "stage 1 (rank 5)", 5, True, 600.0, where)
    assert isinstance(err, smp.SMPPeerError) and isinstance(err, smp.SMPRuntimeError)
    assert err.peer_rank == 5
    text = str(err)
    assert text.startswith("lost the connection to stage 1 (rank 5): its process died")
    assert where in text and "rank 5 failed first" in text and "timed out" not in text


def test_timeout_names_the_silent_peer() -> None:
    err = wait_failed(RuntimeError(GLOO_TIMEOUT), "stage 2 (rank 2)", 2, False, 20.0, "rank 1")
    assert isinstance(err, smp.SMPTimeoutError) and err.peer_rank == 2
    assert "stage 2 (rank 2) took no message for 20 s" in str(err)
    assert "flight record" in str(err) and "SMP_FX_TIMEOUT_S" in str(err)


def test_other_backend_errors_stay_runtime_errors() -> None:
    err = wait_failed(RuntimeError("bad dtype"), "stage 1", 1, True, 1.0, "rank 0")
    assert type(err) is smp.SMPRuntimeError and "bad dtype" in str(err)

"""The wire format on its own: frame layouts, header keys, flags, and messages packed into
a frame and read back out of it, without torch.distributed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

from smp_fx.runtime.transport import wire

BIG = torch.arange(300 * 300.0).view(300, 300)  # 360000 bytes: over PACK_MAX


def _through_a_frame(value: Any) -> Any:
    """``value`` packed into a frame as the sender does, and unpacked as the receiver does
    from the header it decodes (large tensors handed over as their own messages)."""
    flat = wire.flatten(value)
    sent = wire.encode(flat)
    frame = torch.empty(sent.frame_size, dtype=torch.uint8)
    wire.write_flag(frame, 0)
    large = wire.pack(sent, wire.send_slots(frame, sent), flat.tensors)
    got = wire.decode(sent.payload)
    received = bytearray(frame.numpy().tobytes())  # a copy: nothing shared with the sender
    rframe = torch.frombuffer(received, dtype=torch.uint8)
    assert wire.read_flag(rframe) == 0
    return wire.unpack(got, wire.received_views(rframe, got, [t.clone() for t in large]))


def _same(a: Any, b: Any) -> bool:
    (la, sa), (lb, sb) = pytree.tree_flatten(a), pytree.tree_flatten(b)
    return sa == sb and all(
        torch.equal(x, y) and x.requires_grad == y.requires_grad
        if isinstance(x, torch.Tensor) else (x == y and type(x) is type(y))
        for x, y in zip(la, lb))


def test_small_tensors_pack_at_aligned_offsets_and_large_ones_travel_alone() -> None:
    value = (torch.ones(2, 3), BIG, torch.zeros(0), torch.tensor([True, False]))
    h = wire.encode(wire.flatten(value))
    # the flag's 8 bytes, padded to 64; 24 bytes -> 64; BIG alone; empty: no bytes
    assert h.offsets == (64, None, 128, 128)
    assert h.nbytes == (24, 360000, 0, 2)
    assert h.frame_size == 192 and h.frame_size % wire.ALIGN == 0
    assert [m.shape for m in h.large] == [(300, 300)]
    assert wire.frame_size(None) == wire.NO_HEADER_FRAME and wire.large(None) == ()


@pytest.mark.parametrize("value", [
    (torch.arange(6.0).view(2, 3), 4),
    [torch.ones(2, requires_grad=True), None, (torch.zeros(1, dtype=torch.float64),)],
    (BIG, torch.zeros(0), torch.tensor([True, False]), torch.arange(12.0).view(3, 4).t()),
    {"a": [torch.tensor([1, 2]), "x"], "b": None, "c": 1.5},
    (None, "x"),
    (torch.ones(2), BIG.double().requires_grad_()),
])
def test_a_message_survives_a_frame(value: Any) -> None:
    assert _same(_through_a_frame(value), value)


def test_the_key_tells_a_repeated_header_without_pickling() -> None:
    def key(value: Any) -> Any:
        return wire.flatten(value).key

    assert key((torch.ones(2), None)) == key((torch.zeros(2), None))  # values do not count
    assert key((torch.ones(2), None)) != key([torch.ones(2), None])  # tuple vs list
    assert key((torch.ones(2),)) != key((torch.ones(2, requires_grad=True),))
    assert key((torch.ones(2),)) != key((torch.ones(2, dtype=torch.float64),))
    assert key((torch.zeros(2), 1)) != key((torch.zeros(2), True))  # 1 == True, not alike
    assert key((torch.zeros(2), 1)) == key((torch.zeros(2), 1))
    assert key((torch.zeros(2), torch.float32)) is None  # not plain: the pickle decides
    # the hand-flattened structure and pytree agree on the spec it stands for
    flat = wire.flatten([torch.ones(2), None, (torch.ones(1),)])
    assert flat.shape is not None
    assert wire.spec_of(flat.shape) == pytree.tree_flatten([0, None, (0,)])[1]


def test_flags_read_alike_through_tensor_ops_and_memory() -> None:
    frame = torch.zeros(64, dtype=torch.uint8)
    for flag in (0, 12345, wire.SKIP):
        wire.write_flag(frame, flag)
        assert wire.read_flag(frame) == flag == wire.flag_at(frame.data_ptr())
    assert not frame[8:].any()  # the flag touches its 8 bytes only


def test_a_decoded_header_lays_out_the_frame_as_the_sender_did() -> None:
    flat = wire.flatten({"h": torch.ones(4, 4), "n": 3, "big": BIG})
    sent = wire.encode(flat)
    got = wire.decode(sent.payload)
    assert (got.offsets, got.frame_size, got.large) == (sent.offsets, sent.frame_size,
                                                        sent.large)
    assert got.leaves == sent.leaves and got.key is None


@pytest.mark.parametrize("tensor", [
    torch.arange(6.0).view(2, 3).t(), BIG, torch.tensor(3.5), torch.tensor([True, False]),
    torch.ones(3, dtype=torch.bfloat16) / 3, torch.arange(3.0) * (1 + 2j),
    torch.ones(5, dtype=torch.float64, requires_grad=True),
])
def test_a_one_tensor_message_travels_as_itself(tensor: torch.Tensor) -> None:
    """The tensor's own bytes land at the start of a longer receive frame whose flag was
    zeroed (a shorter message leaves it so); a fill, the whole frame, sets it."""
    flat = wire.flatten((tensor, 4))
    sent = wire.encode(flat, direct=True)
    got = wire.decode(sent.payload)
    assert sent.direct and got.direct and wire.encode(flat).direct is False
    assert (got.frame_size, got.flag_offset, got.large) == (sent.frame_size,
                                                           sent.flag_offset, ())
    assert got.flag_offset >= tensor.nbytes and got.frame_size % wire.DIRECT_ALIGN == 0
    frame = torch.empty(got.frame_size // tensor.itemsize, dtype=tensor.dtype)
    raw = frame.view(torch.uint8)
    wire.write_flag(raw, 0, got.flag_offset)
    data = flat.tensors[0].contiguous().view(-1).view(torch.uint8) if tensor.dim() else \
        flat.tensors[0].reshape(1).view(torch.uint8)
    raw[:data.numel()].copy_(data)  # what gloo writes of the sender's message
    assert wire.flag_at(frame.data_ptr() + got.flag_offset) == 0
    assert _same(wire.unpack(got, (wire.direct_view(frame, got),)), (tensor, 4))
    fill = torch.zeros(got.frame_size, dtype=torch.uint8)
    wire.write_flag(fill, wire.SKIP, got.flag_offset)
    raw.copy_(fill)
    assert wire.read_flag(raw, got.flag_offset) == wire.SKIP


def test_only_a_message_of_one_nonempty_tensor_travels_as_itself() -> None:
    for value in ((torch.ones(2), torch.ones(2)), (None, 4), (torch.zeros(0),)):
        assert not wire.encode(wire.flatten(value), direct=True).direct

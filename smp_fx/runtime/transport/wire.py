"""The multi-process transport's wire format: headers and frames, as pure functions.

One frame (an int64 flag, then small tensors at aligned offsets) plus each large tensor
apart, or, for a message of one tensor where the stream allows it, the tensor itself
(``direct``); flag 0 means the last header's layout, ``n > 0`` a new ``n``-byte header,
``SKIP`` a fill. Nothing here sends, so every function is tested on its own.
See docs/runtime.md, 'The wire format'.
"""

from __future__ import annotations

import ctypes
import functools
import math
import pickle
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

ALIGN = 64  # frame offsets: any dtype can be viewed in place
PACK_MAX = 256 * 1024  # bytes; a larger tensor is its own message (copying it costs more)
NO_HEADER_FRAME = 8  # before any header: the frame is the flag alone
SKIP = -1  # the flag of a fill that only stands in for an old-layout receive
DIRECT_ALIGN = 16  # a direct frame's flag offset and tail: every dtype's itemsize divides it
# Header leaves compared by == (with their types: 1 == 1.0 == True) instead of by pickles.
_PLAIN = frozenset((type(None), bool, int, float, str))


@dataclass(frozen=True)
class TensorMeta:
    """A tensor leaf as a header lists it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class Flat(NamedTuple):
    """A message flattened for sending: its leaves and tensors, its structure, and ``key``,
    a value equal to the last message's key exactly when the header is the same (None: only
    the pickled header can tell). A tuple: it is made for every message sent."""

    leaves: list[Any]
    tensors: list[torch.Tensor]  # the tensor leaves, out of autograd (``_detached``)
    shape: Any  # the hand-flattened structure (``flatten``), or None: ``spec`` describes it
    spec: Any
    key: Any
    metas: list[Any] | None  # ``header_leaves(leaves)``, when already made


@dataclass(frozen=True)
class Header:
    """A message's structure and where each tensor travels: ``offsets[i]`` is tensor i's
    byte offset in the frame, or None when it is a message of its own."""

    payload: bytes  # pickled (spec, leaves, shape): what goes over the wire
    spec: Any
    leaves: tuple[Any, ...]  # TensorMeta or plain values
    shape: Any  # the hand-flattened structure, or None: use ``spec``
    key: Any  # ``Flat.key`` of the messages it describes (None after ``decode``)
    metas: tuple[TensorMeta, ...]
    offsets: tuple[int | None, ...]
    nbytes: tuple[int, ...]
    frame_size: int
    large: tuple[TensorMeta, ...]  # the tensors that are messages of their own, in order
    direct: bool = False  # one tensor sent as itself; the receive frame holds it, then the flag
    flag_offset: int = 0  # where the receive frame's flag is


def flatten(value: Any) -> Flat:
    """``value`` flattened, with the key that recognises a repeated header without pickling
    when every non-tensor leaf is a plain value (whose == is exact and cheap)."""
    leaves: list[Any] = []
    shape = _shape_of(value, leaves)
    if shape is not None:  # every leaf is a tensor
        return Flat(leaves, [_detached(t) for t in leaves], shape, None,
                    (shape, tuple((t.shape, t.dtype, t.requires_grad) for t in leaves)), None)
    leaves, spec = pytree.tree_flatten(value)
    metas = header_leaves(leaves)
    key = None
    if all(isinstance(x, TensorMeta) or type(x) in _PLAIN for x in metas):
        key = (spec, [x if isinstance(x, TensorMeta) else (type(x), x) for x in metas])
    tensors = [_detached(t) for t in leaves if isinstance(t, torch.Tensor)]
    return Flat(leaves, tensors, None, spec, key, metas)


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` out of autograd; one that is not in it already is itself: an ``aten::detach``
    less per gradient sent (most messages' tensors but the activations)."""
    return t.detach() if t.requires_grad else t


def _shape_of(value: Any, leaves: list[torch.Tensor]) -> Any:
    """The usual message (tensors and None nested in tuples and lists) flattened by hand:
    its structure as a hashable value, its tensors appended to ``leaves``; None for anything
    else (``pytree`` then flattens it; it costs several microseconds per node)."""
    t = type(value)
    if t is torch.Tensor:
        leaves.append(value)
        return "T"
    if value is None:
        return "N"
    if t is tuple or t is list:
        inner = []
        for v in value:
            sub = _shape_of(v, leaves)
            if sub is None:
                return None
            inner.append(sub)
        return (t is list, tuple(inner))
    return None


def build(shape: Any, leaves: Iterator[Any]) -> Any:
    """The inverse of ``flatten``'s hand flattening: ``shape`` filled from ``leaves``."""
    if shape == "T":
        return next(leaves)
    if shape == "N":
        return None
    is_list, inner = shape
    values = [build(sub, leaves) for sub in inner]
    return values if is_list else tuple(values)


@functools.lru_cache(maxsize=256)
def spec_of(shape: Any) -> Any:
    """The pytree spec of a hand-flattened structure (tensors are leaves, like the 0s)."""
    return pytree.tree_flatten(build(shape, iter(lambda: 0, None)))[1]


def header_leaves(leaves: Sequence[Any]) -> list[Any]:
    """The leaves as a header lists them: tensors by their metadata."""
    return [TensorMeta(tuple(t.shape), t.dtype, t.requires_grad)
            if isinstance(t, torch.Tensor) else t for t in leaves]


def payload_of(flat: Flat, direct: bool = False) -> tuple[bytes, Any, list[Any]]:
    """The pickled header of ``flat`` (what a header change sends), its spec and leaves;
    ``direct``: the sender may send a message of one tensor as itself (``direct_layout``),
    which the receiver learns from the header."""
    spec = spec_of(flat.shape) if flat.shape is not None else flat.spec
    leaves = flat.metas if flat.metas is not None else header_leaves(flat.leaves)
    return pickle.dumps((spec, leaves, flat.shape, direct)), spec, leaves


def header(payload: bytes, spec: Any, leaves: Sequence[Any], shape: Any, key: Any,
           direct: bool = False) -> Header:
    """The header with its frame layout: small tensors packed at aligned offsets, or, where
    the sender allows ``direct`` and the message has one tensor, the ``direct_layout``."""
    metas = tuple(m for m in leaves if isinstance(m, TensorMeta))
    if direct and len(metas) == 1 and metas[0].nbytes:
        return direct_layout(payload, spec, tuple(leaves), shape, key, metas[0])
    offsets: list[int | None] = []
    end = ALIGN
    for m in metas:
        if m.nbytes <= PACK_MAX:
            offsets.append(end)
            end += -(-m.nbytes // ALIGN) * ALIGN
        else:
            offsets.append(None)
    large = tuple(m for m, off in zip(metas, offsets) if off is None)
    return Header(payload, spec, tuple(leaves), shape, key, metas, tuple(offsets),
                  tuple(m.nbytes for m in metas), end, large)


def direct_layout(payload: bytes, spec: Any, leaves: tuple[Any, ...], shape: Any, key: Any,
                  meta: TensorMeta) -> Header:
    """A message of one tensor, sent as the tensor itself: no copy into a frame, and one
    message whatever its size. The receiver posts a frame one flag longer, the flag zeroed
    at posting; the tensor's message is shorter, so a flag other than 0 can only come from
    a fill (gloo takes a shorter message into a longer receive; NCCL does not, so only
    gloo streams on CPU use it). The sender's frame and copy: 3.7-4.3 -> 0.1 us per 32 x 512
    fp32 message, one aten op less (``benchmarks/transport_tricks.py``), and one message
    instead of two over 256 KiB (docs/performance.md)."""
    flag_offset = -(-meta.nbytes // DIRECT_ALIGN) * DIRECT_ALIGN
    return Header(payload, spec, leaves, shape, key, (meta,), (0,), (meta.nbytes,),
                  flag_offset + DIRECT_ALIGN, (), True, flag_offset)


def encode(flat: Flat, direct: bool = False) -> Header:
    """The header of the message ``flat``."""
    payload, spec, leaves = payload_of(flat, direct)
    return header(payload, spec, leaves, flat.shape, flat.key, direct)


def decode(payload: bytes) -> Header:
    """The header a peer sent as ``payload``."""
    with warnings.catch_warnings():  # unpickling a LeafSpec warns in torch 2.13
        warnings.simplefilter("ignore", FutureWarning)
        spec, leaves, shape, direct = pickle.loads(payload)
    return header(payload, spec, leaves, shape, None, direct)


def frame_size(h: Header | None) -> int:
    return h.frame_size if h is not None else NO_HEADER_FRAME


def large(h: Header | None) -> tuple[TensorMeta, ...]:
    return h.large if h is not None else ()


def flag_offset(h: Header | None) -> int:
    return h.flag_offset if h is not None else 0


@functools.lru_cache(maxsize=1024)
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def direct_view(frame: torch.Tensor, h: Header) -> torch.Tensor:
    """The tensor of a direct frame (``direct_layout``), a frame of its dtype: one
    ``as_strided`` instead of ``slot``'s slice and two views, 6.8-8.8 -> 1.5-3.4 us at
    posting (``benchmarks/transport_tricks.py``)."""
    m = h.metas[0]
    t = frame.as_strided(m.shape, contiguous_strides(m.shape))
    return t.requires_grad_() if m.requires_grad else t


def slot(frame: torch.Tensor, offset: int, nbytes: int, meta: TensorMeta) -> torch.Tensor:
    """The frame bytes of one tensor, viewed as that tensor (no copy)."""
    if nbytes == 0:
        return torch.empty(meta.shape, dtype=meta.dtype, device=frame.device)
    return frame[offset:offset + nbytes].view(meta.dtype).view(meta.shape)


def send_slots(frame: torch.Tensor, h: Header) -> tuple[torch.Tensor | None, ...]:
    """Per tensor of ``h``, its slot in ``frame`` to copy into (None: sent on its own, or
    empty)."""
    return tuple(None if off is None or not n else slot(frame, off, n, m)
                 for m, off, n in zip(h.metas, h.offsets, h.nbytes))


def pack(h: Header, slots: Sequence[torch.Tensor | None],
         tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copy ``tensors`` into their ``slots``; returns the large ones (contiguous), which
    follow the frame as messages of their own, in order."""
    out = []
    for t, off, view in zip(tensors, h.offsets, slots):
        if off is None:
            out.append(t.contiguous())
        elif view is not None:
            view.copy_(t)
    return out


def received_views(frame: torch.Tensor, h: Header,
                   large_tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The message's tensors, in header order, viewed out of ``frame`` (or the large
    tensors' own buffers), with the sender's ``requires_grad``."""
    big = iter(large_tensors)
    typed: dict[torch.dtype, torch.Tensor] = {}
    out = []
    for m, off, n in zip(h.metas, h.offsets, h.nbytes):
        if off is None:
            t = next(big)
        elif not n:
            t = slot(frame, off, n, m)
        else:
            t = strided_slot(frame, typed, off, m)
        out.append(t.requires_grad_(m.requires_grad) if m.requires_grad else t)
    return tuple(out)


def strided_slot(frame: torch.Tensor, typed: dict[torch.dtype, torch.Tensor], offset: int,
                 meta: TensorMeta) -> torch.Tensor:
    """``slot`` in one ``as_strided`` of the frame viewed as the tensor's dtype (one view
    per dtype and frame, kept in ``typed``) instead of a slice and two views: a gradient
    message's frame (two fp32 tensors) 6 -> 3 aten ops, 15.7-18.6 -> 6.4-11.3 us at posting
    (``benchmarks/transport_tricks.py``; docs/performance.md)."""
    base = typed.get(meta.dtype)
    if base is None:
        base = typed[meta.dtype] = frame.view(meta.dtype)
    return base.as_strided(meta.shape, contiguous_strides(meta.shape),
                           offset // meta.dtype.itemsize)


def unpack(h: Header, tensors: Sequence[torch.Tensor]) -> Any:
    """The message: ``h``'s structure filled with ``tensors`` (``received_views``)."""
    it = iter(tensors)
    if h.shape is not None:
        return build(h.shape, it)
    values = [next(it) if isinstance(leaf, TensorMeta) else leaf for leaf in h.leaves]
    return pytree.tree_unflatten(values, h.spec)


def write_flag(frame: torch.Tensor, flag: int, offset: int = 0) -> None:
    """Set a uint8 frame's flag at byte ``offset``; on CPU through ``flag_at``'s direct
    memory access."""
    if frame.device.type == "cpu":
        ctypes.c_int64.from_address(frame.data_ptr() + offset).value = flag
    else:
        frame[offset:offset + 8].view(torch.int64).fill_(flag)


def read_flag(frame: torch.Tensor, offset: int = 0) -> int:
    """A uint8 frame's flag, read with tensor ops (any device; on CPU ``flag_at`` is
    faster)."""
    return int(frame[offset:offset + 8].view(torch.int64).item())


def flag_at(address: int) -> int:
    """The flag of the CPU frame at ``address``, read straight from memory through ctypes.

    Buys 3-7 us per received message against slicing and viewing the frame
    (``benchmarks/transport_tricks.py``; docs/performance.md)."""
    return ctypes.c_int64.from_address(address).value

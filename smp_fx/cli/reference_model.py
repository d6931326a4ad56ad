"""The reference model ``smp-fx calibrate`` fits ``DeviceSpec.compute_scale`` and
``DeviceSpec.overhead_scale`` on.

Why: the device figures are microbenchmarks, each op timed alone in a loop with its data
hot in cache. Inside a real forward and backward the same ops run slower: on the 2-core
CPU this project is developed on, every example model's training step came out at
0.59-0.70 of the measured one with the microbenchmarked figures alone. The slowdown is
not one factor: this model's measured / predicted time was 1.78 at batch 1 x 8 tokens,
1.48 at 2 x 16 and 0.94 at 8 x 32 and 16 x 64, because the ops' fixed costs (dispatch,
autograd's graph, the allocator) grow about 2.3x in place while their work does not.
So the fit is two factors, by least squares over the model at several sizes: the
predicted fixed part times ``overhead_scale`` plus the predicted work times
``compute_scale`` against the measured time. The per-op figures keep their shape.

``fit_scales(spec, device)`` -> (overhead_scale, compute_scale); ``fit_conv_scale`` then
fits the convolutions' own factor on a small ResNet-style stack (``ConvReference``).
"""

from __future__ import annotations

import dataclasses
import statistics

import torch
from torch import nn
from torch.nn import functional as F

from cost_model import microbench
from cost_model.device import DeviceSpec
from cost_model.errors import SMPError

VOCAB, WIDTH, HEADS, LAYERS, BATCH, SEQ = 512, 128, 4, 2, 8, 32


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(WIDTH, dim=2)
        q, k, v = (y.view(b, t, HEADS, c // HEADS).transpose(1, 2) for y in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) * (c // HEADS) ** -0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class Reference(nn.Module):
    """A two-block transformer LM, about 0.5 M parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(*[_Block() for _ in range(LAYERS)])
        self.ln_f, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(self.blocks(self.embed(tokens))))


class ConvReference(nn.Module):
    """A small ResNet-style stack at CIFAR-like sizes: what ``fit_conv_scale`` times."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for cin, cout, stride in ((3, 16, 1), (16, 16, 1), (16, 32, 2), (32, 32, 1)):
            layers += [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                       nn.ReLU()]
        self.body = nn.Sequential(*layers, nn.Conv2d(32, 64, 1, 2, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


CONV_INPUT = (8, 3, 16, 16)


SIZES = ((1, 8), (2, 16), (BATCH, SEQ))
"""(batch, tokens) the scales are fitted over: small sizes expose the fixed costs."""
LIMITS = (0.25, 8.0)


def fit_scales(spec: DeviceSpec, device: torch.device, repeats: int = 15
               ) -> tuple[float, float]:
    """(overhead_scale, compute_scale): least squares of the reference model's measured
    forward and backward (CPU time, median of ``repeats``) over ``SIZES`` against its
    predicted fixed costs and work (module docstring), each clamped to ``LIMITS``."""
    rows = [_size_row(spec, device, batch, tokens, repeats) for batch, tokens in SIZES]
    solved = least_squares(rows)
    if solved is None:
        raise SMPError.build("the reference model's predicted fixed costs and work must "
                             "not be proportional", rows, "smp-fx calibrate (scales)",
                             "check the spec's op figures (all zero?)")
    fixed, work = solved
    lo, hi = LIMITS
    return min(max(fixed, lo), hi), min(max(work, lo), hi)


def fit_conv_scale(spec: DeviceSpec, device: torch.device, repeats: int = 15) -> float:
    """How much the convolutions' fixed costs must be scaled, beyond ``overhead_scale``,
    for ``ConvReference``'s predicted forward and backward to equal its measured one
    (clamped to ``LIMITS``); ``spec`` carries the fitted scales.

    Why: a convolution's fixed cost on a CPU is mostly its library's per-call setup
    (oneDNN: 40 us forward, 120 us backward at the smallest shapes that take its path,
    against 6 and 30 us for the tiny ones that do not), which grows less in place than the
    dispatch-bound fixed costs ``overhead_scale`` is fitted on: with that factor alone the
    example CNN was predicted 1.17-1.24 x its measured step."""
    from passes.trace import trace

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ConvReference().to(device)
        x = torch.randn(*CONV_INPUT, device=device)
        grad = torch.randn_like(model(x))
    traced = trace(model, (x,), {})

    def predicted(conv: float) -> float:
        ops = tuple((k, f * conv, b * conv) if k == "conv" else (k, f, b)
                    for k, f, b in spec.op_overheads)
        return _predicted(model, x, traced, dataclasses.replace(spec, op_overheads=ops))

    rest = predicted(0.0)
    conv = predicted(1.0) - rest
    if not conv > 0:
        return 1.0
    measured = _measured(model, x, grad, device, repeats)
    lo, hi = LIMITS
    return min(max((measured - rest) / conv, lo), hi)


def _size_row(spec: DeviceSpec, device: torch.device, batch: int, tokens: int,
              repeats: int) -> tuple[float, float, float]:
    """(predicted fixed s, predicted work s, measured s) of one forward and backward."""
    from passes.trace import trace

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Reference().to(device)
        ids = torch.randint(0, VOCAB, (batch, tokens), device=device)
        grad = torch.randn(batch, tokens, VOCAB, device=device)

    traced = trace(model, (ids,), {})

    def predicted(overhead_scale: float) -> float:
        return _predicted(model, ids, traced, dataclasses.replace(
            spec, compute_scale=1.0, overhead_scale=overhead_scale))

    both = predicted(1.0)
    fixed = predicted(2.0) - both
    return fixed, both - fixed, _measured(model, ids, grad, device, repeats)


def _predicted(model: nn.Module, x: torch.Tensor, traced: torch.fx.GraphModule,
               spec: DeviceSpec) -> float:
    """The predicted forward and backward of ``model`` on ``x`` (its trace) under ``spec``."""
    from passes import meta
    from passes.pipeline import analyse

    costed = analyse(model, (x,), traced=traced, device=spec)
    return sum(c.fwd_time_s + c.bwd_time_s for n in costed.graph.nodes
               if (c := meta.COST.get(n)) is not None)


def _measured(model: nn.Module, x: torch.Tensor, grad: torch.Tensor, device: torch.device,
              repeats: int) -> float:
    """Median seconds of one forward and backward (the device's clock), after 3 warm-ups."""
    now = microbench.clock(device)

    def once() -> float:
        model.zero_grad(set_to_none=True)
        t0 = now()
        model(x).backward(grad)
        return now() - t0

    for _ in range(3):
        once()
    return statistics.median(once() for _ in range(repeats))


def least_squares(rows: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """(x, y) minimising the sum of (a x + b y - r)^2 over ``rows`` of (a, b, r); None when
    the two columns are proportional."""
    aa = sum(a * a for a, _, _ in rows)
    bb = sum(b * b for _, b, _ in rows)
    ab = sum(a * b for a, b, _ in rows)
    ar = sum(a * r for a, _, r in rows)
    br = sum(b * r for _, b, r in rows)
    det = aa * bb - ab * ab
    if not det > 0:
        return None
    return (ar * bb - br * ab) / det, (br * aa - ar * ab) / det


__all__ = ["ConvReference", "Reference", "fit_conv_scale", "fit_scales", "least_squares"]

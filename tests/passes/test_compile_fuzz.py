"""Random DAG models through the whole compiler: every plan is valid and the in-process
pipeline computes what the model computes, or the compiler refuses with the error the rules
predict.

hypothesis draws a small DAG (linears, element-wise ops, adds and products of two earlier
values, a concatenation fed to a linear, a split and swap of halves, one or two inputs,
one or two outputs), traced, costed and partitioned at pp 1-3, both schedules, auto or
manual partitioning (random ``smp.set_partition`` pins). Valid: every compute node has one
stage in range, no value flows from a later stage to an earlier one, the plan lists each
node once. Then one training step through ``DistributedModel`` equals the plain model's
outputs and gradients.

The one refusal a model of this family can earn is manual pins against its data flow
(``SMPPartitionError``, "manual partitions must form a pipeline"); automatic partitioning
and every step of a compiled plan must succeed. Anything else fails the test, in particular
an ``SMPPassError`` wrapping a crash inside a pass and an ``SMPInternalError``
(``tests.helpers.refusals``), and at least half the examples must compute.
``SMP_FX_FUZZ_EXAMPLES`` raises the number of examples.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as hs
from torch import nn

import smp_fx as smp
from passes import meta
from passes.partition_config import PartitionConfig
from passes.pipeline import compile_model
from smp_fx import SMPPartitionError
from smp_fx.marking.manual import pins_by_module_path
from smp_fx.world import state
from tests.helpers.numerics import init
from tests.helpers.refusals import assert_refusal

EXAMPLES = max(int(os.environ.get("SMP_FX_FUZZ_EXAMPLES", "150")) // 10, 12)
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
WIDTH, BATCH = 6, 4
OPS = ("linear", "relu", "tanh", "add", "mul", "catlinear", "swap")
OUTCOMES: Counter[str] = Counter()
MIN_COMPUTED = 0.5
"""The share of examples that must compute (about 0.9 do; refusals are manual pins only)."""


class RandomDag(nn.Module):
    """``spec``: one (op, first input, second input) per node; inputs index earlier values
    (the model's inputs first). ``outputs``: the values returned."""

    def __init__(self, inputs: int, spec: list[tuple[str, int, int]],
                 outputs: tuple[int, ...]) -> None:
        super().__init__()
        self.inputs, self.spec, self.outputs = inputs, spec, outputs
        self.layers = nn.ModuleList(
            nn.Linear(2 * WIDTH if op == "catlinear" else WIDTH, WIDTH) if op in (
                "linear", "catlinear") else nn.Identity() for op, _, _ in spec)

    def forward(self, *xs: torch.Tensor) -> Any:
        values = list(xs)
        for (op, a, b), layer in zip(self.spec, self.layers):
            x, y = values[a], values[b]
            if op == "linear":
                values.append(layer(x))
            elif op == "relu":
                values.append(torch.relu(x))
            elif op == "tanh":
                values.append(torch.tanh(x))
            elif op == "add":
                values.append(x + y)
            elif op == "mul":
                values.append(x * y)
            elif op == "catlinear":
                values.append(layer(torch.cat([x, y], dim=1)))
            else:  # swap the halves of the features
                values.append(torch.cat([x[:, WIDTH // 2:], x[:, :WIDTH // 2]], dim=1))
        out = tuple(values[i] for i in self.outputs)
        return out[0] if len(out) == 1 else out


@hs.composite
def dags(draw: Any) -> RandomDag:
    inputs = draw(hs.integers(1, 2))
    n = draw(hs.integers(2, 9))
    spec = []
    for i in range(n):
        # node 0 is a linear and each node reads the one before: every value after the
        # inputs depends on a parameter, so every output has a gradient
        op = draw(hs.sampled_from(OPS)) if i else "linear"
        avail = inputs + i
        first = avail - 1 if i else draw(hs.integers(0, inputs - 1))
        spec.append((op, first, draw(hs.integers(0, avail - 1))))
    last = inputs + n - 1
    extra = draw(hs.lists(hs.integers(inputs, last - 1), max_size=1)) if n > 1 else []
    return RandomDag(inputs, spec, (last, *extra))


def _check_plan(gm: torch.fx.GraphModule, plan: Any, stages: int) -> None:
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    for n in compute:
        s = meta.STAGE.get(n)
        assert s is not None and 0 <= s < stages, (n.name, s)
        for a in n.all_input_nodes:
            if a.op not in ("placeholder", "get_attr"):
                assert meta.STAGE.get(a) <= s, f"{a.name} (stage {meta.STAGE.get(a)}) feeds " \
                                                f"{n.name} (stage {s})"
    listed = [name for st in plan.stages for name in st.nodes]
    assert len(listed) == len(set(listed)), "a node is listed on two stages"
    assert set(listed) <= {n.name for n in gm.graph.nodes}
    assert len(plan.stages) == stages


def test_random_dags_compile_to_valid_plans_that_compute_the_model() -> None:
    OUTCOMES.clear()
    _compile_and_compute()
    computed, total = OUTCOMES["computed"], sum(OUTCOMES.values())
    assert total and computed >= MIN_COMPUTED * total, OUTCOMES


@FUZZ
@given(model=dags(), pp=hs.integers(1, 3), m=hs.sampled_from((1, 2)),
       pipeline=hs.sampled_from(("simple", "interleaved")), manual=hs.booleans(),
       data=hs.data())
def _compile_and_compute(model: RandomDag, pp: int, m: int, pipeline: str, manual: bool,
                         data: Any) -> None:
    linears = [layer for layer in model.layers if isinstance(layer, nn.Linear)]
    if manual:
        for layer in linears:
            smp.set_partition(layer, data.draw(hs.integers(0, pp - 1)))
    torch.manual_seed(0)
    xs = tuple(torch.randn(BATCH, WIDTH) for _ in range(model.inputs))
    mb = tuple(x[:BATCH // m] for x in xs)
    pins = pins_by_module_path(model) if manual else None
    try:
        compiled = compile_model(model, mb, None, PartitionConfig(
            num_stages=pp, microbatches=m, pipeline=pipeline, auto_partition=not manual),
            pins=pins)
    except SMPPartitionError as exc:
        assert manual, f"automatic partitioning refused a valid model: {exc}"
        assert_refusal(exc, SMPPartitionError, "manual partitions must form a pipeline")
        event("refused: manual pins against the data flow")
        OUTCOMES["refused"] += 1
        return
    _check_plan(compiled.gm, compiled.plan, pp)

    ref = RandomDag(model.inputs, model.spec, model.outputs)
    ref.load_state_dict(model.state_dict())
    init(pp, m, pipeline, auto_partition=not manual, default_partition=0)
    try:
        dm = smp.DistributedModel(model)

        @smp.step
        def step(model: Any, *xs: torch.Tensor) -> Any:
            out = model(*xs)
            outs = out if isinstance(out, tuple) else (out,)
            model.backward(sum(o.square().mean() for o in outs))
            return out

        got = step(dm, *xs)
        event("computed")
        OUTCOMES["computed"] += 1
        for i in range(m):
            part = tuple(x[i * BATCH // m:(i + 1) * BATCH // m] for x in xs)
            out = ref(*part)
            outs = out if isinstance(out, tuple) else (out,)
            (sum(o.square().mean() for o in outs) / m).backward()
            mine = tuple(o.outputs[i] for o in got) if isinstance(got, tuple) else (
                got.outputs[i],)
            for a, b in zip(mine, outs):
                torch.testing.assert_close(a, b.detach(), atol=1e-5, rtol=1e-5)
        grads = dict(ref.named_parameters())
        for name, p in dm.local_named_parameters():
            g = grads[name].grad
            if g is None:
                assert p.grad is None or not p.grad.any(), name
                continue
            torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-5,
                                       msg=lambda d, n=name: f"gradient of {n}: {d}")
    finally:
        smp.reset()
        state._reset()  # smp.init too: later tests in this process must not inherit it

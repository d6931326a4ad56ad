"""``passes.tensor_parallel.sequence`` (``optimize: "memory"``) on one process: which values
between the pairs are chunked by sequence, the collectives that replace all-reduce and copy, the
parameters whose gradients need summing, and the bytes each rank then holds.

The numerics (equal to one process on the global batch, both batch modes) are asserted
with real tp groups in tests/smp_fx/parallel/test_tensor_parallel.py.
"""

from __future__ import annotations

import torch
from torch import nn

from passes import meta
from passes.shape_prop import shape_prop
from passes.tensor_parallel import TensorParallelism, tensor_parallel
from passes.trace import trace


def _blocks(seq: int = 6) -> tuple[torch.fx.GraphModule, tuple[str, ...]]:
    from examples.models.gpt import Block, GPTConfig

    torch.manual_seed(0)
    model = nn.Sequential(*(Block(GPTConfig(n_embd=16, n_head=4)) for _ in range(2)))
    x = torch.randn(2, seq, 16)
    return shape_prop(trace(model, (x,), {}), (x,)), ("0", "1")


def _roles(gm: torch.fx.GraphModule) -> list[str]:
    return [str(meta.TP.get(n)) for n in gm.graph.nodes if str(meta.TP.get(n)).startswith("tp_")]


def _bytes(gm: torch.fx.GraphModule, path: str) -> int:
    return sum(getattr(meta.TENSOR.get(n), "nbytes", 0) or 0 for n in gm.graph.nodes
               if meta.MODULE_PATH.get(n, "") == path and meta.TP.get(n) is None)


def test_memory_chunks_layer_norms_and_residuals_between_the_pairs() -> None:
    gm, marked = _blocks()
    speed, plain = tensor_parallel(gm, TensorParallelism(2, 0, True, marked))
    memory, plan = tensor_parallel(gm, TensorParallelism(2, 0, True, marked,
                                                         sequence_parallel=True))
    assert plain.sequence_parallel == ()
    assert plan.sharded == plain.sharded and plan.pairs == plain.pairs
    # 4 row outputs: reduce-scatter; 3 column inputs after the first pair: gather
    assert _roles(memory).count("tp_seq_reduce_scatter") == 4
    assert _roles(memory).count("tp_seq_gather") == 3
    assert _roles(memory).count("tp_copy") == 1  # the first pair's input is replicated
    assert _roles(memory).count("tp_scatter") == 1  # block 0's input joins its residual
    assert _roles(memory).count("tp_seq_unscatter") == 1  # the output leaves replicated
    assert "tp_reduce" not in _roles(memory)
    assert plan.sequence_parallel == (
        "0.attn.c_proj.bias", "0.ln_2.weight", "0.ln_2.bias", "0.mlp.c_proj.bias",
        "1.ln_1.weight", "1.ln_1.bias", "1.attn.c_proj.bias", "1.ln_2.weight", "1.ln_2.bias",
        "1.mlp.c_proj.bias")
    # what each rank holds for the chunked layer norms: half
    assert _bytes(memory, "0.ln_2") * 2 == _bytes(speed, "0.ln_2") > 0
    assert _bytes(memory, "0.ln_1") == _bytes(speed, "0.ln_1")
    assert plan.to_json()["sequence_parallel"] == list(plan.sequence_parallel)
    assert type(plan).from_json(plan.to_json()) == plan


def test_a_sequence_tp_does_not_divide_stays_replicated() -> None:
    gm, marked = _blocks(seq=5)
    memory, plan = tensor_parallel(gm, TensorParallelism(2, 0, True, marked,
                                                         sequence_parallel=True))
    assert plan.sequence_parallel == () and "tp_reduce" in _roles(memory)
    assert not any(r.startswith("tp_seq") for r in _roles(memory))


def test_linears_sharing_a_sequence_gather_save_the_gathered_input_only() -> None:
    """q, k and v (gate and up) read one gather of the sequence chunk: each saves what it
    reads, the gathered value, and none keeps the chunk counted beside it."""
    from cost_model.devices import load_device
    from passes.annotate_costs import annotate_costs
    from tests.helpers.models import example

    ex = example("hf_llama")
    torch.manual_seed(0)
    args = ex.example_inputs(2)
    gm = annotate_costs(shape_prop(trace(ex.build_model(), args), args), load_device("a100"))
    memory, _ = tensor_parallel(gm, TensorParallelism(2, 0, True, ("",),
                                                      sequence_parallel=True))
    gathers = [n for n in memory.graph.nodes if meta.TP.get(n) == "tp_seq_gather"]
    shared = [g for g in gathers if len(g.users) > 1]
    assert shared  # k_proj and v_proj beside q_proj, up_proj beside gate_proj
    for g in gathers:
        full = meta.TENSOR.get(g).nbytes
        for linear in g.users:
            keys = meta.SAVED.get(linear).keys
            assert (g.name, full) in keys, (linear.name, keys)
            assert all(k.split("[")[0] != g.args[0].name for k, _ in keys), (linear.name, keys)

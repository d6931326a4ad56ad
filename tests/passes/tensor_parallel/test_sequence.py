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


class _Split(nn.Module):
    """A Llama-shaped block: q, k, v and gate, up read one normed input each."""

    def __init__(self, w: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(w), nn.LayerNorm(w)
        self.q, self.k, self.v, self.o = (nn.Linear(w, w) for _ in range(4))
        self.gate, self.up, self.down = nn.Linear(w, 2 * w), nn.Linear(w, 2 * w), \
            nn.Linear(2 * w, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        h = self.ln_1(x)
        q, k, v = (p(h).view(b, s, self.heads, -1).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, w))
        h = self.ln_2(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def test_linears_sharing_a_sequence_gather_save_the_gathered_input_only() -> None:
    """q, k and v (gate and up) read one gather of the sequence chunk: each saves what it
    reads, the gathered value, and none keeps the chunk counted beside it."""
    from cost_model.devices import load_device
    from passes.annotate_costs import annotate_costs

    torch.manual_seed(0)
    model, x = nn.Sequential(_Split(), _Split()), torch.randn(2, 8, 16)
    gm = annotate_costs(shape_prop(trace(model, (x,), {}), (x,)), load_device("a100"))
    memory, _ = tensor_parallel(gm, TensorParallelism(2, 0, True, ("0", "1"),
                                                      sequence_parallel=True))
    gathers = [n for n in memory.graph.nodes if meta.TP.get(n) == "tp_seq_gather"]
    assert sum(len(g.users) for g in gathers) == 7  # q, k, v of block 1; gate, up of both
    for g in gathers:
        full = meta.TENSOR.get(g).nbytes
        for linear in g.users:
            keys = meta.SAVED.get(linear).keys
            assert (g.name, full) in keys, (linear.name, keys)
            assert all(k.split("[")[0] != g.args[0].name for k, _ in keys), (linear.name, keys)

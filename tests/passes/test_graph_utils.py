"""copy_graph_module: what the passes that copy before writing metadata rely on."""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from passes import meta
from passes.graph_utils import copy_graph_module
from passes.trace import trace


class TiedHead(nn.Module):
    """``head.weight`` is a second name of the embedding's weight; the forward never reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.head = nn.Module()
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(torch.relu(self.emb(ids)), self.emb.weight)


def test_copy_has_new_nodes_with_the_same_names_and_copied_meta() -> None:
    ids = torch.tensor([[1, 2, 3]])
    gm = trace(TiedHead(), (ids,))
    for i, n in enumerate(gm.graph.nodes):
        meta.STAGE.set(n, i)
    gm.meta["tag"] = "original"
    out = copy_graph_module(gm)
    assert out.graph is not gm.graph
    assert [n.name for n in out.graph.nodes] == [n.name for n in gm.graph.nodes]
    pairs = list(zip(gm.graph.nodes, out.graph.nodes))
    assert all(a is not b and a.meta is not b.meta and a.meta == b.meta for a, b in pairs)
    assert pairs[-1][1].op == "output" and meta.STAGE.get(pairs[-1][1]) == len(pairs) - 1
    for n in out.graph.nodes:  # writing on the copy leaves the original alone
        meta.STAGE.set(n, 0)
    out.meta["tag"] = "copy"
    assert [meta.STAGE.get(n) for n in gm.graph.nodes] == list(range(len(pairs)))
    assert gm.meta["tag"] == "original"
    torch.testing.assert_close(out(ids), gm(ids))


def test_copy_shares_weights_and_keeps_every_state_dict_key() -> None:
    model = TiedHead()
    gm = trace(model, (torch.tensor([[0]]),))
    out = copy_graph_module(gm)
    assert out.get_parameter("emb.weight") is model.emb.weight
    assert list(out.state_dict()) == list(model.state_dict()) == ["emb.weight", "head.weight"]
    assert out.get_parameter("head.weight") is model.emb.weight


def test_copy_keeps_the_pytree_calling_convention() -> None:
    class DictIn(nn.Module):
        def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {"sum": batch["a"] + batch["b"]}

    ph = torch.fx._symbolic_trace.PH
    gm = torch.fx.symbolic_trace(DictIn(), concrete_args={"batch": {"a": ph, "b": ph}})
    out = copy_graph_module(gm)
    batch = {"a": torch.ones(2), "b": torch.full((2,), 2.0)}
    torch.testing.assert_close(out(batch), {"sum": torch.full((2,), 3.0)})

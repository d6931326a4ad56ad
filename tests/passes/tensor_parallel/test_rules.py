"""``passes.tensor_parallel.rules``: the table from op targets to sharding rules and its
lookup (the rules' effects are asserted through the rewrite in test_rewrite.py and the
tp numerics tests)."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from passes.tensor_parallel import reshapes, rules
from passes.tensor_parallel.propagation import Rewrites, Split
from passes.tensor_parallel.rules import RULES, rule, rule_for
from passes.trace import trace


def test_each_family_has_its_rule() -> None:
    assert RULES[torch.ops.aten.view.default] is RULES["view"] is RULES[torch.reshape]
    assert RULES["transpose"] is RULES[torch.ops.aten.transpose.int]
    assert RULES[F.scaled_dot_product_attention] is rules._sdpa
    assert RULES[operator.matmul] is RULES["matmul"] is rules._matmul
    assert RULES[torch.cat] is reshapes.cat
    assert RULES[operator.mul] is RULES["mul"] is rules._elementwise
    assert "linear" not in RULES and F.linear not in RULES  # linears are the sweep's


def test_a_target_in_two_rows_is_refused() -> None:
    with pytest.raises(ValueError, match="two sharding rules"):
        rules._table(({"view"}, rules._elementwise), ({"view", "reshape"}, rules._matmul))


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.act = nn.GELU()
        self.view = nn.LayerNorm(4)  # a module named like a method: not the view rule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x))
        return self.view(h.view(2, 3, 2, 4).transpose(1, 2))


def test_lookup_by_op_kind() -> None:
    gm = trace(Mixed(), (torch.randn(2, 3, 4),), {})
    by_target = {str(n.target): n for n in gm.graph.nodes}
    assert rule_for(gm, by_target["act"]) is rules._elementwise  # a module, by its type
    assert rule_for(gm, by_target["view"]) is None
    assert rule_for(gm, by_target["fc"]) is None
    method = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "view")
    assert rule_for(gm, method) is RULES["view"]
    assert rule_for(gm, next(iter(gm.graph.nodes))) is None  # a placeholder


def test_first_split_rules_need_the_split_on_their_first_argument() -> None:
    gm = trace(Mixed(), (torch.randn(2, 3, 4),), {})
    fc = next(n for n in gm.graph.nodes if n.target == "fc")
    act = next(n for n in gm.graph.nodes if n.target == "act")
    method = next(n for n in gm.graph.nodes if n.target == "transpose")
    split = {act: Split(1, fc.name)}
    assert rule(gm, method, split, Rewrites(), 2, lambda _: None) is None  # input replicated
    split[method.args[0]] = Split(2, fc.name)
    assert rule(gm, method, split, Rewrites(), 2, lambda _: None) == Split(1, fc.name)


def test_a_view_finds_the_split_past_a_batch_of_one_but_not_on_one_head() -> None:
    """Grouped-query attention's ``(b, kv, rep, t, d) -> (b, kv * rep, t, d)`` with the kv
    heads split keeps the split on the heads at b = 1 as at b = 2 (a size-1 dim the source
    has unchanged before the split is not where it starts); a single head ``(b, t, 16) ->
    (b, t, 1, 16)`` is still refused, at every batch."""
    heads = Split(1, "k")
    for b in (1, 2):
        assert reshapes._view_dim((b, 2, 2, 16, 16), (b, 4, 16, 16), heads, 2) == 1
        assert reshapes._view_dim((b, 1, 16), (b, 1, 1, 16), Split(2, "k"), 2) is None
        assert reshapes._view_dim((b, 4, 16), (b, 4, 1, 16), Split(2, "k"), 2) is None

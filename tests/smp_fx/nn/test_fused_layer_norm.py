"""smp.nn.FusedLayerNorm: apex's signature, torch's layer norm, traced and partitioned."""

from __future__ import annotations

import torch

from smp_fx.nn import FusedLayerNorm


def test_apex_signature_and_values() -> None:
    x = torch.randn(2, 3, 4, 5)
    ln = FusedLayerNorm([4, 5], eps=1e-6, memory_efficient=True)
    assert ln.weight.shape == (4, 5) and bool((ln.weight == 1).all())
    assert bool((ln.bias == 0).all()) and ln.memory_efficient
    with torch.no_grad():
        ln.weight.uniform_()
        ln.bias.uniform_()
    mean = x.mean(dim=(-2, -1), keepdim=True)
    var = x.var(dim=(-2, -1), unbiased=False, keepdim=True)
    want = (x - mean) / torch.sqrt(var + 1e-6) * ln.weight + ln.bias
    torch.testing.assert_close(ln(x), want, atol=1e-5, rtol=1e-5)
    plain = FusedLayerNorm(5, elementwise_affine=False)
    assert plain.weight is None and plain.normalized_shape == (5,)


def test_it_partitions_like_any_module() -> None:
    import smp_fx as smp
    from tests.helpers.numerics import init

    init(2, 1, "simple")
    net = torch.nn.Sequential(torch.nn.Linear(5, 5), FusedLayerNorm(5),
                              torch.nn.Linear(5, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.LayerNorm(5),
                              torch.nn.Linear(5, 2))
    ref.load_state_dict(net.state_dict())
    model = smp.DistributedModel(net)
    x = torch.randn(4, 5)

    @smp.step
    def fwd(model: smp.DistributedModel, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    with torch.no_grad():
        torch.testing.assert_close(fwd(model, x).concat(), ref(x))

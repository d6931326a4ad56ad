"""Checkpoints at ``expert_parallel_degree`` 2 load at ep 4 and at ep 1, model and optimizer.

One spawn of 4 gloo ranks: Hugging Face's Mixtral trains 2 Adam steps at ep 2 (2 ep
groups) and saves a partial checkpoint (``smp.save_checkpoint``) and the full state dicts
(``state_dict()`` of model and optimizer, every expert gathered). The same training with
ZeRO-1 (``shard_optimizer_state``: a slice's state on one rank of its edp group) saves a
partial one, and its full optimizer state equals the first's. Then the partial ones
resume at ep 4 (the ZeRO-1 one with ZeRO-1) and the full ones load at ep 1 (plain data
parallelism); each takes the third step. So do the full ones in the plain model and
torch optimizer of this process. Each final ``state_dict()`` equals the plain model
trained 3 steps on the global batch (1e-5). ``smp-fx checkpoint export`` of the partial
one loads with ``from_pretrained``: its logits equal the plain model's with the full
state.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from examples.models import moe_zoo
from tests.helpers.compare import optimizer_state_mismatches, state_dict_mismatches
from tests.helpers.dist import run_ranks
from tests.smp_fx.parallel.test_expert_parallel import (
    MAX_NORM,
    OPTIMIZERS,
    TOL,
    _batches,
    _loss,
    _reference,
)

CASE = "mixtral/adam"
ARCH = CASE.split("/")[0]


def _hf_model() -> Any:
    """Mixtral itself (``save_pretrained``'s names), with its load-balancing loss."""
    return moe_zoo.build(ARCH, aux=True).model


def _start(ep: int, zero: bool = False) -> tuple[Any, Any, Any]:
    """``smp.init`` at ``ep`` over 4 rdp ranks (``zero``: with ZeRO-1): (model, optimizer,
    step function)."""
    import smp_fx as smp
    from smp_fx.world import state as smp_state

    smp_state._reset()
    smp.init({"pipeline_parallel_degree": 1, "ddp": True, "expert_parallel_degree": ep,
              "shard_optimizer_state": zero})
    model = smp.DistributedModel(_hf_model())
    opt = smp.DistributedOptimizer(OPTIMIZERS["adam"](model.parameters()))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        model.backward(_loss(model(input_ids=x).logits, y))

    return model, opt, train_step


def _steps(model: Any, opt: Any, train_step: Any, steps: range) -> None:
    import smp_fx as smp

    for step in steps:
        x, y = _batches()[step]
        opt.zero_grad()
        train_step(model, x[smp.rdp_rank():smp.rdp_rank() + 1],
                   y[smp.rdp_rank():smp.rdp_rank() + 1])
        model.clip_grad_norm_(MAX_NORM)
        opt.step()


def _body(folder: str, ref_state: dict[str, torch.Tensor]) -> dict[str, Any]:
    import torch.distributed as dist

    import smp_fx as smp

    dist.init_process_group("gloo")
    model, opt, train_step = _start(2)
    _steps(model, opt, train_step, range(2))
    smp.save_checkpoint(folder, "ep2", partial=True, model=model, optimizer=opt)
    full = (model.state_dict(), opt.state_dict())  # collective over the ep group
    if dist.get_rank() == 0:
        torch.save(full, f"{folder}/full.pt")
    dist.barrier()
    bad = {}
    model, opt, train_step = _start(2, zero=True)  # each slice's state on one edp rank
    _steps(model, opt, train_step, range(2))
    smp.save_checkpoint(folder, "ep2_zero", partial=True, model=model, optimizer=opt)
    bad["zero"] = optimizer_state_mismatches(opt.state_dict(), full[1], **TOL)
    model, opt, train_step = _start(4)
    smp.resume_from_checkpoint(folder, "ep2", partial=True)
    _steps(model, opt, train_step, range(2, 3))
    bad["ep4"] = state_dict_mismatches(model.state_dict(), ref_state, **TOL)
    model, opt, train_step = _start(4, zero=True)
    smp.resume_from_checkpoint(folder, "ep2_zero", partial=True)
    _steps(model, opt, train_step, range(2, 3))
    bad["zero_ep4"] = state_dict_mismatches(model.state_dict(), ref_state, **TOL)
    model, opt, train_step = _start(1)
    model_sd, opt_sd = torch.load(f"{folder}/full.pt", weights_only=True)
    model.load_state_dict(model_sd)
    opt.load_state_dict(opt_sd)
    _steps(model, opt, train_step, range(2, 3))
    bad["ep1"] = state_dict_mismatches(model.state_dict(), ref_state, **TOL)
    return bad


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_ep2_checkpoints_load_at_ep4_and_ep1(tmp_path: Any) -> None:
    import transformers

    from smp_fx.cli.checkpoint import export

    want = {k.removeprefix("model."): v for k, v in _reference(CASE, 4)["state"].items()}
    results = run_ranks(_body, 4, str(tmp_path), want, timeout=400)
    assert results == [{"zero": [], "ep4": [], "zero_ep4": [], "ep1": []}] * 4, results
    plain = _hf_model()  # the full files in the plain model and optimizer
    opt = OPTIMIZERS["adam"](plain.parameters())
    model_sd, opt_sd = torch.load(tmp_path / "full.pt", weights_only=True)
    plain.load_state_dict(model_sd)
    opt.load_state_dict(opt_sd)
    x, y = _batches()[2]
    with torch.no_grad():
        logits = plain(input_ids=x).logits
    cfg = moe_zoo.config(ARCH, architectures=["MixtralForCausalLM"])
    cfg.save_pretrained(tmp_path / "config")
    line = export(str(tmp_path / "ep2_partial"), str(tmp_path / "hf"), str(tmp_path / "config"))
    assert "saved at pp=1 tp=1" in line, line
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, logits, **TOL)
    opt.zero_grad()
    _loss(plain(input_ids=x).logits, y).backward()
    torch.nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM)
    opt.step()
    assert state_dict_mismatches(plain.state_dict(), want, **TOL) == []

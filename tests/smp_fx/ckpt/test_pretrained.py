"""``from_pretrained`` under ``smp.delay_param_initialization``: built on meta (buffers
computed for real), each rank reads only its own stage's tensors from the safetensors
files, and the model computes what the plain ``from_pretrained`` model computes; at pp = 2
on 2 processes each rank's memory grows by its stage, not by the model (measured)."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import pytest
import torch

import smp_fx as smp
from smp_fx.ckpt.pretrained import PRETRAINED_ATTR, SafetensorsState
from smp_fx.world import state
from tests.helpers.dist import run_ranks

transformers = pytest.importorskip("transformers")


def _save_gpt2(folder: Path, n_embd: int = 32, n_layer: int = 2, vocab: int = 64) -> None:
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=n_embd,
                                  n_layer=n_layer, n_head=4, use_cache=False,
                                  attn_implementation="eager")
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    @smp.step
    def forward(model: Any, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids).logits

    with torch.no_grad():
        return forward(model, ids).concat()


def _ids(vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(3))


def test_in_process_pp2_equals_plain_from_pretrained(tmp_path: Path) -> None:
    _save_gpt2(tmp_path)
    state._reset()
    try:
        smp.init({"partitions": 2, "microbatches": 2})
        with smp.delay_param_initialization():
            model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
        assert all(p.is_meta for p in model.parameters()) and not model.training
        assert model.lm_head.weight is model.transformer.wte.weight
        assert getattr(model, PRETRAINED_ATTR) == (str(tmp_path / "model.safetensors"),)
        got = _logits(smp.DistributedModel(model), _ids())
    finally:
        state._reset()
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)(input_ids=_ids()).logits
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    # outside the context from_pretrained is transformers' own again
    assert not any(p.is_meta for p in transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path).parameters())


def test_safetensors_state_reads_on_demand(tmp_path: Path) -> None:
    _save_gpt2(tmp_path)
    lazy = SafetensorsState([str(tmp_path / "model.safetensors")])
    assert "transformer.wte.weight" in lazy and "lm_head.weight" not in lazy  # tied: once
    assert lazy["transformer.wte.weight"].shape == (64, 32)
    bare = tmp_path / "config_only"
    bare.mkdir()
    (bare / "config.json").write_text((tmp_path / "config.json").read_text())
    with pytest.raises(smp.SMPCheckpointError, match="there are none"):
        with smp.delay_param_initialization():
            transformers.AutoModelForCausalLM.from_pretrained(bare)


def _rank_body(folder: str, small: str) -> dict[str, Any]:
    import transformers as tf

    from smp_fx.ckpt import pretrained

    read: list[int] = []
    original = pretrained.SafetensorsState.__getitem__

    def counted(self: Any, name: str) -> torch.Tensor:  # the bytes this rank reads
        value = original(self, name)
        read.append(value.numel() * value.element_size())
        return value

    pretrained.SafetensorsState.__getitem__ = counted  # type: ignore[method-assign]
    smp.init({"partitions": 2, "microbatches": 2})
    # a first model of a few kilobytes takes the one-off costs of a first step (the
    # exporter's imports, the process groups, the transport's buffers) out of the figure
    with smp.delay_param_initialization():
        warm = tf.AutoModelForCausalLM.from_pretrained(small)
    _logits(smp.DistributedModel(warm), _ids())
    read.clear()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with smp.delay_param_initialization():
        model = tf.AutoModelForCausalLM.from_pretrained(folder)
    dm = smp.DistributedModel(model)
    logits = _logits(dm, _ids(vocab=1024))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    held = {t.data_ptr(): t.numel() * t.element_size()
            for t in (*model.parameters(), *model.buffers(), *dm.local_parameters(),
                      *dm.local_buffers()) if not t.is_meta}
    return {"grown": grown, "held": sum(held.values()), "read": sum(read),
            "logits": logits.tolist()}  # plain values: the process ends before the test
    # could read a shared tensor


@pytest.mark.multiproc
def test_pp2_ranks_hold_and_read_their_stage_only(tmp_path: Path) -> None:
    """On each of 2 ranks: the bytes read from the files and the bytes of tensors held
    (the wrapped model's and the stage's) are the stage's, and peak resident memory grows,
    from before ``from_pretrained`` to after the first step, by less than the model."""
    big, small = tmp_path / "big", tmp_path / "small"
    _save_gpt2(big, n_embd=512, n_layer=8, vocab=1024)  # 26 M parameters, 100 MB
    _save_gpt2(small)
    full = transformers.AutoModelForCausalLM.from_pretrained(big)
    full_bytes = sum(t.numel() * t.element_size() for t in full.state_dict().values())
    ranks = run_ranks(_rank_body, 2, str(big), str(small), timeout=240)
    want = full(input_ids=_ids(vocab=1024)).logits.detach()
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["logits"]), want, rtol=1e-5, atol=1e-5)
        # its stage: half the layers, and the small tied embedding (on both stages)
        assert 0.4 * full_bytes < r["read"] < 0.6 * full_bytes, (r["read"], full_bytes)
        assert r["held"] <= r["read"] + 2 ** 20, (r["held"], r["read"])  # + small buffers
        # the stage plus what a first step costs (the trace, the transport): not the model
        assert r["grown"] < 0.9 * full_bytes, (r["grown"], full_bytes)
    assert sum(r["read"] for r in ranks) < 1.1 * full_bytes  # each tensor read once
    mb = 2 ** 20
    print(f"\npp=2 from_pretrained of a {full_bytes / mb:.0f} MB model, per rank: read "
          f"{[round(r['read'] / mb) for r in ranks]} MB, held "
          f"{[round(r['held'] / mb) for r in ranks]} MB, peak RSS grew "
          f"{[round(r['grown'] / mb) for r in ranks]} MB")

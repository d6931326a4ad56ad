"""The structures Hugging Face transformers have, sharded at tp=2 on 2 gloo ranks.

One spawn of 2 ranks trains every case (``smp.reset`` between them) through the SMP API
(``prescaled_batch: true``, ``ddp: true``, the default ``optimize: "memory"``): 3 SGD
steps of the tiny model of ``examples/models/hf_zoo.py``, marked whole, against one
process training the plain model on the same batch. Every rank checks every gradient at
every step (shards all-gathered, 1e-5), the full ``state_dict()`` after the steps (the
plain model's names, order and values), that the plan's parameter bytes are what the rank
holds (shards and replicated parameters), and the shard shapes the structure implies
(hidden 64, 4 heads of 16, tp=2):

* fused projections: Phi-3's ``qkv_proj`` cut by slices and ``gate_up_proj`` by ``chunk``
  (strided: each block split alike), GPT-NeoX's and BLOOM's ``query_key_value``
  interleaved per head (a plain split: each rank its heads' q, k and v), GPT-2's
  ``Conv1D`` ``c_attn`` (an ``(in, out)`` weight, strided by 3);
* one kv head (Gemma): ``k_proj`` / ``v_proj`` are lone (sharded, output gathered) and
  each rank attends with all of it;
* per-head q/k norms (Qwen3) and full-width ones (OLMo-2: a mean over the split
  features completed by an all-reduce); parallel attention and MLP (GPT-J, whose rotary
  interleaves with ``stack``);
* ALiBi (BLOOM: the bias cut to each rank's heads of every example of the merged
  ``(b * heads)`` dim); relative position biases (T5's embedding split by buckets, each
  rank adding its heads; DeBERTa-v2's disentangled attention, its relative embeddings
  projected by the same linears per head and gathered per position);
* encoder-decoder with cross-attention (T5); MoE experts (Mixtral: ``grouped_mm`` over
  ``(experts, out, in)`` weights, gate/up strided; the router lone);
* embeddings with ``padding_idx`` (OPT: the padding row's gradient stays zero on the rank
  that holds it); layers shared across depth (ALBERT: one shard, both calls);
* ``prescaled_batch: false`` (each tp rank its own examples, SMP's default): MoE experts
  kept whole with the reason, the rest sharded; ALBERT's shared layer, whose norm one call
  reads in a sequence-chunked region and the other whole; both equal to one process;
* vision transformers: ViT (a convolution's patches, a class token and position
  embeddings, replicated), Swin (shifted-window attention whose relative position bias
  table, replicated, each rank indexes for its heads; patch merging's reduction, lone
  between the stages' widths).
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

import pytest
import torch

from examples.models import hf_zoo
from tests.helpers import zoo
from tests.helpers.compare import mismatched, state_dict_mismatches
from tests.helpers.dist import run_ranks
from tests.smp_fx.parallel.test_tensor_parallel import _gathered

BATCH, STEPS, LR = 4, 3, 0.1
TOL = {"atol": 1e-5, "rtol": 1e-5}
# arch -> {local parameter name: its shape on each rank at tp=2}
SHAPES: dict[str, dict[str, tuple[int, ...]]] = {
    "phi3": {"model.model.layers.0.self_attn.qkv_proj.weight": (96, 64),
             "model.model.layers.0.mlp.gate_up_proj.weight": (128, 64),
             "model.model.layers.0.self_attn.o_proj.weight": (64, 32)},
    "gpt_neox": {"model.gpt_neox.layers.0.attention.query_key_value.weight": (96, 64),
                 "model.gpt_neox.layers.0.attention.dense.weight": (64, 32)},
    "bloom": {"model.transformer.h.0.self_attention.query_key_value.weight": (96, 64),
              "model.transformer.word_embeddings.weight": (64, 64)},
    "gpt2": {"model.transformer.h.0.attn.c_attn.weight": (64, 96),
             "model.transformer.h.0.attn.c_proj.weight": (32, 64)},
    "gemma": {"model.model.layers.0.self_attn.k_proj.weight": (8, 64),
              "model.model.layers.0.self_attn.q_proj.weight": (32, 64)},
    "qwen3": {"model.model.layers.0.self_attn.q_norm.weight": (16,),
              "model.model.layers.0.self_attn.q_proj.weight": (32, 64)},
    "olmo2": {"model.model.layers.0.self_attn.q_norm.weight": (64,),
              "model.model.layers.0.self_attn.k_proj.weight": (32, 64)},
    "gptj": {"model.transformer.h.0.attn.q_proj.weight": (32, 64),
             "model.transformer.h.0.mlp.fc_out.weight": (64, 128)},
    "t5": {"model.encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight":
           (4, 4), "model.decoder.block.0.layer.1.EncDecAttention.k.weight": (32, 64)},
    "deberta_v2": {"model.deberta.encoder.layer.0.attention.self.pos_key_proj.weight":
                   (32, 64)},
    "mixtral": {"model.model.layers.0.mlp.experts.gate_up_proj": (4, 128, 64),
                "model.model.layers.0.mlp.experts.down_proj": (4, 64, 64),
                "model.model.layers.0.mlp.gate.weight": (2, 64)},
    "opt": {"model.model.decoder.embed_tokens.weight": (64, 64)},
    "albert": {"model.albert.encoder.albert_layer_groups.0.albert_layers.0.attention.query"
               ".weight": (32, 64)},
    "vit": {"model.vit.layers.0.attention.q_proj.weight": (32, 64),
            "model.vit.layers.0.mlp.fc2.weight": (64, 128),
            "model.vit.embeddings.cls_token": (1, 1, 64)},
    "swin": {"model.swin.encoder.layers.0.blocks.0.attention.q_proj.weight": (16, 32),
             "model.swin.encoder.layers.0.blocks.0.attention.relative_position_bias"
             ".relative_position_bias_table": (49, 4),
             "model.swin.encoder.layers.0.downsample.reduction.weight": (32, 128)},
}
# arch -> (pairs, lone linears) the plan must have at least / exactly
PAIRS = {"phi3": 4, "gpt_neox": 4, "bloom": 4, "gpt2": 4, "gemma": 6, "qwen3": 10,
         "olmo2": 10, "gptj": 8, "t5": 22, "deberta_v2": 12, "mixtral": 8, "opt": 8,
         "albert": 8, "vit": 8, "swin": 8}


def _batches(arch: str) -> list[zoo.Batch]:
    return zoo.batches(arch, BATCH, STEPS)


def _reference(arch: str) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    return zoo.sgd_reference(arch, BATCH, STEPS, LR)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


OWN_BATCH = ("mixtral/own-batch", "albert/own-batch")
"""Cases with ``prescaled_batch: false`` (SMP's default: each tp rank its own examples):
Mixtral, whose experts' row groups are each rank's own routed tokens (they stay whole), and
ALBERT, whose shared layer's norm is read by a sequence-chunked op in one call and a whole
one in the other (both stay whole)."""


def _case(arch: str, ref_grads: list[dict[str, torch.Tensor]],
          ref_state: dict[str, torch.Tensor]) -> dict[str, Any]:
    import smp_fx as smp

    log = logging.getLogger("smp_fx.parallel.tensor_parallel")
    lines = _Lines()
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    prescaled = arch not in OWN_BATCH
    arch = arch.split("/")[0]
    smp.init({"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2, "ddp": True,
              "prescaled_batch": prescaled, "microbatches": 1})
    model = smp.DistributedModel(hf_zoo.build(arch))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(model: Any, x: tuple[torch.Tensor, ...], y: torch.Tensor) -> Any:
        loss = hf_zoo.loss_fn(model(*x), y)
        model.backward(loss)
        return loss

    bad: list[str] = []
    share = BATCH if prescaled else BATCH // smp.dp_size()
    mine = slice(0, BATCH) if prescaled else slice(smp.dp_rank() * share,
                                                   (smp.dp_rank() + 1) * share)
    for step, (x, y) in enumerate(_batches(arch)):
        opt.zero_grad()
        train_step(model, tuple(t[mine] for t in x), y[mine])
        grads = _gathered(model, {n: p.grad for n, p in model.local_named_parameters()
                                  if p.grad is not None})
        bad += [f"grad {n} step {step}" for n in mismatched(grads, ref_grads[step], **TOL)]
        opt.step()
    bad += state_dict_mismatches(model.state_dict(), ref_state, **TOL)
    held = {id(t): t.numel() * t.element_size() for t in model.local_parameters()}
    assert model.tp_plan is not None and model.plan is not None
    coverage = model.tp_coverage()
    assert coverage is not None
    log.removeHandler(lines)
    result = {"bad": bad, "plan_bytes": model.plan.stages[0].memory.params,
              "reports": [ln for ln in lines.lines if "parameter elements sharded" in ln],
              "held_bytes": sum(held.values()), "pairs": len(model.tp_plan.pairs),
              "replicated": list(model.tp_plan.replicated), "share": coverage.share,
              "shapes": {n: tuple(p.shape) for n, p in model.local_named_parameters()}}
    smp.reset()
    return result


def _body(path: str) -> dict[str, dict[str, Any]]:
    refs = torch.load(path, weights_only=True)
    return {arch: _case(arch, *ref) for arch, ref in refs.items()}


_RESULTS: list[dict[str, dict[str, Any]]] = []
_OWN: list[dict[str, dict[str, Any]]] = []


def _own_batch_results() -> list[dict[str, dict[str, Any]]]:
    """``OWN_BATCH``'s cases in a spawn of their own (another ``smp.init`` configuration)."""
    if not _OWN:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "refs.pt")
            torch.save({case: _reference(case.split("/")[0]) for case in OWN_BATCH}, path)
            _OWN.extend(run_ranks(_body, 2, path, timeout=600,
                                  env={"SMP_FX_DEVICE_SPEC": "a100"}))
    return _OWN


def _results() -> list[dict[str, dict[str, Any]]]:
    """One spawn of 2 ranks for every case (a built-in device spec: measuring is slow);
    the references go by file (too many tensors to hand to a process)."""
    if not _RESULTS:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "refs.pt")
            refs = {arch: _reference(arch) for arch in SHAPES}
            torch.save(refs, path)
            _RESULTS.extend(run_ranks(_body, 2, path, timeout=600,
                                      env={"SMP_FX_DEVICE_SPEC": "a100"}))
    return _RESULTS


@pytest.mark.multiproc
@pytest.mark.timeout(700)  # the first parameter runs the 13-model spawn (run_ranks: 600 s)
@pytest.mark.parametrize("arch", list(SHAPES))
def test_structure_matches_one_process_with_its_shards(arch: str) -> None:
    for rank, results in enumerate(_results()):
        r = results[arch]
        assert r["bad"] == [], f"rank {rank}: {r['bad']}"
        assert r["replicated"] == [], r["replicated"]
        assert r["share"] >= 0.9 and r["pairs"] == PAIRS[arch], (r["share"], r["pairs"])
        assert r["plan_bytes"] == r["held_bytes"], (r["plan_bytes"], r["held_bytes"])
        # the coverage report, logged once, on rank 0
        assert len(r["reports"]) == (1 if rank == 0 else 0), r["reports"]
        assert f"{r['share']:.1%}" in (r["reports"] or [""])[0] or rank
        for name, shape in SHAPES[arch].items():
            assert r["shapes"].get(name) == shape, (name, r["shapes"].get(name))


@pytest.mark.multiproc
@pytest.mark.timeout(700)
def test_experts_stay_whole_when_each_tp_rank_has_its_own_examples() -> None:
    for rank, results in enumerate(_own_batch_results()):
        r = results[OWN_BATCH[0]]
        assert r["bad"] == [], f"rank {rank}: {r['bad']}"
        whole = dict(r["replicated"])
        assert sorted(whole) == ["model.model.layers.0.mlp.experts",
                                 "model.model.layers.1.mlp.experts"], whole
        assert all("prescaled_batch true" in why for why in whole.values())
        assert r["pairs"] == PAIRS["mixtral"] - 2  # the attention's pairs stay


@pytest.mark.multiproc
@pytest.mark.timeout(700)
def test_a_shared_layer_read_chunked_and_whole_equals_one_process() -> None:
    for rank, results in enumerate(_own_batch_results()):
        r = results[OWN_BATCH[1]]
        assert r["bad"] == [], f"rank {rank}: {r['bad']}"
        assert r["replicated"] == [] and r["pairs"] == PAIRS["albert"], r

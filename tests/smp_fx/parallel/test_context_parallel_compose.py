"""Context parallelism composed with the other parallelisms, on 4 gloo ranks, against one
process: Hugging Face models from tiny configs at sequence 128 (``test_context_parallel_hf``'s
models, batches and training), one spawn going through every configuration in turn:

* cp 2 x tp 2, Qwen2 (grouped-query attention with biases): tensor parallelism's rewrite
  and then context parallelism's on one graph; the keys and values gathered over cp are
  the rank's own heads, gathered before their repeat;
* cp 2 x pp 2, GPT-NeoX (partial RoPE): 2 microbatches, each stage's activations the
  rank's tokens, the last stage's outputs gathered over cp; then under the other
  schedules: ``simple`` and ``zero_bubble`` (its split backward) on GPT-NeoX, ``zbv`` and
  interleaved 1F1B at 2 virtual stages per rank on Llama;
* cp 2 x sdp 2, Mistral (a sliding window of 32 tokens, shorter than the sequence, so it
  crosses the chunks): gradients reduce-scattered over dp, their shards summed over cp;
* cp 2 x rdp 2 with ZeRO-1 (``shard_optimizer_state``) and activation checkpointing of
  every decoder layer, Llama;
* cp 4 alone, 8 chunks of 16 tokens, rank r holding chunks r and 7 - r: Llama, Qwen2,
  Mistral (the window of 32 tokens spans three chunks), GPT-NeoX, GPT-2 and BERT (its
  second example padded after 100 tokens: rank 0's chunk 7 is all padding).

Loss of the global batch and every (whole) gradient at each of 3 Adam steps
(``test_context_parallel_hf.adam``: why its eps is 1e-6), and
``state_dict()`` after them, within 1e-5 (fp32).
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.smp_fx.parallel.test_context_parallel_hf import differences, join_world, reference

CP = {"pipeline_parallel_degree": 1, "context_parallel_degree": 2, "ddp": True}
SCHEDULES = (("simple", 1, "gpt_neox"), ("zero_bubble", 1, "gpt_neox"), ("zbv", 2, "llama"),
             ("interleaved", 2, "llama"))
"""The other schedules at cp 2 x pp 2: (``pipeline``, virtual stages per rank, model)."""
CP4 = ("llama", "qwen2", "mistral", "gpt_neox", "gpt2", "bert")
"""The architectures run at cp 4 alone."""
# name -> (architecture, configuration, decoder layers checkpointed)
CASES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "tp": ("qwen2", {**CP, "tensor_parallel_degree": 2}, False),
    "pp": ("gpt_neox", {**CP, "pipeline_parallel_degree": 2, "microbatches": 2}, False),
    **{f"pp {sched}": (arch, {**CP, "pipeline_parallel_degree": 2, "microbatches": 2,
                              "pipeline": sched, "virtual_pipeline_degree": v}, False)
       for sched, v, arch in SCHEDULES},
    "sdp": ("mistral", {**CP, "sharded_data_parallel_degree": 2,
                        "sdp_param_persistence_threshold": 100}, False),
    "zero": ("llama", {**CP, "shard_optimizer_state": True}, True),
    **{f"cp4 {arch}": (arch, {**CP, "context_parallel_degree": 4}, False) for arch in CP4},
}


def _one(name: str, ref: Any) -> list[str]:
    import smp_fx as smp

    arch, config, checkpointed = CASES[name]
    bad, model, _ = differences(arch, ref, config, checkpointed)
    bad = [f"{name}: {m}" for m in bad]
    if smp.cp_size() != config["context_parallel_degree"]:
        bad.append(f"{name}: cp_size {smp.cp_size()}")
    if name == "tp" and (model.tp_plan is None or not model.tp_plan.pairs):
        bad.append("tp: nothing sharded over tp")
    if name == "sdp" and not any(hasattr(p, "full_tensor") for p in model.local_parameters()):
        bad.append("sdp: no parameter sharded")
    return bad


def _all(packed: bytes) -> list[str]:
    join_world()
    refs = torch.load(io.BytesIO(packed))
    return [m for name in CASES for m in _one(name, refs[CASES[name][0]])]


@pytest.mark.multiproc
@pytest.mark.timeout(600)  # ten runs traced on 4 ranks: 88-113 s at load 7-19 on 2 cores
def test_cp_composed_with_tp_pp_sdp_zero_checkpointing_and_cp4_match_one_process() -> None:
    buf = io.BytesIO()
    torch.save({arch: reference(arch) for arch in {a for a, _, _ in CASES.values()}}, buf)
    results = run_ranks(_all, 4, buf.getvalue(), timeout=550,
                        env={"SMP_FX_DEVICE_SPEC": "a100"})
    assert results == [[]] * 4, results

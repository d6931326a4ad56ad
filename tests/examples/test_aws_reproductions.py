"""Three more of AWS's SMP examples, reproduced: each scenario makes the example's SMP calls
with its arguments (written here, no AWS code), at small size on CPU, on two ranks, and
its losses equal one process training the same model on the same batches (rtol 1e-5).

* ``bert``: the BERT pretraining script (SMP 1.x): ``smp.init()`` from
  ``SM_HP_MP_PARAMETERS`` (``partitions`` 2, ``overlapping_allreduce`` as a key), the
  private ``torch.utils.rmsg`` and ``smp.nn.FusedLayerNorm`` imported under SMP's names,
  ``smp.optimizers.FusedLAMB`` wrapped in ``smp.DistributedOptimizer`` with a warm-up
  schedule, an ``@smp.step`` function taking the script's non-tensor arguments (args,
  device, optimizer, criterion, step), ``model.to(device)`` after wrapping, the loss of
  masked-LM plus next-sentence heads; then ``smp.save`` / ``smp.load`` of the partial
  checkpoint the script writes.
* ``gptj``: the GPT-J tensor-parallel script (SMP 1.10-1.x): ``smp.model_creation`` with the
  script's kernel switches around a Hugging Face ``GPTJForCausalLM``, which wrapping
  replaces by SMP's distributed GPT-J (the script's default ``--use_distributed_transformer
  1``), tp=2 with ``prescaled_batch``, the layers found at
  ``model.module.module.transformer.seq_layers``, ``smp.DistributedOptimizer(opt,
  static_loss_scale=None, dynamic_loss_scale=True, dynamic_loss_args=...)``,
  ``optimizer.zero_grad(set_to_none=True)``.
* ``sdp``: a ``train.py`` of the 1.11-1.15 family with sharded data parallelism (degree 2):
  ``smp.model_creation`` with ``zero_init``, ``distribute_embedding``, ``use_alibi``,
  ``flash_attention``, ``fp32_residual_addition``; ``skip_tracing``; gradient accumulation
  (``backward_passes_per_step`` 2, two steps per ``optimizer.step()``); the dp-averaged loss
  and ``optimizer._global_grad_norm`` as the script logs them. Each rank trains on its half
  of the batch; the reference on the whole batch with the same accumulation and clipping.
  ``sdp_utils.py``'s DeepSpeed-style calls in the script's order (offsets from
  ``ds_tensor.ds_numel`` before the optimizer, buffers from
  ``fp32_partitioned_groups_flat`` before the first step, ``log_param_norms`` after
  training) give the reference's parameter norms; a partial ``smp.save_checkpoint``
  consolidated by ``sharded_data_parallel_checkpoint.py``'s reading equals its state.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from argparse import Namespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tests.helpers.dist import run_ranks

STEPS = 3
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _shim_smp() -> Any:
    """``import smdistributed.modelparallel.torch as smp``, as the scripts do."""
    from smp_fx._compat import SHIM_DIR

    if str(SHIM_DIR) not in sys.path:
        sys.path.insert(0, str(SHIM_DIR))
    import smdistributed.modelparallel.torch as smp

    return smp


# ---- BERT pretraining (SMP 1.x) ----------------------------------------------------------
class TinyBert(nn.Module):
    """A BERT for pretraining of two post-layer-norm encoder layers, masked-LM head tied to
    the word embedding and a next-sentence head (the script's ``modeling.py`` shape)."""

    def __init__(self, layer_norm: type[nn.Module], vocab: int = 32, width: int = 16,
                 heads: int = 2, layers: int = 2, seq: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.word = nn.Embedding(vocab, width)
        self.position = nn.Embedding(seq, width)
        self.token_type = nn.Embedding(2, width)
        self.embed_norm = layer_norm(width)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"qkv": nn.Linear(width, 3 * width), "out": nn.Linear(width, width),
                           "norm1": layer_norm(width), "fc1": nn.Linear(width, 2 * width),
                           "fc2": nn.Linear(2 * width, width), "norm2": layer_norm(width)})
            for _ in range(layers))
        self.mlm_transform = nn.Linear(width, width)
        self.mlm_bias = nn.Parameter(torch.zeros(vocab))
        self.nsp = nn.Linear(width, 2)
        self.checkpointing = False

    def checkpoint_activations(self, value: bool) -> None:
        """The script's switch on its own model (called with False here)."""
        self.checkpointing = value

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device)
        x = self.embed_norm(self.word(input_ids) + self.position(positions)
                            + self.token_type(token_type_ids))
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
        d = x.shape[-1] // self.heads
        for layer in self.layers:
            q, k, v = layer["qkv"](x).view(n, s, 3, self.heads, d).permute(2, 0, 3, 1, 4)
            probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + bias, dim=-1)
            ctx = (probs @ v).transpose(1, 2).reshape(n, s, -1)
            x = layer["norm1"](x + layer["out"](ctx))
            x = layer["norm2"](x + layer["fc2"](torch.nn.functional.gelu(layer["fc1"](x))))
        scores = self.mlm_transform(x) @ self.word.weight.t() + self.mlm_bias
        return scores, self.nsp(x[:, 0])


class PretrainingCriterion(nn.Module):
    """Masked-LM cross entropy (labels -1 ignored) plus next-sentence cross entropy."""

    def forward(self, scores: torch.Tensor, nsp: torch.Tensor, mlm_labels: torch.Tensor,
                nsp_labels: torch.Tensor) -> torch.Tensor:
        ce = nn.CrossEntropyLoss(ignore_index=-1)
        return ce(scores.flatten(0, 1), mlm_labels.flatten()) + ce(nsp, nsp_labels)


def _bert_batches() -> list[tuple[torch.Tensor, ...]]:
    """Batches of 4 sequences of 8; two masked positions in every sequence (so the masked-LM
    mean of each microbatch weighs its tokens as the whole batch's mean does)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 32, (4, 8), generator=g)
        segments = torch.cat([torch.zeros(4, 4), torch.ones(4, 4)], 1).long()
        mask = torch.ones(4, 8, dtype=torch.long)
        labels = torch.full((4, 8), -1)
        labels[:, 2], labels[:, 5] = ids[:, 2], ids[:, 5]
        out.append((ids, segments, mask, labels, torch.randint(0, 2, (4,), generator=g)))
    return out


def _grouped(named: list[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    no_decay = ("bias", "norm")
    return [{"params": [p for n, p in named if not any(k in n for k in no_decay)],
             "weight_decay": 0.01},
            {"params": [p for n, p in named if any(k in n for k in no_decay)],
             "weight_decay": 0.0}]


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 2)


def _bert_reference() -> list[float]:
    from smp_fx.nn import FusedLayerNorm
    from smp_fx.optimizers import FusedLAMB

    torch.manual_seed(0)
    model = TinyBert(FusedLayerNorm)
    opt = FusedLAMB(_grouped(list(model.named_parameters())), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
    losses = []
    for ids, seg, mask, labels, nsp in _bert_batches():
        scores, rel = model(ids, seg, mask)
        loss = PretrainingCriterion()(scores, rel, labels, nsp)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _bert_rank(folder: str) -> dict[str, Any]:
    os.environ["SM_HP_MP_PARAMETERS"] = json.dumps({
        "partitions": 2, "microbatches": 2, "placement_strategy": "spread",
        "pipeline": "interleaved", "optimize": "speed", "ddp": True,
        "overlapping_allreduce": True})
    smp = _shim_smp()
    from smdistributed.modelparallel.torch.nn import FusedLayerNorm as BertLayerNorm
    from smdistributed.modelparallel.torch.optimizers import FusedLAMB
    from smdistributed.modelparallel.torch.utils import rmsg

    smp.init()
    torch.cuda.set_device = lambda *a: None  # the script's GPU call; nothing on a CPU
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = TinyBert(BertLayerNorm)
    model.checkpoint_activations(False)
    model = smp.DistributedModel(model)
    model.to(device)
    optimizer = FusedLAMB(_grouped(list(model.named_parameters())), lr=1e-2)
    optimizer = smp.DistributedOptimizer(optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup)
    criterion = PretrainingCriterion()
    args = Namespace(n_gpu=1, fp16=False, smp=1)

    @smp.step
    def smp_step(args: Any, device: Any, input_ids: torch.Tensor, segment_ids: torch.Tensor,
                 input_mask: torch.Tensor, masked_lm_labels: torch.Tensor,
                 next_sentence_labels: torch.Tensor, model: Any, optimizer: Any,
                 criterion: Any, step: int) -> torch.Tensor:
        scores, rel = model(input_ids=input_ids, token_type_ids=segment_ids,
                            attention_mask=input_mask)
        loss = criterion(scores, rel, masked_lm_labels, next_sentence_labels)
        model.backward(loss)
        return loss

    losses = []
    for step, batch in enumerate(_bert_batches()):
        batch = tuple(t.to(device) for t in batch)
        loss_mbs = smp_step(args, device, *batch, model, optimizer, criterion, step)
        losses.append(loss_mbs.reduce_mean().item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    # the script's checkpoint: rank-local state of each pipeline stage, smp.save(partial)
    path = os.path.join(folder, "ckpt_3.pt")
    if smp.dp_rank() == 0:
        smp.save({"model": model.local_state_dict(), "optimizer": optimizer.local_state_dict(),
                  "files": [0]}, path, partial=True)
    smp.barrier()
    checkpoint = smp.load(path, partial=True)
    model.load_state_dict(checkpoint["model"], strict=False)
    reloaded = all(torch.equal(checkpoint["model"][n], p.detach())
                   for n, p in model.local_state_dict().items() if isinstance(p, torch.Tensor))
    return {"losses": losses, "reloaded": reloaded, "rmsg": rmsg("x"), "pp": smp.pp_size()}


# ---- GPT-J with tensor parallelism (SMP 1.10-1.x) -----------------------------------------
def _gptj_config() -> Any:
    from transformers import GPTJConfig

    return GPTJConfig(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                      rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      use_cache=False, attn_implementation="eager")


def _lm_batches(n: int, vocab: int = 64, seq: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n, seq), generator=g) for _ in range(STEPS * 2)]


def _decay_groups(module: nn.Module) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        (no_decay if name.endswith("bias") or "ln" in name or "layernorm" in name
         else decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def _gptj_reference() -> list[float]:
    from transformers import GPTJForCausalLM

    torch.manual_seed(0)
    model = GPTJForCausalLM(_gptj_config())
    opt = torch.optim.AdamW(_decay_groups(model), lr=1e-3, weight_decay=0.01)
    losses = []
    for ids in _lm_batches(4)[:STEPS]:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)["loss"]
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _gptj_rank() -> dict[str, Any]:
    smp = _shim_smp()
    from transformers import AutoModelForCausalLM

    smp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 1, "microbatches": 1,
              "ddp": True, "prescaled_batch": True, "optimize": "speed", "fp16": False,
              "bf16": False, "placement_strategy": "cluster", "auto_partition": True,
              "default_partition": 0, "shard_optimizer_state": False})
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=torch.float32,
                            attention_in_fp32=False, query_key_layer_scaling=True,
                            fused_softmax=True, fused_dropout=False, fused_bias_gelu=True):
        model = AutoModelForCausalLM.from_config(_gptj_config())
    model = smp.DistributedModel(model, trace_device="gpu", backward_passes_per_step=1)
    # the script's walk with its default --use_distributed_transformer 1 (fp16 off: m = model)
    layers = model.module.module.transformer.seq_layers
    optimizer = torch.optim.AdamW(_decay_groups(model.get_module()), lr=1e-3,
                                  weight_decay=0.01)
    optimizer = train_py_optimizer(smp, optimizer)

    train_step = train_py_step(smp)

    losses = []
    for ids in _lm_batches(4)[:STEPS]:
        optimizer.zero_grad(set_to_none=True)
        losses.append(train_step(model, ids, torch.ones_like(ids)).reduce_mean().item())
        optimizer.step()
    sharded = [n for n, p in model.local_named_parameters() if model.is_distributed_parameter(p)]
    return {"losses": losses, "layers": len(layers), "sharded": len(sharded),
            "plan": model.tp_plan.to_json() if model.tp_plan is not None else None}


# ---- train.py with sharded data parallelism (SMP 1.11-1.15) ------------------------------
def train_py_config(**changes: Any) -> dict[str, Any]:
    """``train.py``'s ``smp.init`` configuration at sdp 2 with skip_tracing, then
    ``changes`` (a notebook's hyperparameters)."""
    return {"ddp": True, "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1,
            "microbatches": 1, "shard_optimizer_state": False, "prescaled_batch": True,
            "fp16": False, "bf16": False, "offload_activations": False,
            "delayed_parameter_initialization": False, "optimize": "speed",
            "placement_strategy": "cluster", "activation_loading_horizon": 4,
            "skip_tracing": True, "auto_partition": True, "default_partition": 0,
            "static_mode": False, "fast_mode": False, "sharded_data_parallel_degree": 2,
            "ddp_dist_backend": "auto", "sdp_hierarchical_allgather": False,
            "sdp_gradient_clipping": 1.0,
            "sdp_param_persistence_threshold": 100,  # tiny: most parameters sharded
            **changes}


def train_py_optimizer(smp: Any, optimizer: torch.optim.Optimizer) -> Any:
    """The scripts' ``smp.DistributedOptimizer`` (dynamic loss scaling, their arguments)."""
    return smp.DistributedOptimizer(
        optimizer, static_loss_scale=None, dynamic_loss_scale=True,
        dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2})


def train_py_step(smp: Any) -> Any:
    """The scripts' ``@smp.step`` ``train_step``: the model's loss on ``labels=input_ids``."""

    @smp.step
    def train_step(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        loss = model(input_ids=input_ids, attention_mask=attention_mask,
                     labels=input_ids)["loss"]
        model.backward(loss)
        return loss

    return train_step


def _gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)


ACCUMULATE = 2
SDP_EPS = 1e-6
"""AdamW's eps in the sdp scenario: the key bias's gradient is zero but for rounding (a
query's logits all shift by q.b_k, which softmax ignores), and at eps 1e-8 Adam turns that
rounding, summed in another order over the shards, into steps of up to lr."""


def _sdp_reference() -> dict[str, Any]:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(_gpt2_config())
    opt = torch.optim.AdamW(_decay_groups(model), lr=1e-3, weight_decay=0.01, eps=SDP_EPS)
    losses, norms = [], []
    for i, ids in enumerate(_lm_batches(4)):
        if i % ACCUMULATE == 0:
            opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)["loss"]
        loss.backward()
        losses.append(loss.item())
        if (i + 1) % ACCUMULATE == 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    param_norms = {n: float(p.detach().norm()) for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "state": state, "param_norms": param_norms}


# sdp_utils.py's three functions, as the scripts call them (DeepSpeed ZeRO-3's names)
def _param_id_to_offset(param_groups: list[dict[str, Any]]) -> list[dict[int, Any]]:
    out = []
    for group in param_groups:
        offsets, offset = {}, 0
        for p in group["params"]:
            offsets[id(p)] = (offset, p.ds_tensor.ds_numel)
            offset += p.ds_tensor.ds_numel
        out.append(offsets)
    return out


def _param_id_to_buffer(optimizer: Any, offsets: list[dict[int, Any]]) -> dict[int, Any]:
    return {pid: optimizer.fp32_partitioned_groups_flat[i].narrow(0, start, size)
            for i, group in enumerate(offsets) for pid, (start, size) in group.items()}


def _log_param_norms(model: Any, optimizer: Any, buffers: dict[int, Any]
                     ) -> tuple[dict[str, float], dict[str, float]]:
    weight, other = {}, {}
    for name, param in model.named_parameters():
        fp32 = torch.linalg.norm(buffers[id(param)]) ** 2
        partition = torch.linalg.norm(param.ds_tensor.data) ** 2
        torch.distributed.all_reduce(fp32, group=optimizer.ds_param_shard_group)
        torch.distributed.all_reduce(partition, group=optimizer.ds_param_shard_group)
        weight[name] = torch.sqrt(fp32).item()
        other[name] = torch.sqrt(partition).item()
    return weight, other


def _consolidate(checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """sharded_data_parallel_checkpoint.py's reading: the folder ``newest`` names,
    ``optimizer_*.pt`` flat fp32 partitions, ``model_0.pt`` buffers, user_content shapes."""
    import glob

    with open(os.path.join(checkpoint_dir, "newest")) as fh:
        folder = os.path.join(checkpoint_dir, fh.read().strip())
    files = sorted(glob.glob(os.path.join(folder, "optimizer_*.pt")))
    states = [torch.load(f, weights_only=False) for f in files]
    size = states[0]["partition_count"]
    assert size == len(files)
    flat = [torch.cat(s["fp32_flat_groups"], 0) for s in states]
    module = torch.load(os.path.join(folder, "model_0.pt"), weights_only=False)["module"]
    content = torch.load(os.path.join(folder, "user_content.pt"), weights_only=False)
    out = {k: v for k, v in module.items() if k in content["buffer_names"]}
    shapes = {k: v for d in content["param_shapes"] for k, v in d.items()}
    offset = 0
    for name, shape in shapes.items():
        part = math.ceil(shape.numel() / size)
        whole = torch.cat([f.narrow(0, offset, part) for f in flat])
        out[name] = whole.narrow(0, 0, shape.numel()).view(shape)
        offset += part
    assert offset * size == flat[0].numel() * size
    return out


def _sdp_rank(folder: str) -> dict[str, Any]:
    smp = _shim_smp()
    from transformers import AutoModelForCausalLM

    smp.init(train_py_config())
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, zero_init=True,
                            dtype=torch.float32, distribute_embedding=False, use_alibi=False,
                            attention_in_fp32=False, fp32_residual_addition=False,
                            query_key_layer_scaling=False, fused_softmax=True,
                            fused_dropout=False, fused_bias_gelu=True, flash_attention=True):
        model = AutoModelForCausalLM.from_config(_gpt2_config())
    model = smp.DistributedModel(model, trace_device="gpu",
                                 backward_passes_per_step=ACCUMULATE)
    param_groups = _decay_groups(model.get_module())
    offsets = _param_id_to_offset(param_groups)
    optimizer = torch.optim.AdamW(param_groups, lr=1e-3, weight_decay=0.01, eps=SDP_EPS)
    optimizer = train_py_optimizer(smp, optimizer)
    buffers = _param_id_to_buffer(optimizer, offsets)

    train_step = train_py_step(smp)

    half = slice(2 * smp.dp_rank(), 2 * smp.dp_rank() + 2)
    losses, norms = [], []
    for i, ids in enumerate(_lm_batches(4)):
        if i % ACCUMULATE == 0:
            optimizer.zero_grad(set_to_none=True)
        loss = train_step(model, ids[half], torch.ones_like(ids[half])).reduce_mean()
        if (i + 1) % ACCUMULATE == 0:
            optimizer.step()
            norms.append(optimizer._global_grad_norm)
        detached = loss.detach()  # the script's log_reduced_training_loss
        torch.distributed.all_reduce(detached, group=smp.get_dp_process_group())
        losses.append(detached.item() / smp.dp_size())
    weight, other = _log_param_norms(model, optimizer, buffers)
    names = {p: n for n, p in model.module.named_parameters()}  # get_param_shapes' walk
    shapes = {names[p]: p.ds_shape for group in optimizer.fp16_groups for p in group}
    smp.save_checkpoint(folder, tag="total_steps4", partial=True, model=model,
                        optimizer=optimizer, user_content={"total_steps": 4})
    smp.barrier()
    return {"losses": losses, "norms": norms, "weight_norms": weight, "other_norms": other,
            "shapes": shapes,
            "sharded": sum(isinstance(p, DTensor) for p in model.local_parameters())}


# ---- the tests ------------------------------------------------------------------------------
@pytest.mark.multiproc
def test_bert_pretraining_script_pp2_equals_one_process() -> None:
    want = _bert_reference()
    with tempfile.TemporaryDirectory() as folder:
        results = run_ranks(_bert_rank, 2, folder, timeout=180)
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["losses"], want, **TOL)
        assert res["reloaded"] and res["pp"] == 2
        assert res["rmsg"] == f"[rank {rank} pp {rank} tp 0 rdp 0] x"


@pytest.mark.multiproc
def test_gptj_tensor_parallel_script_tp2_equals_one_process() -> None:
    want = _gptj_reference()
    for res in run_ranks(_gptj_rank, 2, timeout=180):
        torch.testing.assert_close(res["losses"], want, **TOL)
        assert res["layers"] == 2 and res["sharded"] > 0, res["plan"]


@pytest.mark.multiproc
def test_train_py_sharded_data_parallel_equals_one_process() -> None:
    want = _sdp_reference()
    with tempfile.TemporaryDirectory() as folder:
        results = run_ranks(_sdp_rank, 2, folder, timeout=180)
        consolidated = _consolidate(folder)
    for res in results:
        torch.testing.assert_close(res["losses"], want["losses"], **TOL)
        torch.testing.assert_close(res["norms"], want["norms"], **TOL)
        assert res["sharded"] > 0
        # sdp_utils.log_param_norms: fp32 partitions and ds_tensor, summed over the shards
        torch.testing.assert_close(res["weight_norms"], want["param_norms"], **TOL)
        torch.testing.assert_close(res["other_norms"], want["param_norms"], **TOL)
        assert res["shapes"] == {n: p.shape for n, p in want["state"].items()
                                 if n != "lm_head.weight"}
    # sharded_data_parallel_checkpoint.py's consolidation of SMP's DeepSpeed-named files
    # (the tied lm_head.weight is wte's: the script notes it loads with strict=False)
    assert set(want["state"]) - set(consolidated) == {"lm_head.weight"}, set(consolidated)
    torch.testing.assert_close(consolidated, {k: want["state"][k] for k in consolidated}, **TOL)

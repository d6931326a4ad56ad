"""GPT-2 trained the way AWS's SMP GPT-2 example trains it, on smp-fx.

AWS's example (``amazon-sagemaker-examples``, ``training/distributed_training/pytorch/
model_parallel/gpt2/train_gpt_simple.py`` and its notebook) is SMP v1's most-used real
client. This script is our own code making the same SMP calls with the same arguments and
feeding data the same way, so the test of that surface (``tests/examples/
test_gpt2_example.py``) needs nothing of AWS:

* ``smp.init`` with the example's configuration, SMP 1.11+ keys included (``bf16``,
  ``delayed_parameter_initialization``, ``static_mode``, ``fast_mode``, ...);
* ``smp.model_creation(tensor_parallelism=..., dtype=..., <kernel switches>)`` around
  ``AutoModelForCausalLM.from_config(GPT2Config(...))``: with ``--use_distributed_transformer
  1`` the model is replaced by SMP's ``DistributedTransformerLMHead`` when wrapped, and the
  script uses its structure (``get_module().transformer.seq_layers``);
* ``smp.DistributedModel(model, trace_device="gpu", backward_passes_per_step=...)``, the
  notebook's manual partition (``smp.set_partition`` on each transformer layer only, with
  ``auto_partition: false, default_partition: 0``), ``smp.set_activation_checkpointing``
  of the layers, ``smp.DistributedOptimizer(..., static_loss_scale=None,
  dynamic_loss_scale=True, dynamic_loss_args=...)``;
* data as gzipped JSON lines (``{"input_ids": [...], "attention_mask": [...]}``) read on
  pipeline rank 0 only, sharded by ``smp.dp_rank()`` (``rdp_rank`` with
  ``prescaled_batch``); the other pipeline ranks learn the number of batches through
  ``smp.broadcast`` / ``smp.recv_from`` and pass batches of empty tensors;
* ``smp.save_checkpoint(..., partial=True, user_content={cli args, GPT2Config, scheduler
  state, ...})`` and ``smp.resume_from_checkpoint`` with the example's resume logic.

Usage (``smp-fx run`` sets ``SM_HP_MP_PARAMETERS`` from ``--config``; the script's own
dictionary is what AWS's passes)::

    python examples/train_gpt2_smp.py --training-dir DATA --out OUT.json
    smp-fx run -n 2 examples/train_gpt2_smp.py --pipeline_parallel_degree 2 \\
        --manual_partition 1 --training-dir DATA --out OUT.json

It writes, on world rank 0, a JSON object with the loss of every step (``losses``: the mean
over the data-parallel group, i.e. the loss of the whole batch the replicas trained on)
and the steps they belong to (``steps``). ``--make_data DIR`` writes a synthetic data set there.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
from typing import Any

import torch
import torch.utils.data
from transformers import AutoModelForCausalLM, GPT2Config

import smp_fx as smp  # under `smp-fx run`: import smdistributed.modelparallel.torch as smp


class JsonLines(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Token ids and attention masks, one JSON object per line of gzipped files."""

    def __init__(self, paths: list[str], max_len: int) -> None:
        self.rows: list[str] = []
        for path in paths:
            with gzip.open(path, "rt") as fh:
                self.rows.extend(fh)
        self.max_len = max_len

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = json.loads(self.rows[i])
        ids = torch.tensor(row["input_ids"][:self.max_len], dtype=torch.long)
        return ids, torch.tensor(row["attention_mask"][:self.max_len], dtype=torch.long)


class Placeholders(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """What the pipeline ranks after the first read: empty tensors, as many as rank 0 has."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(0), torch.empty(0)


def data_loader(paths: list[str], batch: int, max_len: int, dp_rank: int,
                dp_size: int) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    if smp.pp_rank() == 0:
        data = JsonLines(paths, max_len)
        sampler = torch.utils.data.DistributedSampler(
            data, num_replicas=dp_size, rank=dp_rank, shuffle=False, drop_last=True)
        loader = torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler,
                                             drop_last=True)
        smp.broadcast(len(loader), smp.PP_GROUP)
        return loader
    batches = smp.recv_from(0, smp.RankType.PP_RANK)
    return torch.utils.data.DataLoader(Placeholders(batches * batch), batch_size=batch,
                                       drop_last=True)


class WarmupLinear:
    """Linear warm-up then linear decay of every group's learning rate; a plain-dict state."""

    def __init__(self, optimizer: Any, lr: float, warmup: int, total: int) -> None:
        self.optimizer, self.lr, self.warmup, self.total = optimizer, lr, warmup, total
        self.step_num = 0
        self.step(0)

    def step(self, n: int | None = None) -> None:
        self.step_num = self.step_num + 1 if n is None else n
        if self.warmup and self.step_num <= self.warmup:
            lr = self.lr * self.step_num / self.warmup
        else:
            lr = self.lr * max(0.0, (self.total - self.step_num) / self.total)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        return {"step_num": self.step_num, "lr": self.lr, "warmup": self.warmup,
                "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step(state["step_num"])


def weight_decay_groups(module: torch.nn.Module) -> list[dict[str, Any]]:
    """Biases and layer norms without weight decay, the rest with it (each tensor once)."""
    decay: list[torch.Tensor] = []
    plain: list[torch.Tensor] = []
    seen: set[int] = set()
    for sub in module.modules():
        for name, p in sub.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            norm = isinstance(sub, (torch.nn.LayerNorm, smp.nn.FusedLayerNorm))
            (plain if norm or name == "bias" else decay).append(p)
    return [{"params": decay}, {"params": plain, "weight_decay": 0.0}]


@smp.step
def train_step(model: Any, optimizer: Any, input_ids: torch.Tensor,
               attention_mask: torch.Tensor, args: Any) -> Any:
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
    model.backward(loss)
    return loss


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add = p.add_argument
    for name, default in (("train_batch_size", 4), ("max_steps", 5), ("seed", 12345),
                          ("checkpoint_freq", 10000), ("load_partial", 0),
                          ("max_context_width", 64), ("vocab_size", 256),
                          ("hidden_width", 64), ("num_layers", 4), ("num_heads", 4),
                          ("use_distributed_transformer", 1), ("tensor_parallel_degree", 1),
                          ("pipeline_parallel_degree", 1), ("microbatches", 2),
                          ("manual_partition", 0), ("prescaled_batch", 1),
                          ("activation_checkpointing", 1), ("gradient_accumulation", 1),
                          ("fp16", 0), ("bf16", 0), ("delayed_param", 0), ("same_seed", 0),
                          ("num_kept_checkpoints", 5)):
        add(f"--{name}", type=int, default=default)
    for name, default in (("lr", 1e-3), ("weight_decay", 0.01), ("beta1", 0.9),
                          ("beta2", 0.95), ("warmup", 0.2), ("dropout", 0.0)):
        add(f"--{name}", type=float, default=default)
    add("--activation_strategy", default="each")
    add("--optimize", default="speed")
    add("--training-dir", dest="training_dir", default="")
    add("--checkpoint-dir", dest="checkpoint_dir", default="")
    add("--out", default="")
    add("--make_data", default="")
    return p.parse_args()


def make_data(folder: str, rows: int = 96, seq: int = 64, vocab: int = 256) -> None:
    """Synthetic token ids in the example's format (one gzipped JSON lines file)."""
    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(7)
    with gzip.open(os.path.join(folder, "train_0.json.gz"), "wt") as fh:
        for _ in range(rows):
            ids = torch.randint(0, vocab, (seq,), generator=g).tolist()
            fh.write(json.dumps({"input_ids": ids, "attention_mask": [1] * seq}) + "\n")


def build(args: argparse.Namespace) -> tuple[Any, Any, Any, GPT2Config]:
    config = GPT2Config(
        vocab_size=args.vocab_size, n_positions=args.max_context_width,
        n_embd=args.hidden_width, n_layer=args.num_layers, n_head=args.num_heads,
        n_inner=None, activation_function="gelu_new", resid_pdrop=args.dropout,
        embd_pdrop=args.dropout, attn_pdrop=args.dropout, layer_norm_epsilon=1e-5,
        initializer_range=0.02, use_cache=False, bos_token_id=0, eos_token_id=0,
        return_dict=True)
    torch.manual_seed(args.seed)
    dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else \
        torch.get_default_dtype()
    with smp.model_creation(
            tensor_parallelism=smp.tp_size() > 1 or args.use_distributed_transformer > 0,
            dtype=dtype, attention_in_fp32=False, query_key_layer_scaling=not args.bf16,
            fused_softmax=True, fused_dropout=False, fused_bias_gelu=True):
        model = AutoModelForCausalLM.from_config(config)
    if torch.cuda.is_available():
        torch.cuda.set_device(smp.local_rank())
    if not args.same_seed:  # the example seeds each tensor-parallel rank apart
        torch.manual_seed(args.seed + smp.tp_rank())
    model = smp.DistributedModel(model, trace_device="gpu",
                                 backward_passes_per_step=args.gradient_accumulation)
    module = model.get_module()
    layers = module.transformer.seq_layers if args.use_distributed_transformer \
        else module.transformer.h
    if args.manual_partition:  # the notebook's: the layers only, evenly, the rest on 0
        div, rem = divmod(args.num_layers, smp.pp_size())
        ranks = [r for r in range(smp.pp_size())
                 for _ in range(div + 1 if r >= smp.pp_size() - rem else div)]
        for layer, rank in zip(layers.children(), ranks):
            smp.set_partition(layer, rank)
    optimizer = torch.optim.Adam(weight_decay_groups(module), lr=args.lr,
                                 betas=(args.beta1, args.beta2),
                                 weight_decay=args.weight_decay)
    if args.activation_checkpointing:
        if args.use_distributed_transformer or smp.tp_size() > 1:
            smp.set_activation_checkpointing(layers, strategy=args.activation_strategy)
        else:
            for layer in layers.children():
                smp.set_activation_checkpointing(layer)
    optimizer = smp.DistributedOptimizer(
        optimizer, static_loss_scale=None, dynamic_loss_scale=True,
        dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2})
    return model, optimizer, layers, config


def main() -> None:
    args = parse_args()
    if args.make_data:
        make_data(args.make_data)
        return
    smp.init({
        "ddp": True, "tensor_parallel_degree": args.tensor_parallel_degree,
        "pipeline_parallel_degree": args.pipeline_parallel_degree,
        "microbatches": args.microbatches, "shard_optimizer_state": False,
        "prescaled_batch": args.prescaled_batch > 0, "fp16": args.fp16 > 0,
        "bf16": args.bf16 > 0, "offload_activations": False,
        "delayed_parameter_initialization": args.delayed_param > 0,
        "optimize": args.optimize, "placement_strategy": "cluster",
        "activation_loading_horizon": 4, "skip_tracing": False,
        "auto_partition": not args.manual_partition, "default_partition": 0,
        "static_mode": False, "fast_mode": False, "sharded_data_parallel_degree": 1})
    model, optimizer, _, config = build(args)
    total = max(1, args.max_steps)
    scheduler = WarmupLinear(optimizer, args.lr, int(args.warmup * total), total)
    steps, start_batch = 0, 0
    if args.load_partial:
        user = smp.resume_from_checkpoint(args.checkpoint_dir, tag=None, partial=True)
        steps, start_batch = user["total_steps"], user["start_batch_index"]
        scheduler.load_state_dict(user["lr_scheduler"])
    dp_rank = smp.rdp_rank() if args.prescaled_batch else smp.dp_rank()
    dp_size = smp.rdp_size() if args.prescaled_batch else smp.dp_size()
    paths = sorted(os.path.join(args.training_dir, f) for f in os.listdir(args.training_dir)
                   if f.endswith(".json.gz"))
    loader = data_loader(paths, args.train_batch_size, args.max_context_width, dp_rank,
                         dp_size)
    record: dict[str, list[Any]] = {"steps": [], "losses": []}
    model.train()
    for batch, (input_ids, attention_mask) in enumerate(loader):
        if batch < start_batch:
            continue
        if steps >= args.max_steps:
            break
        if batch % args.gradient_accumulation == 0:
            optimizer.zero_grad(set_to_none=True)
        loss = train_step(model, optimizer, input_ids, attention_mask, args).reduce_mean()
        if batch % args.gradient_accumulation == args.gradient_accumulation - 1:
            optimizer.step()
            scheduler.step()
        steps += 1
        # the whole data-parallel batch's loss: each replica's mean, averaged
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=smp.get_dp_process_group())
        record["steps"].append(steps)
        record["losses"].append(mean.item() / smp.dp_size())
        if smp.rank() == 0:
            print(f"step {steps} loss {loss.item():.6f}", flush=True)
        if steps % args.checkpoint_freq == 0:
            smp.save_checkpoint(
                args.checkpoint_dir, tag=f"total_steps{steps}", partial=True, model=model,
                optimizer=optimizer, num_kept_partial_checkpoints=args.num_kept_checkpoints,
                user_content={"cli_args": vars(args), "total_steps": steps,
                              "start_batch_index": batch + 1, "model_config": config,
                              "lr_scheduler": scheduler.state_dict()})
    if smp.rank() == 0 and args.out:
        assert all(math.isfinite(x) for x in record["losses"])
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(record, fh)
    smp.barrier()


if __name__ == "__main__":
    main()

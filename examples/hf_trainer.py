"""A Hugging Face Trainer script, written for the Trainer alone: train, evaluate, predict,
save and resume. Nothing in it knows smp-fx.

In SMP mode (2 processes, 2 pipeline stages), as on SageMaker::

    SM_HP_MP_PARAMETERS='{"partitions": 2, "microbatches": 2}' \\
    SM_FRAMEWORK_PARAMS='{"sagemaker_mpi_enabled": true}' \\
        smp-fx run -n 2 examples/hf_trainer.py OUT_DIR

and, to compare, the plain Trainer in one process::

    python examples/hf_trainer.py OUT_DIR

The Trainer switches to its SMP branch by itself when ``SM_HP_MP_PARAMETERS`` holds
``"partitions"``, ``SM_FRAMEWORK_PARAMS`` holds ``"sagemaker_mpi_enabled": true`` and
``smdistributed`` is importable (``smp-fx run`` makes it so). The same script runs with
transformers 4.26, 4.46 and 5.x (``docs/clients.md``: what each version's SMP branch does
and what smp-fx adjusts).

The model says it takes no loss kwargs (``accepts_loss_kwargs = False``): from 4.46 on the
plain Trainer otherwise divides the summed loss by the number of label tokens, which its
SMP branch never passes; with the flag both modes average the loss per batch and
optimise the same objective (the attribute means nothing to earlier versions).

``python examples/hf_trainer.py OUT_DIR`` trains three times and writes
``OUT_DIR/result_{rank}.json`` with the per-step losses of each: ``gas1``
(gradient_accumulation_steps 1, a checkpoint at step 2, then ``evaluate()`` and
``predict()``: ``predict`` holds the logits' shape, then per sample their sum and sum of
magnitudes, so samples gathered in another order show; ``grad_norm``: the norms the
Trainer clipped by, at its default ``max_grad_norm`` 1.0), ``resumed`` (a fresh model
resumed from that checkpoint) and ``gas2`` (gradient_accumulation_steps 2, evaluating and
saving at steps 2 and 4, then loading the best checkpoint: ``gas2_evals`` and ``best``;
``gas2_grad_norm``: the norms it clipped by).
The checkpoint files are listed under ``checkpoint_files``.

``--average-accumulation`` (transformers 4.46 only): the plain Trainer divides each
accumulated batch's loss by ``gradient_accumulation_steps`` before its backward, as its SMP
branch and transformers 4.26 and 5.x do. 4.46's plain branch backpropagates the undivided
mean when the model takes no loss kwargs (transformers issue 37766: it leaves the division
to an ``Accelerator`` it never tells of the accumulation), so its gradients are that many
times its SMP branch's, and clipping at ``max_grad_norm`` then moves the two runs apart.

``--train-only --batch B [--optim NAME,...]`` trains 4 steps at per-device batch ``B``
instead, once per optimizer named (``TrainingArguments.optim``: e.g. ``sgd``, whose
parameters show gradient differences that Adam would scale up where a gradient is only
rounding noise), saves the model with ``trainer.save_model(OUT_DIR/NAME/final)``, evaluates
and predicts, and records the samples this rank read for training (``samples``, one list
per step); the results are keyed by the optimizer's name. ``--default-cache`` leaves
GPT-2's ``use_cache`` at the config's default (True: every layer's key/value cache is an
output) instead of turning it off. ``--set-tensor-parallelism``: in SMP mode, mark the model
with ``smp.set_tensor_parallelism(model)`` after building it, as AWS's GPT-2 Trainer script
(``run_clm.py``) does; the Trainer is then unchanged. ``--weight-decay W``:
``TrainingArguments.weight_decay`` (0 by default), which the Trainer applies to every
parameter but biases and LayerNorms (``Trainer.get_decay_parameter_names``).
``--groups-on-wrapped``: the optimizer's groups are named on the model the Trainer wraps
(in SMP mode the ``DistributedModel``), as transformers 4.2x's ``create_optimizer`` and
AWS's Bloom ``smp_trainer.py`` name them; the installed versions name them on the base model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

import torch

VOCAB, SEQ = 64, 16


class Tokens(torch.utils.data.Dataset):
    """Random token sequences; a language model's labels are its inputs. Remembers which
    samples it handed out (``read``)."""

    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.read.append(int(i))
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model(default_cache: bool = False) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cache: dict[str, bool] = {} if default_cache else {"use_cache": False}
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
                     attn_implementation="eager", **cache)
    model = GPT2LMHeadModel(cfg)
    model.accepts_loss_kwargs = False  # per-batch mean loss, as the SMP branch computes it
    return model


def training_args(out: str, **kwargs: Any) -> Any:
    """``TrainingArguments`` under the names of the installed transformers (4.2x calls the
    evaluation schedule ``evaluation_strategy``, 5.x ``eval_strategy``)."""
    from transformers import TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    if "eval_strategy" in kwargs and "eval_strategy" not in fields:
        kwargs["evaluation_strategy"] = kwargs.pop("eval_strategy")
    return TrainingArguments(output_dir=out, report_to=[], seed=0, disable_tqdm=True,
                             logging_steps=1, learning_rate=1e-2, dataloader_pin_memory=False,
                             **kwargs)


def plain_sums_accumulation(version: str) -> bool:
    """Whether transformers ``version``'s plain Trainer backpropagates each accumulated
    batch's loss undivided for a model that takes no loss kwargs (4.46: transformers issue
    37766), so that only ``averaging_trainer`` optimises what its SMP branch does."""
    return version.startswith("4.46.")


def averaging_trainer() -> type:
    """A ``Trainer`` whose training step backpropagates each accumulated batch's loss
    divided by ``gradient_accumulation_steps`` and reports it as the undivided one does
    (``--average-accumulation``, module docstring); transformers 4.46 only."""
    import transformers
    from transformers import Trainer

    if not plain_sums_accumulation(transformers.__version__):
        raise SystemExit(f"--average-accumulation is for transformers 4.46, not "
                         f"{transformers.__version__}: its Trainer divides already")

    class AveragingTrainer(Trainer):  # type: ignore[misc]
        dividing = False

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            self.dividing = True
            try:
                return super().training_step(*args, **kwargs) * \
                    self.args.gradient_accumulation_steps
            finally:
                self.dividing = False

        def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
            out = super().compute_loss(*args, **kwargs)
            if not self.dividing:
                return out
            gas = self.args.gradient_accumulation_steps
            return (out[0] / gas, *out[1:]) if isinstance(out, tuple) else out / gas

    return AveragingTrainer


def trainer_for(out: str, gas: int, steps: int, save_steps: int | None, batch: int = 4,
                best: bool = False, default_cache: bool = False, mark_tp: bool = False,
                average: bool = False, **extra: Any) -> Any:
    """A Trainer on a fresh model, ``max_grad_norm`` at the Trainer's default (1.0);
    ``best``: evaluate at every save and load the best checkpoint at the end; ``mark_tp``:
    ``smp.set_tensor_parallelism(model)`` in SMP mode; ``average``: ``averaging_trainer``'s."""
    from transformers import Trainer
    from transformers.utils import is_sagemaker_mp_enabled

    at_saves: dict[str, Any] = dict(eval_strategy="steps", eval_steps=save_steps,
                                    load_best_model_at_end=True) if best else {}
    args = training_args(out, **at_saves, per_device_train_batch_size=batch,
                         per_device_eval_batch_size=4, gradient_accumulation_steps=gas,
                         max_steps=steps,
                         save_strategy="steps" if save_steps else "no",
                         save_steps=save_steps or 500, **extra)
    model = build_model(default_cache)
    if mark_tp and is_sagemaker_mp_enabled():
        import smdistributed.modelparallel.torch as smp

        smp.set_tensor_parallelism(model)
    cls = averaging_trainer() if average else Trainer
    return cls(model=model, args=args, train_dataset=Tokens(64, 1), eval_dataset=Tokens(8, 2))


def groups_on_wrapped(trainer: Any) -> None:
    """``trainer.create_optimizer`` becomes 4.2x's: weight-decay groups by the names
    ``get_parameter_names`` walks on the wrapped model and its ``named_parameters()``."""
    from transformers import Trainer
    from transformers.utils import is_sagemaker_mp_enabled

    def create_optimizer(model: Any = None) -> Any:
        if trainer.optimizer is None:
            wrapped = trainer._wrap_model(trainer.model_wrapped)
            decay = set(trainer.get_decay_parameter_names(wrapped))
            named = list(wrapped.named_parameters())
            groups = [{"params": [p for n, p in named if n in decay],
                       "weight_decay": trainer.args.weight_decay},
                      {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
            cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(trainer.args)
            trainer.optimizer = cls(groups, **kwargs)
            if is_sagemaker_mp_enabled():
                import smdistributed.modelparallel.torch as smp

                trainer.optimizer = smp.DistributedOptimizer(trainer.optimizer)
        return trainer.optimizer

    trainer.create_optimizer = create_optimizer


def losses(trainer: Any, key: str = "loss") -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


def full(out: str, average: bool = False) -> dict[str, Any]:
    first = trainer_for(os.path.join(out, "gas1"), gas=1, steps=4, save_steps=2)
    first.train()
    result: dict[str, Any] = {"gas1": losses(first), "eval": first.evaluate()["eval_loss"],
                              "grad_norm": losses(first, "grad_norm")}
    logits = torch.as_tensor(first.predict(Tokens(8, 3)).predictions)
    per_sample = logits.flatten(1)
    result["predict"] = [list(logits.shape), per_sample.sum(1).tolist(),
                         per_sample.abs().sum(1).tolist()]
    result["param_dtypes"] = sorted({str(p.dtype) for p in first.model.parameters()})
    checkpoint = os.path.join(out, "gas1", "checkpoint-2")
    result["checkpoint_files"] = sorted(os.listdir(checkpoint))
    resumed = trainer_for(os.path.join(out, "gas1"), gas=1, steps=4, save_steps=None)
    resumed.train(resume_from_checkpoint=checkpoint)
    result["resumed"] = losses(resumed)
    accumulated = trainer_for(os.path.join(out, "gas2"), gas=2, steps=4, save_steps=2,
                              best=True, average=average)
    accumulated.train()
    result["gas2"] = losses(accumulated)
    result["gas2_grad_norm"] = losses(accumulated, "grad_norm")
    result["gas2_evals"] = losses(accumulated, "eval_loss")
    result["best"] = accumulated.evaluate()["eval_loss"]
    return result


def train_only(out: str, batch: int, optim: str, default_cache: bool, mark_tp: bool,
               weight_decay: float, on_wrapped: bool) -> dict[str, Any]:
    trainer = trainer_for(os.path.join(out, "run"), gas=1, steps=4, save_steps=None,
                          batch=batch, optim=optim, default_cache=default_cache,
                          mark_tp=mark_tp, weight_decay=weight_decay)
    if on_wrapped:
        groups_on_wrapped(trainer)
    data = trainer.train_dataset
    trainer.train()
    read = list(data.read)
    trainer.save_model(os.path.join(out, "final"))
    logits = torch.as_tensor(trainer.predict(Tokens(8, 3)).predictions)
    return {"losses": losses(trainer), "eval": trainer.evaluate()["eval_loss"],
            "predict": [list(logits.shape), logits.sum().item(), logits.abs().sum().item()],
            "samples": [read[i:i + batch] for i in range(0, len(read), batch)]}


if __name__ == "__main__":
    torch.set_num_threads(1)
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("out")
    cli.add_argument("--train-only", action="store_true")
    cli.add_argument("--batch", type=int, default=4)
    cli.add_argument("--optim", default="adamw_torch",
                     help="TrainingArguments.optim; several, comma-separated")
    cli.add_argument("--default-cache", action="store_true")
    cli.add_argument("--set-tensor-parallelism", action="store_true")
    cli.add_argument("--weight-decay", type=float, default=0.0)
    cli.add_argument("--groups-on-wrapped", action="store_true")
    cli.add_argument("--average-accumulation", action="store_true")
    ns = cli.parse_args()
    found = {name: train_only(os.path.join(ns.out, name), ns.batch, name, ns.default_cache,
                              ns.set_tensor_parallelism, ns.weight_decay,
                              ns.groups_on_wrapped)
             for name in ns.optim.split(",")} if ns.train_only else full(
                 ns.out, ns.average_accumulation)
    rank = int(os.environ.get("RANK", "0"))
    # a file per rank: the ranks share one stdout, where another rank's partly flushed line
    # can run into this one
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, f"result_{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(found, fh)
    print(f"results of rank {rank} in {ns.out}/result_{rank}.json")

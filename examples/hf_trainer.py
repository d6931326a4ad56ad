"""The Hugging Face Trainer's own SMP mode, on smp-fx: train, evaluate, save, resume.

In SMP mode (2 processes, 2 pipeline stages)::

    SM_HP_MP_PARAMETERS='{"partitions": 2, "microbatches": 2}' \\
    SM_FRAMEWORK_PARAMS='{"sagemaker_mpi_enabled": true}' \\
        smp-fx run -n 2 examples/hf_trainer.py OUT_DIR

and, to compare, the plain Trainer in one process::

    python examples/hf_trainer.py OUT_DIR

The Trainer switches to its SMP branch by itself when ``SM_HP_MP_PARAMETERS`` holds
``"partitions"``, ``SM_FRAMEWORK_PARAMS`` holds ``"sagemaker_mpi_enabled": true`` and
``smdistributed`` is importable (``smp-fx run`` makes it so): it then calls ``smp.init()``,
wraps the model in ``smp.DistributedModel(model, backward_passes_per_step=...)``, trains
through ``@smp.step`` functions, evaluates with ``smp_forward_only`` / ``smp_gather`` /
``StepOutput.concat``, saves with ``smp.save(..., partial=True)`` and resumes with
``smp.resume_from_checkpoint``. Two things differ from a script on SageMaker, both outside
the Trainer's code:

* ``cpu_device()``: the SMP branch of ``TrainingArguments`` hard-codes
  ``torch.device("cuda", smp.local_rank())``. Without CUDA, the name ``torch`` inside
  ``transformers.training_args`` (only there) is given a view of torch whose
  ``device("cuda", i)`` is the CPU and whose ``cuda.set_device`` does nothing.
* the optimizer is passed in (``optimizers=(smp.DistributedOptimizer(AdamW(...)), None)``):
  transformers 5's SMP branch never builds one (it delays creating the optimizer until the
  model is wrapped, then skips creating it for a wrapped model). smp-fx adopts a
  DistributedOptimizer built before the DistributedModel.

The model says it takes no loss kwargs (``accepts_loss_kwargs = False``), so the plain
Trainer averages the loss per batch as the SMP branch does, instead of dividing a sum by
the number of label tokens: both runs then optimise the same objective.

The script trains three times, printing one JSON line with the per-step losses of each:
``gas1`` (gradient_accumulation_steps 1, saving a checkpoint at step 2, then evaluating
and predicting: ``predict`` holds the logits' shape, then per sample their sum and sum
of magnitudes, so samples gathered in another order show;
with ``max_grad_norm`` so large that clipping runs but never scales, and ``grad_norm``: the
norms the Trainer clipped by, which in SMP mode are each stage's own),
``resumed`` (a fresh model resumed from that checkpoint and trained to the same step) and
``gas2`` (gradient_accumulation_steps 2, evaluating and saving at steps 2 and 4, then
loading the best of those checkpoints: ``gas2_evals`` and ``best``, the loss evaluated
after loading it).
"""

from __future__ import annotations

import json
import os
import sys
import types
from typing import Any

import torch

VOCAB, SEQ = 64, 16
# the Trainer's clipping path runs (and logs the norm it clipped by) without scaling anything
CLIP_NEVER_SCALES = 1e6
SMP_MODE = "partitions" in os.environ.get("SM_HP_MP_PARAMETERS", "")


class _TorchWithCudaOnCpu(types.ModuleType):
    """torch, except that ``device("cuda", i)`` is the CPU and ``cuda.set_device`` is a
    no-op; everything else is torch's own."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = types.SimpleNamespace(**vars(torch.cuda))
        self.cuda.set_device = lambda device: None

    def device(self, kind: Any, *index: Any) -> torch.device:
        return torch.device("cpu") if str(kind).startswith("cuda") else torch.device(kind, *index)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def cpu_device() -> None:
    """Point the Trainer's hard-coded SMP device at the CPU when there is no CUDA."""
    import transformers.training_args as training_args

    if not torch.cuda.is_available():
        training_args.torch = _TorchWithCudaOnCpu()  # type: ignore[assignment]


class Tokens(torch.utils.data.Dataset):
    """Random token sequences; a language model's labels are its inputs."""

    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
                     attn_implementation="eager")
    model = GPT2LMHeadModel(cfg)
    model.accepts_loss_kwargs = False  # per-batch mean loss, as the SMP branch computes it
    return model


def trainer_for(out: str, gas: int, steps: int, save_steps: int | None,
                max_grad_norm: float = 0.0, best: bool = False) -> Any:
    """A Trainer on a fresh model; ``best``: evaluate at every save and load the best
    checkpoint at the end."""
    from transformers import Trainer, TrainingArguments

    at_saves: dict[str, Any] = dict(eval_strategy="steps", eval_steps=save_steps,
                                    load_best_model_at_end=True) if best else {}
    args = TrainingArguments(**at_saves,
        output_dir=out, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        gradient_accumulation_steps=gas, max_steps=steps, learning_rate=1e-2,
        max_grad_norm=max_grad_norm, logging_steps=1, report_to=[], seed=0, disable_tqdm=True,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        dataloader_pin_memory=False)
    model = build_model()
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if SMP_MODE:
        import smdistributed.modelparallel.torch as smp

        optimizer = smp.DistributedOptimizer(optimizer)
    return Trainer(model=model, args=args, train_dataset=Tokens(64, 1),
                   eval_dataset=Tokens(8, 2), optimizers=(optimizer, None))


def losses(trainer: Any, key: str = "loss") -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


def main(out: str) -> dict[str, Any]:
    if SMP_MODE:
        cpu_device()
    first = trainer_for(os.path.join(out, "gas1"), gas=1, steps=4, save_steps=2,
                        max_grad_norm=CLIP_NEVER_SCALES)
    first.train()
    result: dict[str, Any] = {"gas1": losses(first), "eval": first.evaluate()["eval_loss"],
                              "grad_norm": losses(first, "grad_norm")}
    logits = torch.as_tensor(first.predict(Tokens(8, 3)).predictions)
    per_sample = logits.flatten(1)
    result["predict"] = [list(logits.shape), per_sample.sum(1).tolist(),
                         per_sample.abs().sum(1).tolist()]
    resumed = trainer_for(os.path.join(out, "gas1"), gas=1, steps=4, save_steps=None)
    resumed.train(resume_from_checkpoint=os.path.join(out, "gas1", "checkpoint-2"))
    result["resumed"] = losses(resumed)
    accumulated = trainer_for(os.path.join(out, "gas2"), gas=2, steps=4, save_steps=2,
                              best=True)
    accumulated.train()
    result["gas2"] = losses(accumulated)
    result["gas2_evals"] = losses(accumulated, "eval_loss")
    result["best"] = accumulated.evaluate()["eval_loss"]
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)
    found = main(sys.argv[1])
    rank = int(os.environ.get("RANK", "0"))
    # a file per rank: the ranks share one stdout, where another rank's partly flushed line
    # can run into this one
    os.makedirs(sys.argv[1], exist_ok=True)
    with open(os.path.join(sys.argv[1], f"result_{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(found, fh)
    print(f"results of rank {rank} in {sys.argv[1]}/result_{rank}.json")

"""The Hugging Face Trainer in SMP mode with tensor parallelism, and the ways out to Hugging
Face: a GPT-2 built inside ``smp.tensor_parallelism()`` (how SMP's documentation marks a
Hugging Face model for tensor parallelism) trains 4 steps with the Trainer, then is saved
three ways, each of which ``from_pretrained`` loads:

* ``OUT/final``: ``trainer.save_model()`` (the Trainer's SMP branch: ``state_dict()`` of the
  DistributedModel, gathered over tp and pp, then ``save_pretrained``);
* ``OUT/full``: ``smp.save_checkpoint(..., partial=False)``;
* ``OUT/partial``: ``smp.save_checkpoint(..., partial=True)``, for
  ``smp-fx checkpoint export OUT/partial/step4_partial -o DIR --config OUT/final``.

Rank 0 writes ``OUT/logits.json``: the smp-fx model's logits on 4 fixed samples
(``trainer.predict``). Run at pp = 2 x tp = 2::

    SM_HP_MP_PARAMETERS='{"partitions": 2, "tensor_parallel_degree": 2, "microbatches": 2,
                          "ddp": true}' \\
    SM_FRAMEWORK_PARAMS='{"sagemaker_mpi_enabled": true}' \\
        smp-fx run -n 4 examples/hf_trainer_tp.py OUT
"""

from __future__ import annotations

import json
import os
import sys

import smdistributed.modelparallel.torch as smp
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_trainer import Tokens, build_model, training_args  # noqa: E402


def main(out: str) -> None:
    from transformers import Trainer

    with smp.tensor_parallelism():
        model = build_model()
    args = training_args(os.path.join(out, "run"), per_device_train_batch_size=4,
                         per_device_eval_batch_size=4, max_steps=4, save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64, 1))
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    smp.save_checkpoint(os.path.join(out, "full"), tag="model.pt", partial=False,
                        model=trainer.model_wrapped)
    smp.save_checkpoint(os.path.join(out, "partial"), tag="step4", partial=True,
                        model=trainer.model_wrapped)
    logits = torch.as_tensor(trainer.predict(Tokens(4, 3)).predictions)
    if smp.rank() == 0:
        with open(os.path.join(out, "logits.json"), "w", encoding="utf-8") as fh:
            json.dump({"logits": logits.tolist(), "ids": Tokens(4, 3).ids.tolist(),
                       "tp_sharded": len(trainer.model_wrapped.tp_plan.sharded)}, fh)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])

"""AWS's three SMP 1.11-1.15 notebooks (GPT-NeoX, FLAN-T5, Falcon ``train.py``), reproduced:
each makes the script's SMP calls with its notebook's configuration (written here, no AWS
code) at small size on CPU: ``smp.init`` with sharded data parallelism 2, ``bf16``,
``delayed_parameter_initialization`` and ``skip_tracing``; ``smp.model_creation`` with the
script's switches and ``dtype=torch.bfloat16``; GPT-NeoX with the script's default
``--use_distributed_transformer 1`` (tensor parallelism on at tp 1, SMP's distributed
GPT-NeoX, ``PreTrainedModel.init_weights`` switched off as the script does), the others
with ``zero_init``; activation checkpointing of the script's layers; the script's Adam
groups in ``smp.DistributedOptimizer``; its ``train_step`` (``labels=input_ids``).

The three run in sequence in one 2-process spawn, each twice (two runs of a script give
the same losses). Against the same script in one process with eager construction (a spawn
of its own, run beside the 2-process one): the
delayed, sharded model's parameters and buffers equal the eager build's bitwise, and the
losses are finite and equal at bf16's resolution. Dropout is 0 in the tiny configs (the
ranks' and the reference's random streams differ); FLAN-T5's CUDA flash attention
(``add_flash_attn``) is left out.
"""

from __future__ import annotations

import io
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torch import nn

from tests.examples.test_aws_reproductions import (
    _shim_smp,
    train_py_config,
    train_py_optimizer,
    train_py_step,
)
from tests.helpers.compare import mismatched
from tests.helpers.dist import run_ranks

MODELS = ("flan_t5", "falcon", "gpt_neox")
STEPS, BATCH, SEQ, VOCAB = 3, 4, 16, 64
BF16_RTOL = 2 ** -7  # bf16 keeps 8 significant bits


def _config(model_type: str) -> Any:
    """Tiny configs of the notebooks' families (no dropout, the models' own defaults else)."""
    import transformers

    if model_type == "gpt_neox":
        return transformers.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, max_position_embeddings=SEQ, rotary_pct=0.25,
            hidden_dropout=0.0, attention_dropout=0.0)
    if model_type == "flan_t5":  # FLAN-T5 is T5 v1.1: gated-gelu, its own output scale
        return transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
            relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
            tie_word_embeddings=False, dropout_rate=0.0, decoder_start_token_id=0,
            pad_token_id=0)
    return transformers.FalconConfig(  # Falcon-7B's layout
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        multi_query=True, parallel_attn=True, new_decoder_architecture=False, bias=False,
        alibi=False, hidden_dropout=0.0, attention_dropout=0.0)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _param_groups(module: nn.Module) -> list[dict[str, Any]]:
    """The script's ``get_param_groups_by_weight_decay`` (biases and FusedLayerNorm's
    parameters without decay)."""
    from smp_fx.nn import FusedLayerNorm

    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            (no_decay if isinstance(mod, FusedLayerNorm) or name == "bias"
             else decay).append(p)
    return [{"params": decay}] + ([{"params": no_decay, "weight_decay": 0.0}]
                                  if no_decay else [])


def _layers(model: Any, model_type: str, distributed: bool) -> list[nn.Module]:
    """What the script checkpoints: the replacement's ``seq_layers``, else each layer."""
    m = model.get_module()
    if distributed:
        return [m.transformer.seq_layers]
    if model_type == "flan_t5":
        return [*m.encoder.block.children(), *m.decoder.block.children()]
    return list(m.transformer.h.children())


def _full_state(model: Any) -> bytes:
    """The model's whole ``state_dict`` on every rank (sdp shards gathered), serialised (a
    tensor sent from a rank as it is would outlive the rank's shared memory)."""
    buffer = io.BytesIO()
    torch.save({n: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
                for n, v in model.state_dict().items()}, buffer)
    return buffer.getvalue()


def _loaded(state: bytes) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = torch.load(io.BytesIO(state), weights_only=True)
    return loaded


def _script(model_type: str, keep_state: bool) -> dict[str, Any]:
    """One run of ``train.py`` for ``model_type``: its step losses (as
    ``log_reduced_training_loss`` reduces them) and, if ``keep_state``, the whole model's
    state once materialised (after the first step's backward, before its update)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM
    from transformers.modeling_utils import PreTrainedModel

    smp = _shim_smp()
    smp.reset()
    distributed = model_type == "gpt_neox"  # the notebook keeps the script's default
    init_weights = PreTrainedModel.init_weights
    if distributed:
        PreTrainedModel.init_weights = lambda self: None  # type: ignore[method-assign]
    try:
        transformers.set_seed(12345)
        with smp.model_creation(
                tensor_parallelism=smp.tp_size() > 1 or distributed, zero_init=not distributed,
                dtype=torch.bfloat16, distribute_embedding=False, use_alibi=False,
                attention_in_fp32=False, fp32_residual_addition=False,
                query_key_layer_scaling=False, fused_softmax=True, fused_dropout=False,
                fused_bias_gelu=True, flash_attention=True):
            auto = AutoModelForSeq2SeqLM if model_type == "flan_t5" else AutoModelForCausalLM
            model = auto.from_config(_config(model_type))
    finally:
        PreTrainedModel.init_weights = init_weights  # type: ignore[method-assign]
    transformers.set_seed(12345 + smp.tp_rank())
    model = smp.DistributedModel(model, trace_device="gpu", backward_passes_per_step=1)
    layers = _layers(model, model_type, distributed)
    param_groups = _param_groups(model.get_module())
    optimizer = torch.optim.Adam(param_groups, betas=(0.9, 0.95), lr=1e-4, weight_decay=0.01)
    for layer in layers:
        smp.set_activation_checkpointing(layer)
    optimizer = train_py_optimizer(smp, optimizer)
    train_step = train_py_step(smp)

    share = BATCH // smp.dp_size()
    rows = slice(smp.dp_rank() * share, (smp.dp_rank() + 1) * share)
    losses, state = [], None
    transformers.set_seed(12345)
    for ids in _batches():
        optimizer.zero_grad(set_to_none=True)
        loss = train_step(model, ids[rows], torch.ones_like(ids[rows])).reduce_mean()
        if keep_state and state is None:  # materialised at the first step, not yet trained
            state = _full_state(model)
        optimizer.step()
        detached = loss.detach().float()
        torch.distributed.all_reduce(detached, group=smp.get_dp_process_group())
        losses.append(detached.item() / smp.dp_size())
    return {"losses": losses, "layers": len(layers), "state": state}


def _notebooks(sdp: int, delayed: bool, runs: int) -> dict[str, Any]:
    """Every notebook ``runs`` times under one ``smp.init`` (the notebooks share it)."""
    smp = _shim_smp()
    smp.init(train_py_config(bf16=True, delayed_parameter_initialization=delayed,
                             sharded_data_parallel_degree=sdp))
    out: dict[str, Any] = {}
    for model_type in MODELS:
        out[model_type] = [_script(model_type, run == 0) for run in range(runs)]
    return out


@pytest.mark.multiproc
def test_notebooks_sdp2_bf16_delayed_equal_one_eager_process() -> None:
    with ThreadPoolExecutor(1) as beside:  # the reference runs while the ranks do
        reference = beside.submit(run_ranks, _notebooks, 1, 1, False, 1, timeout=300)
        results = run_ranks(_notebooks, 2, 2, True, 2, timeout=300)
        want = reference.result()[0]
    for model_type in MODELS:
        ref = want[model_type][0]
        assert all(math.isfinite(x) for x in ref["losses"]), (model_type, ref["losses"])
        for res in results:
            first, second = res[model_type]
            assert first["losses"] == second["losses"], model_type  # two runs, same losses
            assert not mismatched(_loaded(first["state"]), _loaded(ref["state"])), model_type
            torch.testing.assert_close(first["losses"], ref["losses"], rtol=BF16_RTOL, atol=0.0)
            assert first["layers"] == ref["layers"] > 0

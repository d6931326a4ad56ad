"""A Hugging Face causal LM from its ``config.json``, prepared for the planner without weights.

Why: users hold a ``config.json`` (the one beside a checkpoint), not a model file.
``load_config`` reads it locally (never a download) into transformers' config class of its
``model_type``; ``prepare_config`` builds the causal LM on the meta device with ``KEPT + 1``
decoder layers, not all of them: ``torch.export`` takes about a second per layer, and the
planner prices two layers whatever the depth. The prepared model then stands for the full
depth (``deepen``): its repeated layer counts ``num_hidden_layers - 1`` times and its
parameters are the full model's. A config whose layers differ by index (a per-layer list
whose entries differ, as Gemma 2's alternating attention) is built and traced whole, but
for DeepSeek's few dense layers before the MoE ones, priced as MoE layers (logged).
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cost_model.errors import SMPConfigError, first_line
from passes.trace import Frontend
from smp_fx.planner.layers import KEPT
from smp_fx.planner.model import Prepared, prepare
from smp_fx.planner.profile import model_dtype

log = logging.getLogger("smp_fx.planner.hf_config")

DENSE_PREFIX = "first_k_dense_replace"
"""DeepSeek's count of dense layers before the MoE ones (``shallow`` keeps MoE layers)."""
ATTENTION = "sdpa"
"""The attention kernel the model is built with: what training runs (fused, no s x s
scores kept for backward), not the eager reference."""
EAGER = "eager"
"""The fallback where transformers has no sdpa attention for a model (GPT-OSS's sinks)."""


class CausalLMLogits(nn.Module):
    """``forward(input_ids) -> logits`` over a Hugging Face causal LM (kept untouched)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=input_ids, use_cache=False).logits
        return logits


def config_file(path: str | Path) -> Path:
    """``path`` itself, or the ``config.json`` in the directory ``path``."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise SMPConfigError.build("--hf-config names a config.json or a directory holding "
                                   "one", str(path), "--hf-config",
                                   "pass the file (or its directory) of a local model")
    return file


def load_config(path: str | Path) -> Any:
    """The transformers config of ``path`` (a ``config.json`` or its directory)."""
    file = config_file(path)
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SMPConfigError.build("--hf-config must hold a JSON object", str(file),
                                   "--hf-config", "fix the JSON") from exc
    if not isinstance(doc, dict):
        raise SMPConfigError.build("--hf-config must hold a JSON object",
                                   type(doc).__name__, str(file), "use {...}")
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError as exc:
        raise SMPConfigError.build("--hf-config needs the transformers package", str(exc),
                                   "--hf-config", "pip install transformers") from exc
    kind = str(doc.get("model_type"))
    if kind not in CONFIG_MAPPING:
        raise SMPConfigError.build("the config's model_type is one transformers knows",
                                   repr(doc.get("model_type")), str(file),
                                   "set model_type (e.g. \"llama\"), or upgrade "
                                   "transformers for a newer architecture")
    try:
        return CONFIG_MAPPING[kind].from_dict(doc)
    except (TypeError, ValueError) as exc:
        raise SMPConfigError.build(f"transformers rejects this {kind} config",
                                   first_line(exc), str(file), "fix the named field") \
            from exc


def shallow(config: Any) -> Any | None:
    """``config`` with ``KEPT + 1`` layers, or None where its layers differ by index (or
    it has that few already)."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers <= KEPT + 1:
        return None
    out = copy.deepcopy(config)
    for key, value in config.to_dict().items():
        if isinstance(value, (list, tuple)) and len(value) == layers:
            if any(v != value[0] for v in value):
                log.info("%s: layers differ by index; building all %d", key, layers)
                return None
            setattr(out, key, type(value)(value[:KEPT + 1]))
    out.num_hidden_layers = KEPT + 1
    dense = int(getattr(config, DENSE_PREFIX, 0) or 0)
    if dense:
        log.warning("%s = %d: the dense layers before the MoE ones are priced as MoE layers "
                    "(their FLOPs per token about equal by design; the experts' parameters "
                    "over-counted by %d layers' worth)", DENSE_PREFIX, dense, dense)
        setattr(out, DENSE_PREFIX, 0)
    return out


def causal_lm(config: Any, precision: str, where: str) -> nn.Module:
    """The config's causal LM on the meta device, in the plan's precision; with eager
    attention where transformers has no sdpa for it (logged: its scores are then kept and
    priced as matmuls, but as a fused kernel under ``Setting(runtime="megatron-core")``)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            try:
                model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION)
            except ValueError as exc:
                if "scaled_dot_product_attention" not in str(exc):
                    raise
                log.warning("%s: transformers has no %s attention for %s; built with eager "
                            "attention", where, ATTENTION, type(config).__name__)
                model = AutoModelForCausalLM.from_config(config, attn_implementation=EAGER)
    except ValueError as exc:
        raise SMPConfigError.build("the config has a causal language model in transformers",
                                   first_line(exc), where,
                                   "plan a decoder-only model (Llama, Mistral, Mixtral, "
                                   "Qwen, GPT-2, ...)") from exc
    return CausalLMLogits(model).to(model_dtype(precision)).eval()


def deepen(prepared: Prepared, layers: int, layer_params: int) -> Prepared:
    """``prepared`` (its repeated layers found) standing for ``layers`` layers of
    ``layer_params`` parameters each."""
    repeats = prepared.repeats
    assert repeats is not None
    extra = layers - repeats.count
    info = replace(prepared.info, layers=layers,
                   parameters=prepared.info.parameters + extra * layer_params)
    graph = prepared.graph
    graph.meta["smp.kept_layers"] = (repeats.parent, layers, KEPT)
    return Prepared(graph, replace(repeats, count=layers), prepared.inputs, info)


def prepare_config(path: str | Path, seq_len: int, precision: str = "bf16",
                   frontend: Frontend = "auto") -> Prepared:
    """The planner's model for the config at ``path`` and ``seq_len`` tokens per sample
    (module docstring)."""
    if seq_len < 1:
        raise SMPConfigError.build("--seq-len is a positive token count", seq_len,
                                   "--seq-len", "e.g. --seq-len 8192")
    config = load_config(path)
    where = str(config_file(path))
    vocab = int(getattr(config, "vocab_size", 2) or 2)

    def inputs(batch: int) -> tuple[Any, ...]:
        return (torch.randint(0, vocab, (batch, seq_len)),)

    file = Path(where)
    name = (file.parent.name if file.name == "config.json" else file.stem) or "model"
    small = shallow(config)
    if small is not None:
        model = causal_lm(small, precision, where)
        prepared = prepare(model, inputs, name, frontend)
        if prepared.repeats is not None and prepared.repeats.count == KEPT + 1:
            layer = model.get_submodule(prepared.repeats.layer_path(1))
            per_layer = sum(p.numel() for p in layer.parameters())
            return deepen(prepared, config.num_hidden_layers, per_layer)
        log.info("%s: no repeated layers in %d layers; building all %d", where, KEPT + 1,
                 config.num_hidden_layers)
    return prepare(causal_lm(config, precision, where), inputs, name, frontend)


__all__ = ["ATTENTION", "DENSE_PREFIX", "EAGER", "CausalLMLogits", "causal_lm", "config_file",
           "deepen", "load_config", "prepare_config", "shallow"]

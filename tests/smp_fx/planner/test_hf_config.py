"""A Hugging Face config planned from three layers stands for its full depth; bad configs
are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cost_model.errors import SMPConfigError
from smp_fx.planner import hf_config
from smp_fx.planner.model import Profiler, prepare
from tests.smp_fx.planner.conftest import link_cluster

pytest.importorskip("transformers")

TINY = Path(__file__).resolve().parents[2] / "data" / "hf_tiny_llama"


def test_three_layers_stand_for_four(monkeypatch: pytest.MonkeyPatch) -> None:
    shallow = hf_config.prepare_config(TINY, 32)
    monkeypatch.setattr(hf_config, "shallow", lambda config: None)
    whole = hf_config.prepare_config(TINY / "config.json", 32)
    assert shallow.info.nodes < whole.info.nodes
    for p in (shallow, whole):
        assert (p.info.layers, p.info.tokens_per_sample) == (4, 32)
        assert p.info.name == "hf_tiny_llama"
        assert p.info.layer_path == "model.model.layers.N"
    model = hf_config.causal_lm(hf_config.load_config(TINY), "bf16", str(TINY))
    total = sum(p.numel() for p in model.parameters())
    assert shallow.info.parameters == whole.info.parameters == total
    cluster = link_cluster()
    a, b = (Profiler(p, cluster)(2, 2, True) for p in (shallow, whole))
    assert (a.repeat, a.layers) == (b.repeat, b.layers) == ((2, 3), 4)
    assert a.parts == b.parts
    # every parameter is priced once, in the part that reads it (tp 1: nothing sharded)
    one = Profiler(shallow, cluster)(1, 1, False)
    assert sum(u.param_elems for u in one.units()) == total


def test_fx_hides_the_decoder_in_a_leaf() -> None:
    """Why the planner traces a Hugging Face model with export (``auto``): fx cannot trace
    its mask creation, so the whole decoder stack becomes one automatic leaf."""
    model = hf_config.causal_lm(hf_config.load_config(TINY), "bf16", str(TINY))
    prepared = prepare(model, lambda b: (torch.randint(0, 128, (b, 16)),), frontend="fx")
    assert prepared.repeats is None and \
        prepared.graph.meta["smp.auto_leaves"] == ("model.model",)


def _write(tmp_path: Path, doc: object) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("doc, message", [
    (None, "names a config.json or a directory holding one"),
    ({"model_type": "llama-9", "hidden_size": 8}, "model_type is one transformers knows"),
    ([1, 2], "must hold a JSON object"),
    ({"model_type": "t5"}, "has a causal language model"),
])
def test_bad_configs_are_named(tmp_path: Path, doc: object, message: str) -> None:
    path = tmp_path / "missing.json" if doc is None else _write(tmp_path, doc)
    with pytest.raises(SMPConfigError, match=message):
        hf_config.prepare_config(path, 16)

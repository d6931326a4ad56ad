"""Expert and context parallelism in the planner: the experts found, their state divided by
ep, activations by cp (the outputs too under ``--cp-local-outputs``), the exchanges priced on
the link their group spans, and ``--fix ep=N`` / ``--fix cp=N`` written by ``--emit-config``
as a configuration smp.init accepts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cost_model.cluster import get_cluster
from cost_model.collectives import collective_time
from cost_model.errors import SMPError
from cost_model.memory import state_bytes
from smp_fx.cli import plan as plan_cli
from smp_fx.config import validate
from smp_fx.planner.candidate import Candidate
from smp_fx.planner.exchange import is_expert
from smp_fx.planner.model import Profiler
from smp_fx.planner.stages import Ranks, rank_loads
from smp_fx.planner.step import Setting, exchange_times, held_elems, price

ROOT = Path(__file__).resolve().parents[3]
MIXTRAL = ROOT / "tests" / "data" / "hf_tiny_mixtral" / "config.json"
LLAMA = ROOT / "tests" / "data" / "hf_tiny_llama"
SEQ, MBS = 32, 2
CLUSTER = get_cluster("dgx-h100")


@pytest.fixture(scope="module")
def mixtral() -> tuple[Profiler, Ranks, int, dict]:
    """The tiny Mixtral's profile at MBS, its one-rank loads, expert elements and config."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    from smp_fx.planner.hf_config import load_config, prepare_config

    config = load_config(MIXTRAL)
    with torch.device("meta"):
        whole = AutoModelForCausalLM.from_config(config)
    experts = sum(p.numel() for n, p in whole.named_parameters() if is_expert(n, p))
    profiler = Profiler(prepare_config(MIXTRAL, SEQ), CLUSTER)
    prof = profiler(MBS, 1, False)
    ranks = rank_loads(prof, "none", 1, 1, "interleaved", CLUSTER.device, 1.0)
    assert ranks is not None
    return profiler, ranks, experts, json.loads(MIXTRAL.read_text())


def _cand(dp: int, ep: int = 1, cp: int = 1) -> Candidate:
    return Candidate(1, 1, dp, MBS, 1, "interleaved", "none", False, "none", ep, cp)


def test_expert_state_halves_at_ep2(mixtral) -> None:
    profiler, ranks, experts, _ = mixtral
    assert experts > 0 and ranks.experts == (experts,)
    setting = Setting(CLUSTER, 4, 4 * MBS)
    prof = profiler(MBS, 1, False)
    one, two = (price(_cand(4, ep), ranks, prof, setting).memory for ep in (1, 2))
    s = state_bytes("bf16")
    assert one.params - two.params == experts // 2 * s.param
    assert one.optimizer - two.optimizer == experts // 2 * s.optimizer
    assert one.activations == two.activations


def test_a_rank_reduces_its_share_of_the_experts(mixtral) -> None:
    profiler, ranks, experts, _ = mixtral
    held = ranks.elems[0] - experts // 2
    assert held_elems(ranks, 2) == (held,) and held_elems(ranks, 1) == ranks.elems
    two = price(_cand(4, 2), ranks, profiler(MBS, 1, False), Setting(CLUSTER, 4, 4 * MBS))
    reduce = collective_time("all_reduce", held * state_bytes("bf16").reduce, 4,
                             CLUSTER.fabric())
    assert two.comm.dp == pytest.approx(reduce.seconds)


def test_expert_slices_sharded_over_their_replicas_under_fsdp(mixtral) -> None:
    """fsdp at dp 4, ep 2: a rank keeps experts / (ep x dp / ep) of the experts' state and
    gathers its slice whole (and its gradient) for the step, as the runtime's root unit:
    a gather and a reduce-scatter per microbatch, not hidden."""
    profiler, ranks, experts, _ = mixtral
    setting = Setting(CLUSTER, 4, 4 * MBS)
    prof = profiler(MBS, 1, False)
    priced = {ep: price(Candidate(1, 1, 4, MBS, 1, "interleaved", "none", False, "fsdp", ep,
                                  1), ranks, prof, setting) for ep in (1, 2)}
    mem = {ep: p.memory for ep, p in priced.items()}
    s = state_bytes("bf16")
    small = ranks.small[0] if ranks.small else 0
    root = sum(collective_time(kind, experts // 2 * b, 4, CLUSTER.fabric()).seconds
               for kind, b in (("all_gather", s.param), ("reduce_scatter", s.reduce)))
    alone = collective_time("all_reduce", small * s.reduce, 4, CLUSTER.fabric()).seconds
    assert priced[2].comm.dp_exposed == pytest.approx(alone + priced[2].microbatches * root)
    assert mem[1].params == mem[2].params and mem[1].optimizer == mem[2].optimizer
    pair = 2 * (s.param + s.grad)  # two gathered units: at ep 2 without their experts
    layer = ranks.layer_elems
    layer2 = -(-layer * (ranks.elems[0] - experts) // ranks.elems[0])
    assert mem[2].buffers - layer2 * pair - experts // 2 * (s.param + s.grad) \
        == mem[1].buffers - layer * pair


def test_dispatch_is_tokens_times_top_k_times_hidden(mixtral) -> None:
    _, ranks, _, cfg = mixtral
    picks = MBS * SEQ * cfg["num_experts_per_tok"]
    assert ranks.dispatch == (cfg["num_hidden_layers"] * picks * cfg["hidden_size"] * 2,)


@pytest.mark.parametrize("ep, nodes", [(8, 1), (16, 2)])
def test_all_to_all_priced_on_the_link_its_group_spans(mixtral, ep, nodes) -> None:
    _, ranks, _, _ = mixtral
    fabric = CLUSTER.fabric()
    ep_s, cp_s = exchange_times(_cand(ep, ep), ranks, fabric)
    one = collective_time("all_to_all", ranks.dispatch[0], ep, fabric, nodes=nodes)
    assert ep_s == [4 * one.seconds] and cp_s == [0.0]
    inside = collective_time("all_to_all", ranks.dispatch[0], ep, fabric)
    assert (one.seconds > inside.seconds) == (nodes > 1)


def test_cp_divides_activations_and_prices_the_kv_exchange(mixtral) -> None:
    profiler, ranks, _, _ = mixtral
    assert ranks.kv[0] > 0
    setting = Setting(CLUSTER, 4, 4 * MBS)
    prof = profiler(MBS, 1, False)
    one, two = (price(_cand(4 // cp, cp=cp), ranks, prof, setting) for cp in (1, 2))
    assert two.memory.activations == round((one.memory.activations + ranks.kv[0]) / 2)
    fabric = CLUSTER.fabric()
    kv = (collective_time("all_gather", ranks.kv[0], 2, fabric).seconds
          + collective_time("reduce_scatter", ranks.kv[0], 2, fabric).seconds)
    assert two.comm.cp == pytest.approx(two.microbatches * kv) and one.comm.cp == 0.0


def test_cp_local_outputs_hold_a_cp_th_of_the_outputs(
        mixtral: tuple[Profiler, Ranks, int, dict[str, Any]]) -> None:
    profiler, ranks, _, _ = mixtral
    prof = profiler(MBS, 1, False)
    assert prof.output_bytes > 0
    gathered, local = (Setting(CLUSTER, 4, 4 * MBS, cp_local_outputs=flag)
                       for flag in (False, True))
    for cp in (1, 2):
        whole, mine = (price(_cand(4 // cp, cp=cp), ranks, prof, s).memory
                       for s in (gathered, local))
        assert whole.outputs == 2 * prof.output_bytes
        assert mine.outputs == 2 * prof.output_bytes // cp
        assert whole.total - mine.total == whole.outputs - mine.outputs


@pytest.mark.parametrize("model, fix, key", [
    (["--hf-config", str(MIXTRAL)], "ep=2", "expert_parallel_degree"),
    (["--hf-config", str(LLAMA), "--cp-local-outputs"], "cp=2", "context_parallel_degree"),
])
def test_fixed_degree_round_trips_through_emit_config(tmp_path, model, fix, key) -> None:
    pytest.importorskip("transformers")
    cfg_path, plan_path = tmp_path / "cfg.json", tmp_path / "plan.json"
    args = [*model, "--seq-len", str(SEQ), "--device", "a100", "--gpus", "2",
            "--global-batch", "4", "--quiet", "--top", "1", "--fix", fix,
            "--emit-config", str(cfg_path), "--json", str(plan_path)]
    assert plan_cli.main(args) == 0
    cfg = json.loads(cfg_path.read_text())
    assert cfg[key] == 2
    assert cfg.get("context_parallel_local_outputs", False) == ("--cp-local-outputs" in model)
    validate(cfg, 2)
    best = json.loads(plan_path.read_text())["best"]
    assert best[fix.split("=")[0]] == 2


def test_ep_kept_to_divisors_of_the_expert_count(mixtral) -> None:
    from smp_fx.planner.planner import plan

    profiler = mixtral[0]
    setting = Setting(CLUSTER, 16, 16 * MBS)
    fixed = {"tp": 1, "pp": 1, "cp": 1, "mbs": MBS, "recompute": "none", "zero": "none"}
    planned = plan(profiler.prepared, setting, fixed=fixed, top_k=50)
    assert {r.ep for r in planned.records} == {1, 2, 4}  # 4 experts, dp 16
    with pytest.raises(SMPError, match="ep 8 must divide"):
        plan(profiler.prepared, setting, fixed={**fixed, "ep": 8}, top_k=1)

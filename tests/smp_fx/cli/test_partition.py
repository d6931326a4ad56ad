"""``smp-fx partition``: the table, the files it writes, --compare, and bad input -> exit 2.

The CLI runs in-process through ``main(argv)`` for speed; one test runs the installed
console script in a subprocess.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import smp_fx as smp
from cost_model.devices import A100
from passes.partitioning.extract import COMPUTE_OPS
from passes.plan import PartitionPlan
from passes.split_stages import StagedProgram
from smp_fx.cli import main as cli_main
from smp_fx.cli.partition import load_model_file, main
from smp_fx.world import state

ROOT = Path(__file__).resolve().parents[3]
MODELS = ROOT / "examples" / "models"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--quiet"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "hf_gpt2", "hf_bert"])
def test_table_for_four_partitions(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   name: str) -> None:
    code, out, err = _run(capsys, str(MODELS / f"{name}.py"), "--partitions", "4",
                          "--microbatches", "2", "--batch-size", "4", "--json",
                          str(tmp_path / "plan.json"))
    assert code == 0, err
    plan = PartitionPlan.loads((tmp_path / "plan.json").read_text())
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("stage"))
    for column in ("modules", "params", "FLOPs", "time", "memory", "recv", "send", "cost"):
        assert column in lines[header]
    rows = lines[header + 2: header + 6]
    assert [r.split()[0].lstrip("*") for r in rows] == ["0", "1", "2", "3"]
    marked = [r.split()[0].startswith("*") for r in rows]
    assert marked.index(True) == plan.bottleneck_stage and sum(marked) == 1
    for row, stage in zip(rows, plan.stages):
        assert row.split()[-1] == f"{stage.cost:.4f}"
        assert f" {len(stage.params)} " in row
    assert sum(len(s.nodes) for s in plan.stages) > 4
    summary = lines[-1]
    assert summary.startswith(f"objective {plan.objective:.4f}  lower bound "
                              f"{plan.lower_bound:.4f}  ratio {plan.ratio:.3f}")
    assert f"bubble {plan.bubble_fraction:.1%}" in summary


def test_json_dot_timeline_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_path, dot_path, png_path = tmp_path / "p.json", tmp_path / "p.dot", tmp_path / "t.png"
    trace_path = tmp_path / "trace.json"
    code, out, err = _run(capsys, str(MODELS / "gpt.py"), "--partitions", "2",
                          "--microbatches", "4", "--batch-size", "8", "--pipeline", "simple",
                          "--memory-weight", "0.2", "--json", str(plan_path), "--dot",
                          str(dot_path), "--timeline", str(png_path), "--chrome-trace",
                          str(trace_path))
    assert code == 0, err
    plan = PartitionPlan.loads(plan_path.read_text())
    assert plan.config.num_stages == 2 and plan.config.pipeline == "simple"
    assert plan.config.memory_weight == 0.2 and plan.config.microbatches == 4
    assert f"objective {plan.objective:.4f}" in out
    dot = dot_path.read_text()
    assert dot.startswith("digraph plan {") and dot.rstrip().endswith("}")
    assert "subgraph cluster_stage0" in dot and "subgraph cluster_stage1" in dot
    assert "color=red" in dot  # a boundary edge, labelled with its bytes
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace_path.read_text())["traceEvents"]
    assert len(events) == 2 * 2 * 4  # stages x (F, B) x microbatches
    assert {e["name"] for e in events if e["tid"] == 1} >= {"1F0", "1B3"}


def test_config_file_and_flag_override(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"partitions": 4, "microbatches": 2, "memory_weight": 0.5}))
    out_json = tmp_path / "p.json"
    code, _, err = _run(capsys, str(MODELS / "mlp.py"), "--config", str(cfg), "--partitions",
                        "2", "--json", str(out_json), "--batch-size", "4")
    assert code == 0, err
    plan = json.loads(out_json.read_text())
    assert plan["config"]["num_stages"] == 2 and plan["config"]["memory_weight"] == 0.5


def test_manual_partition(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, str(MODELS / "mlp_manual.py"), "--partitions", "2",
                          "--no-auto-partition", "--default-partition", "1")
    assert code == 0, err
    assert "strategy manual" in out and "blocks.[0-2]" in out and "blocks.[3-4], head" in out


def test_compare_lists_every_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    from passes.partitioning.baselines import BASELINES

    code, out, err = _run(capsys, str(MODELS / "cnn.py"), "--partitions", "2", "--compare")
    assert code == 0, err
    table = out[out.index("strategy  "):].splitlines()
    assert "/ lower bound" in table[0]
    names = [line.split()[0] for line in table[2:] if line.strip()]
    assert names[0] == "smp-fx"
    for baseline in BASELINES:
        assert baseline in out
    ours = float(table[2].split()[2])
    others = [float(line.split()[1]) for line in table[3:] if line.split()[0] in BASELINES]
    assert others and all(ours <= o + 1e-9 for o in others)


NESTED_MODEL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, batch, table):
        h = self.a(batch["x"][0]).relu() @ table
        return self.b(h) + batch["x"][1]


def build_model():
    return Net()


def example_inputs(batch_size):
    return ({"x": [torch.randn(batch_size, 8), torch.randn(batch_size, 8)]},
            torch.randn(8, 8))
"""


def _runtime_plan(path: Path, config: dict[str, object], batch: int,
                  non_split: tuple[str, ...]) -> tuple[PartitionPlan, StagedProgram]:
    """DistributedModel's plan and staged program at its first step on this batch."""
    example = load_model_file(str(path))
    state._reset()
    smp.init(config)
    model = smp.DistributedModel(example.build_model())

    @smp.step(non_split_inputs=non_split)
    def forward(model: object, batch: object, table: object = None) -> object:
        return model(batch) if table is None else model(batch, table)

    with torch.no_grad():
        forward(model, *example.example_inputs(batch))
    assert model.plan is not None
    return model.plan, model.program


@pytest.mark.parametrize("name", ["gpt", "hf_gpt2", "nested"])
def test_the_cli_plans_what_distributed_model_runs(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   name: str) -> None:
    """Same model file, configuration and global batch: ``smp-fx partition --json`` and
    ``DistributedModel`` make the same plan, and the runtime's stages compute the planned
    nodes. gpt is fx-traced (tied weights), hf_gpt2 export-captured; nested has a dict of
    a list of tensors split per microbatch and a table passed whole (``non_split_inputs``)."""
    path = MODELS / f"{name}.py"
    flags, non_split = [], ()
    if name == "nested":
        path = tmp_path / "nested.py"
        path.write_text(NESTED_MODEL, encoding="utf-8")
        flags, non_split = ["--non-split-input", "table"], ("table",)
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "pipeline": "interleaved",
              "memory_weight": 0.5}
    config_file = tmp_path / "smp.json"
    config_file.write_text(json.dumps(config), encoding="utf-8")
    code, _, err = _run(capsys, str(path), "--config", str(config_file), "--batch-size", "4",
                        "--device", "cpu", "--json", str(tmp_path / "plan.json"), *flags)
    assert code == 0, err
    offline = PartitionPlan.loads((tmp_path / "plan.json").read_text())
    runtime, program = _runtime_plan(path, config, 4, non_split)

    assert [s.nodes for s in runtime.stages] == [s.nodes for s in offline.stages]
    assert runtime.objective == offline.objective
    assert [(s.received, s.sent) for s in runtime.stages] == \
        [(s.received, s.sent) for s in offline.stages]
    assert runtime.dumps() == offline.dumps()  # config, device, costs and memory too
    ran = [[n.name for n in stage.module.graph.nodes if n.op in COMPUTE_OPS]
           for stage in program.stages]
    computed = {n for names in ran for n in names}
    assert ran == [[n for n in s.nodes if n in computed] for s in offline.stages]
def test_device_spec_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--device takes a spec file (smp-fx calibrate -o FILE.json): the plan is priced with
    it, records it, and a slower link than the built-in's shows in the boundary times."""
    spec = dataclasses.replace(A100, name="my-box", link_bandwidth=1e6, link_latency_s=1e-3,
                               step_overhead_s=0.5)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec.to_json()), encoding="utf-8")
    plans = {}
    for device in (str(path), "a100"):
        code, out, err = _run(capsys, str(MODELS / "mlp.py"), "--partitions", "2",
                              "--device", device, "--json", str(tmp_path / "plan.json"))
        assert code == 0, err
        plans[device] = PartitionPlan.loads((tmp_path / "plan.json").read_text())
    mine = plans[str(path)]
    assert out.startswith("plan: 2 stages on a100") and mine.config.device == "my-box"
    assert mine.spec().name == "my-box" and mine.spec().link_bandwidth == 1e6
    s0 = mine.stages[0]
    assert s0.comm_time_s == pytest.approx(1e-3 + s0.out_bytes / 1e6, rel=1e-6)
    assert mine.step_time_s >= 0.5 > plans["a100"].step_time_s
    path.write_text(json.dumps({**spec.to_json(), "schema_version": 1}), encoding="utf-8")
    code, _, err = _run(capsys, str(MODELS / "mlp.py"), "--partitions", "2", "--device",
                        str(path))
    assert code == 2 and "schema_version" in err and "smp-fx calibrate" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing_model.py", "--partitions", "2"], "model file not found"),
        (["{mlp}", "--partitions", "2", "--build-fn", "nope"], "must define a function nope"),
        (["{mlp}"], "pipeline_parallel_degree"),
        (["{mlp}", "--partitions", "2", "--microbatches", "3", "--batch-size", "4"],
         "divisible by microbatches"),
        (["{mlp}", "--partitions", "500"], "more partitions than compute nodes"),
        (["{mlp}", "--partitions", "2", "--inputs-fn", "loss_fn"], "could not be called"),
        (["{mlp}", "--partitions", "2", "--build-fn", "example_inputs"], "torch.nn.Module"),
        (["{mlp}", "--partitions", "2", "--config", "/nonexistent/cfg.json"], "No such file"),
        (["{mlp}", "--partitions", "2", "--non-split-input", "x"], "no parameter of this name"),
        (["{mlp}", "--partitions", "2", "--input-split-axis", "input=x"],
         "must be an integer"),
        (["{mlp}", "--partitions", "2", "--device", "/nonexistent/spec.json"],
         "built-in name or a JSON file"),
        (["{mlp}", "--partitions", "2", "--activation-checkpointing", "nothing.*"],
         "no module path matches"),
        (["{mlp}", "--partitions", "2", "--microbatches", "1", "--offload"],
         "offload_activations"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str],
                                          message: str) -> None:
    argv = [a.replace("{mlp}", str(MODELS / "mlp.py")) for a in argv]
    code, out, err = _run(capsys, *argv)
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("smp-fx partition: error:")]
    assert len(errors) == 1 and message in errors[0]
    assert "Traceback" not in err


@pytest.mark.multiproc
def test_dispatch_and_console_script(tmp_path: Path) -> None:
    assert "partition" in cli_main.COMMANDS
    exe = Path(sys.executable).with_name("smp-fx")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "smp_fx.cli.main"]
    result = subprocess.run([*cmd, "partition", str(MODELS / "mlp.py"), "--partitions", "2",
                             "--json", str(tmp_path / "p.json")], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert "bottleneck stage" in result.stdout
    assert "trace" in result.stderr  # progress lines
    assert (tmp_path / "p.json").exists()


def test_activation_checkpointing_shows_the_memory_breakdown(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Checkpointing every block keeps less per microbatch, adds recomputation to the
    backward and a transient; the breakdown is printed and the JSON records the rules."""
    gpt = str(MODELS / "gpt.py")
    base = [gpt, "--partitions", "2", "--microbatches", "4", "--device", "a100",
            "--memory-weight", "1.0"]
    code, plain_out, _ = _run(capsys, *base, "--memory", "--json", str(tmp_path / "a.json"))
    assert code == 0 and "memory per stage" in plain_out
    code, out, _ = _run(capsys, *base, "--activation-checkpointing", "h.*", "--offload",
                        "--json", str(tmp_path / "b.json"))
    assert code == 0 and "memory per stage" in out and "offloaded/mb" in out
    plain = PartitionPlan.loads((tmp_path / "a.json").read_text())
    plan = PartitionPlan.loads((tmp_path / "b.json").read_text())
    assert {r.module_path for r in plan.config.checkpointing} >= {"h.0", "h.1"}
    assert plan.config.offload_activations
    per_mb = sum(st.memory.activations_per_microbatch for st in plan.stages)
    assert per_mb < sum(st.memory.activations_per_microbatch for st in plain.stages)
    assert any(st.checkpointed and st.recompute_time_s > 0 and st.memory.recompute_transient
               for st in plan.stages)


META_MODEL = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    cfg = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                     use_cache=False, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        return GPT2LMHeadModel(cfg)


def example_inputs(batch_size=2):
    return (torch.randint(0, 128, (batch_size, 16)),)
'''


def test_a_model_built_on_meta_plans_with_cpu_inputs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Hugging Face model built under ``with torch.device("meta")``, as HF and accelerate
    users build big models, with CPU example inputs."""
    path = tmp_path / "meta_gpt2.py"
    path.write_text(META_MODEL)
    code, out, err = _run(capsys, str(path), "--partitions", "2", "--json",
                          str(tmp_path / "plan.json"))
    assert code == 0, err
    plan = PartitionPlan.loads((tmp_path / "plan.json").read_text())
    assert len(plan.stages) == 2 and all(s.fwd_flops > 0 for s in plan.stages)


TP_MODEL = '''
import torch
from torch import nn
import smp_fx as smp


def build_model():
    layers = [nn.Linear(8, 64)]
    with smp.tensor_parallelism():
        layers += [nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)]
        layers += [nn.Linear(64, 30)]  # 30 output features: not divisible by 4
    return nn.Sequential(*layers, nn.Linear(30, 4))


def example_inputs(batch_size=4):
    return (torch.randn(batch_size, 8),)
'''


def test_tensor_parallel_degree_shows_one_ranks_costs_and_the_shards(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tp_model.py"
    path.write_text(TP_MODEL)
    plans = {}
    for tp in (1, 2):
        code, out, err = _run(capsys, str(path), "--partitions", "2",
                              "--tensor-parallel-degree", str(tp), "--json",
                              str(tmp_path / f"tp{tp}.json"))
        assert code == 0, err
        plans[tp] = json.loads((tmp_path / f"tp{tp}.json").read_text())
        if tp == 2:
            assert "tensor parallel: degree 2" in out
            assert "sharded     1.weight: (256, 64) split on dim 0 into 2" in out
            assert "pairs (column -> row): 1 -> 3" in out
    param_bytes = [sum(s["param_bytes"] for s in plans[tp]["stages"]) for tp in (1, 2)]
    sharded = (256 * 64 + 256 + 64 * 256 + 30 * 64 + 30) * 4  # fc pair + lone 30-wide head
    assert param_bytes[1] == param_bytes[0] - sharded // 2
    code, out, err = _run(capsys, str(path), "--partitions", "2",
                          "--tensor-parallel-degree", "4")
    assert code == 0, err
    assert "replicated" in out and "not divisible by tensor_parallel_degree 4" in out


TP_BLOCKS = '''
import torch
from torch import nn
import smp_fx as smp


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.fc1 = nn.Linear(16, 64)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(64, 16)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


def build_model():
    blocks = [Block() for _ in range(4)]
    for block in blocks:
        smp.set_tensor_parallelism(block)
    return nn.Sequential(*blocks)


def example_inputs(batch_size=4):
    return (torch.randn(batch_size, 32, 16),)
'''


def test_optimize_memory_chunks_the_sequence_and_the_plan_holds_less(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tp_blocks.py"
    path.write_text(TP_BLOCKS)
    totals = {}
    for optimize in ("speed", "memory"):
        config = tmp_path / f"{optimize}.json"
        config.write_text(json.dumps({"optimize": optimize, "memory_weight": 0.5}))
        code, out, err = _run(capsys, str(path), "--partitions", "2", "--config", str(config),
                              "--tensor-parallel-degree", "2", "--json",
                              str(tmp_path / f"plan_{optimize}.json"))
        assert code == 0, err
        assert ("sequence-parallel (optimize: memory)" in out) == (optimize == "memory")
        plan = json.loads((tmp_path / f"plan_{optimize}.json").read_text())
        totals[optimize] = sum(s["memory"]["activations"] for s in plan["stages"])
    assert "1.ln.weight" in out and "0.fc2.bias" in out
    assert totals["memory"] < totals["speed"]

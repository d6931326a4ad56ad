"""``smp-fx run``: SMP and smddp scripts run unchanged on 2 processes; options and config
are checked in the launcher; the smdistributed names exist only inside launched scripts."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cost_model.errors import SMPConfigError
from smp_fx.cli.main import main as cli_main
from smp_fx.cli.run import build, parser, run_export_cache

REPO = Path(__file__).resolve().parents[3]

SMP_SCRIPT = """
import smdistributed.modelparallel.torch as smp
import smp_fx
assert smp is smp_fx
smp.init()
import os
fields = ("RANKS", smp.rank(), smp.size(), smp.pp_rank(), smp.pp_size(), smp.dp_rank(),
          smp.get_mp_group(), smp.state.get().config.microbatches)
# one write(2) per line: both ranks share the pipe, and print() may split a line
os.write(1, (" ".join(map(str, fields)) + chr(10)).encode())
"""

# The structure of the smddp guide's example (seed smddp_pytorch_guide.rst), CPU-sized.
SMDDP_SCRIPT = """
import os
import torch
import torch.nn as nn
import smdistributed.dataparallel.torch.torch_smddp
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group(backend='smddp')

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 1)
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

def main():
    torch.set_num_threads(1)
    batch_size = 8
    batch_size //= dist.get_world_size()
    batch_size = max(batch_size, 1)
    g = torch.Generator().manual_seed(0)
    train_dataset = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g),
                                                   torch.randn(32, 1, generator=g))
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=batch_size,
                                               sampler=train_sampler)
    torch.manual_seed(dist.get_rank())  # different init per rank: DDP must broadcast rank 0's
    model = DDP(Net())
    local_rank = int(os.environ["LOCAL_RANK"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in train_loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    fields = ("SMDDP", dist.get_rank(), local_rank, dist.get_backend(), batch_size,
              repr(flat.sum().item()))
    os.write(1, (" ".join(map(str, fields)) + chr(10)).encode())  # one write: shared pipe
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), os.environ["CKPT"])

if __name__ == '__main__':
    main()
"""


def _why(res: subprocess.CompletedProcess[str]) -> str:
    """The children's own messages come first in stderr; torchrun's summary last."""
    err = res.stderr
    return err if len(err) < 8000 else err[:6000] + "\n...\n" + err[-2000:]


def _run_cli(args: list[str], tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "smp_fx.cli.main", *args], cwd=tmp,
                          capture_output=True, text=True, timeout=150,
                          env={**os.environ, "SMP_FX_TIMEOUT_S": "60", **env})


@pytest.mark.multiproc
def test_smp_script_under_smp_fx_run(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent(SMP_SCRIPT))
    (tmp_path / "cfg.json").write_text(json.dumps({"partitions": 2, "microbatches": 4}))
    res = _run_cli(["run", "-n", "2", "--config", "cfg.json", "train.py"], tmp_path)
    assert res.returncode == 0, _why(res)
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("RANKS"))
    assert lines == ["RANKS 0 2 0 2 0 [0, 1] 4", "RANKS 1 2 1 2 0 [0, 1] 4"]


@pytest.mark.multiproc
def test_smddp_guide_script_runs_ddp(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent(SMDDP_SCRIPT))
    ckpt = tmp_path / "model.pt"
    res = _run_cli(["run", "-n", "2", "train.py"], tmp_path, CKPT=str(ckpt))
    assert res.returncode == 0, _why(res)
    rows = sorted(line.split() for line in res.stdout.splitlines()
                  if line.startswith("SMDDP"))
    assert [r[1:5] for r in rows] == [["0", "0", "smddp", "4"], ["1", "1", "smddp", "4"]]
    assert rows[0][5] == rows[1][5], "DDP replicas diverged"
    assert ckpt.exists()


def test_shims_are_not_importable_outside_smp_fx_run() -> None:
    assert importlib.util.find_spec("smdistributed") is None


def _ns(*argv: str):  # noqa: ANN202 - argparse.Namespace
    return parser().parse_args(list(argv))


def test_build_single_node_and_environment(tmp_path: Path) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"pipeline_parallel_degree": 2}))
    cmd, env = build(_ns("-n", "4", "--config", str(cfg), "--backend", "gloo", "t.py", "--lr",
                         "1"), {"PYTHONPATH": "/x", "SM_HP_MP_PARAMETERS": '{"ddp": true}'})
    assert cmd[1:] == ["-m", "smp_fx.cli.torchrun", "--nproc-per-node", "4", "--standalone",
                       "t.py", "--lr", "1"]
    assert json.loads(env["SM_HP_MP_PARAMETERS"]) == {"ddp": True,
                                                      "pipeline_parallel_degree": 2}
    assert env["PYTHONPATH"].endswith(os.pathsep + "/x")
    assert Path(env["PYTHONPATH"].split(os.pathsep)[0], "smdistributed").is_dir()
    assert env["SMP_FX_BACKEND"] == "gloo"


def test_a_run_keeps_its_exports_for_its_restarts_unless_the_caller_chose(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from passes.export_cache import ENV

    monkeypatch.delenv(ENV, raising=False)
    assert run_export_cache(str(tmp_path)) == {ENV: str(tmp_path / "export_cache")}
    for chosen in ("", "/elsewhere"):  # off, or the caller's own directory
        monkeypatch.setenv(ENV, chosen)
        assert run_export_cache(str(tmp_path)) == {}


def test_build_multi_node_passes_through() -> None:
    cmd, _ = build(_ns("-n", "8", "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", "h0:29400", "--rdzv-id", "j1", "t.py"), {})
    assert "--standalone" not in cmd
    joined = " ".join(cmd)
    for part in ("--nnodes 2", "--node-rank 1", "--rdzv-backend c10d",
                 "--rdzv-endpoint h0:29400", "--rdzv-id j1"):
        assert part in joined


def test_build_node_range_exports_the_full_world(tmp_path: Path) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"pipeline_parallel_degree": 2}))
    cmd, env = build(_ns("-n", "2", "--nnodes", "1:2", "--rdzv-conf", "last_call_timeout=5",
                         "--rdzv-endpoint", "h0:29400", "--config", str(cfg), "t.py"), {})
    assert "--nnodes 1:2" in " ".join(cmd) and "--rdzv-conf last_call_timeout=5" in " ".join(cmd)
    assert env["SMP_FX_FULL_WORLD_SIZE"] == "4"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    cfg.write_text(json.dumps({"pipeline_parallel_degree": 4}))
    with pytest.raises(SMPConfigError, match="every node count of --nnodes"):
        build(_ns("-n", "2", "--nnodes", "1:2", "--config", str(cfg), "t.py"), {})


def test_bad_config_rejected_by_launcher(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"partitions": 3, "microbatchs": 2}))
    assert cli_main(["run", "-n", "2", "--config", str(cfg), "t.py"]) == 2
    assert "did you mean 'microbatches'" in capsys.readouterr().err
    cfg.write_text(json.dumps({"partitions": 3}))
    assert cli_main(["run", "-n", "2", "--config", str(cfg), "t.py"]) == 2
    assert "divisible" in capsys.readouterr().err


def test_dispatch(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err
    assert cli_main(["--help"]) == 0
    assert "run" in capsys.readouterr().out
    assert cli_main(["run", "-n", "2", "--dry-run", "t.py"]) == 0
    assert "smp_fx.cli.torchrun" in capsys.readouterr().out


def test_shim_modules_map_to_smp_fx_and_torch() -> None:
    """What a launched script sees, checked in-process (path and modules restored after)."""
    import importlib
    import sys as _sys

    import torch
    import torch.distributed as dist

    import smp_fx
    from smp_fx._compat import SHIM_DIR

    before = set(_sys.modules)
    _sys.path.insert(0, str(SHIM_DIR))
    try:
        smp = importlib.import_module("smdistributed.modelparallel.torch")
        assert smp is smp_fx
        importlib.import_module("smdistributed.dataparallel.torch.torch_smddp")
        sdist = importlib.import_module("smdistributed.dataparallel.torch.distributed")
        parallel = importlib.import_module("smdistributed.dataparallel.torch.parallel")
        assert issubclass(parallel.DistributedDataParallel,
                          torch.nn.parallel.DistributedDataParallel)
        sdist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)
        try:
            assert dist.get_backend() == "smddp"
            assert (sdist.get_rank(), sdist.get_world_size(), sdist.get_local_rank()) == (0, 1, 0)
            t = torch.arange(4.0)
            sdist.broadcast(t)  # the guide's default src=0
            out = torch.empty(4)
            sdist.all_to_all_single(output_t=out, input_t=t)  # the guide's argument names
            assert torch.equal(out, t)
            # the guide's positional order: module, device_ids, output_device,
            # broadcast_buffers (torch's own third parameter is dim)
            ddp = parallel.DistributedDataParallel(torch.nn.BatchNorm1d(2), None, None, False)
            synced = getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None))
            assert ddp.device_ids is None and synced is False
        finally:
            dist.destroy_process_group()
    finally:
        _sys.path.remove(str(SHIM_DIR))
        for name in set(_sys.modules) - before:
            if name.startswith("smdistributed"):
                del _sys.modules[name]

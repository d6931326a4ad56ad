"""Imported once by the forkserver of ``tests.helpers.dist.run_ranks``: this CPU's quick
device spec (the built-in "cpu" spec planning uses without ``SMP_FX_DEVICE_SPEC``) measured
there with one intra-op thread, as a rank measures it, so the ranks forked from the server
inherit it (``quick_cpu_spec`` caches it per process) and rank 0 of each spawn does not
measure it again (0.5 CPU s a spawn). It also imports every public name of ``smp_fx`` (the
package loads them on first use), so no rank imports them again, and warms what a rank's
first model pays once per process (``warm``), without smp's state, a process group or a
thread."""

from __future__ import annotations

import torch
from torch import nn

import smp_fx
from cost_model.calibrate import quick_cpu_spec
from examples.models import hf_zoo
from passes import trace_memo
from passes.trace import trace


class _Scaled(nn.Module):  # a code object of its own: no test's dynamo cache entry
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x) * 2


def warm() -> None:
    """A tiny Hugging Face model captured by ``torch.export`` (trace), one Adam step on
    the graph, and a module compiled with ``aot_eager``: the ~600 modules export imports
    and the first uses of autograd, the optimizer and dynamo (about 0.9 CPU s a rank; 3
    CPU s once here)."""
    graph = trace(hf_zoo.build("llama", marked=False), hf_zoo.inputs("llama"))
    opt = torch.optim.Adam(graph.parameters())
    hf_zoo.loss_fn(graph(*hf_zoo.inputs("llama")), hf_zoo.targets("llama")).backward()
    opt.step()
    x = torch.randn(2, 3, requires_grad=True)
    torch.compile(_Scaled(), backend="aot_eager")(x).sum().backward()
    from tqdm import tqdm  # dynamo's progress bar started tqdm's monitor: a server forks

    if tqdm.monitor is not None:  # one thread, so the ranks do not inherit a dead one
        tqdm.monitor.exit()
        tqdm.monitor = None
    trace_memo.clear()  # a rank starts with no program remembered, as a new process does


torch.set_num_threads(1)
quick_cpu_spec()
for _name in smp_fx.__all__:
    getattr(smp_fx, _name)
warm()

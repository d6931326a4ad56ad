"""smp-fx demo: how SMP's placement strategies lay 8 ranks out (pp = tp = rdp = 2).

Run: ``python examples/demo.py`` (no processes are started; the topology is pure arithmetic).
"""

from __future__ import annotations

from smp_fx.config import load_config, resolve_topology


def show_topology(strategy: str, world_size: int = 8) -> None:
    """Print the seed-style rank table and every group kind for one placement strategy."""
    cfg = load_config({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True,
                       "placement_strategy": strategy}, env={})
    topo, _ = resolve_topology(cfg, world_size)
    print(f"placement_strategy={strategy!r} ({topo.placement}): pp={topo.pp_size} "
          f"tp={topo.tp_size} rdp={topo.rdp_size}")
    print(topo.table())
    for axis in ("mp", "dp", "pp", "tp", "rdp"):
        print(f"  {axis}_groups: {topo.groups(axis)}")
    print()


def main() -> None:
    for strategy in ("cluster", "spread"):
        show_topology(strategy)


if __name__ == "__main__":
    main()

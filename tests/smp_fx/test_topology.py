"""Pure rank arithmetic: the tables of SMP's documentation, every permutation, groups and
their invariants."""

from __future__ import annotations

import itertools

import pytest

from cost_model.errors import SMPConfigError
from smp_fx.topology import PERMUTATIONS, Topology, normalize_placement

# The tables of SMP's documentation ("Placement Strategy with Tensor Parallelism"), rows
# (rank, rdp, pp, tp).
DOC_DPT = [(0, 0, 0, 0), (1, 0, 0, 1), (2, 0, 1, 0), (3, 0, 1, 1),
            (4, 1, 0, 0), (5, 1, 0, 1), (6, 1, 1, 0), (7, 1, 1, 1)]
DOC_PTD = [(0, 0, 0, 0), (1, 1, 0, 0), (2, 0, 0, 1), (3, 1, 0, 1),
            (4, 0, 1, 0), (5, 1, 1, 0), (6, 0, 1, 1), (7, 1, 1, 1)]


@pytest.mark.parametrize("placement, table", [("DPT", DOC_DPT), ("PTD", DOC_PTD),
                                              ("cluster", DOC_DPT)])
def test_seed_tensor_parallel_tables(placement: str, table: list[tuple[int, ...]]) -> None:
    topo = Topology(pp_size=2, tp_size=2, rdp_size=2, placement=placement)
    for rank, rdp, pp, tp in table:
        assert topo.coords(rank) == (pp, tp, rdp)
        assert topo.rank_of(pp, tp, rdp) == rank


def test_seed_ranking_basics_spread() -> None:
    topo = Topology(pp_size=2, tp_size=1, rdp_size=4, placement="spread")
    assert topo.groups("mp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.groups("dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [topo.group_rank("mp", r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topo.group_rank("dp", 6) == 2


def test_seed_ranking_basics_cluster() -> None:
    topo = Topology(pp_size=2, tp_size=1, rdp_size=4, placement="cluster")
    assert topo.groups("mp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def _brute_coords(placement: str, sizes: dict[str, int]) -> list[tuple[int, int, int]]:
    """Independent enumeration: nested loops, left-most letter outermost."""
    rows = []
    ranges = [range(sizes[c]) for c in placement]
    for digits in itertools.product(*ranges):
        d = dict(zip(placement, digits))
        rows.append((d["P"], d["T"], d["D"]))
    return rows


@pytest.mark.parametrize("placement", PERMUTATIONS)
@pytest.mark.parametrize("pp, tp, rdp", [(2, 2, 2), (3, 2, 1), (1, 2, 3), (2, 3, 4)])
def test_every_permutation_matches_nested_loops(placement: str, pp: int, tp: int,
                                                rdp: int) -> None:
    topo = Topology(pp, tp, rdp, placement)
    expected = _brute_coords(placement, {"P": pp, "T": tp, "D": rdp})
    assert [topo.coords(r) for r in range(topo.world_size)] == expected
    for r in range(topo.world_size):
        assert topo.rank_of(*topo.coords(r)) == r


@pytest.mark.parametrize("placement", PERMUTATIONS)
def test_groups_partition_world_with_expected_sizes(placement: str) -> None:
    topo = Topology(2, 3, 2, placement)
    sizes = {"world": 12, "mp": 6, "dp": 6, "pp": 2, "tp": 3, "rdp": 2}
    for axis, size in sizes.items():
        groups = topo.groups(axis)
        assert all(len(g) == size == topo.size(axis) for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(12))
        for g in groups:  # members share exactly the coordinates the axis fixes
            coords = [topo.coords(r) for r in g]
            pp_same = len({c[0] for c in coords}) == 1
            rdp_same = len({c[2] for c in coords}) == 1
            if axis == "dp":
                assert pp_same and not rdp_same
            if axis == "mp":
                assert rdp_same and not pp_same
            assert g == sorted(g)
            assert [topo.group_rank(axis, r) for r in g] == list(range(size))


def test_ptd_groups_by_hand() -> None:
    topo = Topology(2, 2, 2, "PTD")
    assert topo.group("pp", 0) == [0, 4]
    assert topo.group("tp", 0) == [0, 2]
    assert topo.group("rdp", 0) == [0, 1]
    assert topo.group("dp", 0) == [0, 1, 2, 3]
    assert topo.group("mp", 1) == [1, 3, 5, 7]


@pytest.mark.parametrize("bad", ["DP", "DPTT", "XYZ", "clustered", ""])
def test_bad_placement_rejected(bad: str) -> None:
    with pytest.raises(SMPConfigError, match="permutation"):
        normalize_placement(bad)


def test_aliases_and_case() -> None:
    assert normalize_placement("Spread") == "TPD"
    assert normalize_placement("ptd") == "PTD"


def test_bad_sizes_and_ranks() -> None:
    with pytest.raises(SMPConfigError, match="pp_size"):
        Topology(0, 1, 1)
    topo = Topology(2, 1, 1)
    with pytest.raises(SMPConfigError, match="rank must be"):
        topo.coords(2)
    with pytest.raises(SMPConfigError, match="coordinate"):
        topo.rank_of(2, 0, 0)
    with pytest.raises(SMPConfigError, match="unknown group axis"):
        topo.group("xp", 0)


def test_json_round_trip_and_table() -> None:
    topo = Topology(2, 2, 2, "spread")
    assert Topology.from_json(topo.to_json()) == topo
    lines = Topology(2, 2, 2, "PTD").table().splitlines()
    assert lines[2].split() == ["1", "1", "0", "0"]


@pytest.mark.parametrize("placement", ["DPT", "TPD", "PDT"])
def test_context_parallel_ranks_sit_left_of_tp(placement: str) -> None:
    t = Topology(pp_size=2, tp_size=2, rdp_size=2, placement=placement, cp_size=2)
    assert t.world_size == 16 and t.order == placement.replace("T", "CT")
    for axis, size in (("cp", 2), ("rdp", 2), ("tp", 2), ("pp", 2), ("dp", 4), ("mp", 4)):
        groups = t.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(16))
        assert {len(g) for g in groups} == {size} == {t.size(axis)}
    for rank in range(16):
        pp, tp, rdp = t.coords(rank)
        assert t.rank_of(pp, tp, rdp, t.cp_coord(rank)) == rank
        # the cp ranks of a group share every SMP coordinate; SMP's groups share cp
        assert {t.coords(r) for r in t.group("cp", rank)} == {(pp, tp, rdp)}
        assert {t.cp_coord(r) for r in t.group("rdp", rank)} == {t.cp_coord(rank)}
    if placement == "DPT":  # adjacent, strided by tp: inside dp, outside tp
        assert t.group("cp", 0) == [0, 2] and t.group("tp", 0) == [0, 1]
    assert Topology.from_json(t.to_json()) == t
    assert "cp_rank" in t.table() and "cp_rank" not in Topology(2, 2, 2).table()

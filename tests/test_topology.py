"""Static builders of the ``topology`` package: exact edges and weights.

Expected matrices are written out by hand for small sizes and, for every size
1..17, derived from the spec's rules with matrix algebra / networkx's own grid
generator (not with the builders' code path).
"""

import subprocess
import sys
from fractions import Fraction as F
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

import topology

SIZES = range(1, 18)


def as_matrix(G):
    n = G.number_of_nodes()
    return nx.to_numpy_array(G, nodelist=range(n), weight="weight")


def circulant(first_row):
    """Row i is first_row rolled right by i: W[i][(i + off) % n] = first_row[off]."""
    first_row = np.array([float(x) for x in first_row])
    return np.array([np.roll(first_row, i) for i in range(len(first_row))])


def shift(n, k):
    """Permutation matrix with P[i][(i + k) % n] = 1."""
    return np.roll(np.eye(n), k, axis=1)


def powers_below(n, base):
    return {base**k for k in range(n + 1) if base**k < n}


# ---- expected matrices, generic rules ---------------------------------------


def expected_exponential(n, base=2):
    offsets = {0} | powers_below(n, base)
    return sum(shift(n, off) for off in offsets) / len(offsets)


def expected_symmetric_exponential(n, base=4):
    powers = powers_below(n, base)
    offsets = [0] + [off for off in range(1, n) if min(off, n - off) in powers]
    return sum(shift(n, off) for off in offsets) / len(offsets)


def default_mesh_rows(n):
    rows = int(np.floor(np.sqrt(n)))
    while n % rows:
        rows -= 1
    return rows


def expected_mesh(n, shape=None):
    rows, cols = shape if shape else (default_mesh_rows(n), n // default_mesh_rows(n))
    grid = nx.grid_2d_graph(rows, cols)
    W = np.zeros((n, n))
    for (r1, c1), (r2, c2) in grid.edges:
        a, b = r1 * cols + c1, r2 * cols + c2
        w = 1.0 / max(grid.degree((r1, c1)) + 1, grid.degree((r2, c2)) + 1)
        W[a, b] = W[b, a] = w
    W[np.diag_indices(n)] = 1.0 - W.sum(axis=1)
    return W


def expected_star(n, center=0):
    W = np.diag(np.full(n, 1.0 - 1.0 / n))
    W[center, :] = 1.0 / n
    W[:, center] = 1.0 / n
    return W


def expected_ring(n, style=0):
    if n == 1:
        return np.ones((1, 1))
    if n == 2:
        return np.full((2, 2), 0.5)
    if style == 0:
        return (np.eye(n) + shift(n, 1) + shift(n, -1)) / 3
    return (np.eye(n) + shift(n, -1 if style == 1 else 1)) / 2


def expected_fully_connected(n):
    return np.full((n, n), 1.0 / n)


CASES = {
    "exp2": (topology.ExponentialTwoGraph, expected_exponential),
    "exp_base2": (lambda n: topology.ExponentialGraph(n), expected_exponential),
    "exp_base3": (
        lambda n: topology.ExponentialGraph(n, base=3),
        lambda n: expected_exponential(n, 3),
    ),
    "symexp_base4": (topology.SymmetricExponentialGraph, expected_symmetric_exponential),
    "symexp_base2": (
        lambda n: topology.SymmetricExponentialGraph(n, base=2),
        lambda n: expected_symmetric_exponential(n, 2),
    ),
    "mesh": (topology.MeshGrid2DGraph, expected_mesh),
    "star": (topology.StarGraph, expected_star),
    "star_last": (
        lambda n: topology.StarGraph(n, center_rank=n - 1),
        lambda n: expected_star(n, n - 1),
    ),
    "ring0": (topology.RingGraph, expected_ring),
    "ring1": (lambda n: topology.RingGraph(n, 1), lambda n: expected_ring(n, 1)),
    "ring2": (lambda n: topology.RingGraph(n, 2), lambda n: expected_ring(n, 2)),
    "full": (topology.FullyConnectedGraph, expected_fully_connected),
}


def assert_graph_matches(G, expected):
    n = expected.shape[0]
    assert isinstance(G, nx.DiGraph)
    assert sorted(G.nodes) == list(range(n))
    assert set(G.edges) == {(i, j) for i in range(n) for j in range(n) if expected[i, j] != 0}
    for i, j, data in G.edges(data=True):
        assert isinstance(data["weight"], float)
        assert data["weight"] == pytest.approx(expected[i, j], abs=1e-12)
    assert all(G.has_edge(i, i) for i in range(n))
    # as Bluefog's graphs (built from a matrix) iterate: a script that walks the graph
    # itself (G.successors(rank) to line up neighbor_allgather's output) sees the same order
    assert list(G.edges) == sorted(G.edges)
    for r in range(n):
        assert list(G.successors(r)) == sorted(G.successors(r))
        assert list(G.predecessors(r)) == sorted(G.predecessors(r))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_builder_edges_and_weights_generic(case, n):
    build, expected = CASES[case]
    assert_graph_matches(build(n), expected(n))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_builder_is_doubly_stochastic(case, n):
    W = topology.mixing_matrix(CASES[case][0](n))
    # Column j = what receiver j combines: must sum to 1 for averaging.
    np.testing.assert_allclose(W.sum(axis=0), 1.0, atol=1e-12)
    # Every builder here is circulant or symmetric, hence also row-stochastic.
    np.testing.assert_allclose(W.sum(axis=1), 1.0, atol=1e-12)
    assert (W >= 0).all()


@pytest.mark.parametrize("case", ["symexp_base4", "mesh", "star", "ring0", "full"])
@pytest.mark.parametrize("n", SIZES)
def test_undirected_builders_are_symmetric(case, n):
    W = topology.mixing_matrix(CASES[case][0](n))
    np.testing.assert_allclose(W, W.T, atol=1e-15)


@pytest.mark.parametrize("n, symmetric", [(1, True), (2, True), (3, True), (4, False), (5, False)])
def test_exponential_symmetric_only_for_tiny_sizes(n, symmetric):
    W = topology.mixing_matrix(topology.ExponentialTwoGraph(n))
    assert np.allclose(W, W.T) == symmetric


@pytest.mark.parametrize("case", sorted(CASES))
def test_size_one_is_a_single_self_loop(case):
    G = CASES[case][0](1)
    assert list(G.edges(data="weight")) == [(0, 0, 1.0)]


# ---- hand-written small matrices ---------------------------------------------


def fractions(rows, denominator):
    return np.array([[float(F(x, denominator)) for x in row] for row in rows])


HAND_WRITTEN = {
    ("exp2", 4): circulant([F(1, 3), F(1, 3), F(1, 3), 0]),
    ("exp2", 5): circulant([F(1, 4), F(1, 4), F(1, 4), 0, F(1, 4)]),
    ("exp2", 6): circulant([F(1, 4), F(1, 4), F(1, 4), 0, F(1, 4), 0]),
    ("exp2", 8): circulant([F(1, 4), F(1, 4), F(1, 4), 0, F(1, 4), 0, 0, 0]),
    ("exp_base3", 4): circulant([F(1, 3), F(1, 3), 0, F(1, 3)]),
    ("exp_base3", 8): circulant([F(1, 3), F(1, 3), 0, F(1, 3), 0, 0, 0, 0]),
    ("symexp_base4", 4): circulant([F(1, 3), F(1, 3), 0, F(1, 3)]),
    ("symexp_base4", 5): circulant([F(1, 3), F(1, 3), 0, 0, F(1, 3)]),
    ("symexp_base4", 6): circulant([F(1, 3), F(1, 3), 0, 0, 0, F(1, 3)]),
    ("symexp_base4", 8): circulant([F(1, 4), F(1, 4), 0, 0, F(1, 4), 0, 0, F(1, 4)]),
    ("symexp_base2", 8): circulant([F(1, 6)] * 3 + [0, F(1, 6), 0] + [F(1, 6)] * 2),
    ("mesh", 4): fractions([[1, 1, 1, 0], [1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1]], 3),
    ("mesh", 5): fractions(
        [[2, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 1, 2]], 3
    ),
    ("mesh", 6): fractions(
        [
            [5, 3, 0, 4, 0, 0],
            [3, 3, 3, 0, 3, 0],
            [0, 3, 5, 0, 0, 4],
            [4, 0, 0, 5, 3, 0],
            [0, 3, 0, 3, 3, 3],
            [0, 0, 4, 0, 3, 5],
        ],
        12,
    ),
    ("mesh", 8): fractions(
        [
            [5, 3, 0, 0, 4, 0, 0, 0],
            [3, 3, 3, 0, 0, 3, 0, 0],
            [0, 3, 3, 3, 0, 0, 3, 0],
            [0, 0, 3, 5, 0, 0, 0, 4],
            [4, 0, 0, 0, 5, 3, 0, 0],
            [0, 3, 0, 0, 3, 3, 3, 0],
            [0, 0, 3, 0, 0, 3, 3, 3],
            [0, 0, 0, 4, 0, 0, 3, 5],
        ],
        12,
    ),
    ("star", 4): fractions([[1, 1, 1, 1], [1, 3, 0, 0], [1, 0, 3, 0], [1, 0, 0, 3]], 4),
    ("star", 5): fractions(
        [[1, 1, 1, 1, 1], [1, 4, 0, 0, 0], [1, 0, 4, 0, 0], [1, 0, 0, 4, 0], [1, 0, 0, 0, 4]], 5
    ),
    ("star_last", 4): fractions([[3, 0, 0, 1], [0, 3, 0, 1], [0, 0, 3, 1], [1, 1, 1, 1]], 4),
    ("ring0", 4): fractions([[1, 1, 0, 1], [1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 1, 1]], 3),
    ("ring0", 5): circulant([F(1, 3), F(1, 3), 0, 0, F(1, 3)]),
    ("ring1", 4): fractions([[1, 0, 0, 1], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], 2),
    ("ring2", 4): fractions([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]], 2),
    ("ring2", 6): circulant([F(1, 2), F(1, 2), 0, 0, 0, 0]),
    ("full", 4): np.full((4, 4), 0.25),
}


@pytest.mark.parametrize("case, n", sorted(HAND_WRITTEN))
def test_builder_matches_hand_written_matrix(case, n):
    assert_graph_matches(CASES[case][0](n), HAND_WRITTEN[(case, n)])


@pytest.mark.parametrize("style", [0, 1, 2])
def test_ring_of_two_is_half_half_for_every_style(style):
    assert_graph_matches(topology.RingGraph(2, style), np.full((2, 2), 0.5))


def test_symmetric_exponential_docstring_example():
    W = topology.mixing_matrix(topology.SymmetricExponentialGraph(10))
    assert set(np.flatnonzero(W[0])) == {0, 1, 4, 6, 9}
    np.testing.assert_allclose(W[0][W[0] > 0], 0.2)


def test_mesh_default_shapes():
    # rows = largest divisor <= sqrt(n): 9 -> 3x3, 12 -> 3x4, 16 -> 4x4, 17 -> 1x17.
    W9 = topology.mixing_matrix(topology.MeshGrid2DGraph(9))
    assert set(np.flatnonzero(W9[4])) == {1, 3, 4, 5, 7}
    assert W9[4, 4] == pytest.approx(1 / 5)
    assert W9[0, 1] == pytest.approx(1 / 4) and W9[0, 0] == pytest.approx(1 / 2)
    W12 = topology.mixing_matrix(topology.MeshGrid2DGraph(12))
    assert set(np.flatnonzero(W12[0])) == {0, 1, 4}
    W17 = topology.mixing_matrix(topology.MeshGrid2DGraph(17))
    assert set(np.flatnonzero(W17[5])) == {4, 5, 6}


@pytest.mark.parametrize("n, shape", [(8, (4, 2)), (8, (1, 8)), (12, (2, 6)), (6, [3, 2])])
def test_mesh_explicit_shape(n, shape):
    assert_graph_matches(topology.MeshGrid2DGraph(n, shape=shape), expected_mesh(n, tuple(shape)))


# ---- argument validation -------------------------------------------------------

ALL_BUILDERS = [
    topology.ExponentialTwoGraph,
    topology.ExponentialGraph,
    topology.SymmetricExponentialGraph,
    topology.MeshGrid2DGraph,
    topology.StarGraph,
    topology.RingGraph,
    topology.FullyConnectedGraph,
]


@pytest.mark.parametrize("bad_size", [0, -3, 2.5, "4", None, True])
@pytest.mark.parametrize("build", ALL_BUILDERS, ids=lambda b: b.__name__)
def test_bad_size_raises_naming_size(build, bad_size):
    with pytest.raises(ValueError, match="size"):
        build(bad_size)


@pytest.mark.parametrize("build", [topology.ExponentialGraph, topology.SymmetricExponentialGraph])
@pytest.mark.parametrize("bad_base", [1, 0, -2, 2.0])
def test_bad_base_raises(build, bad_base):
    with pytest.raises(ValueError, match="base"):
        build(8, base=bad_base)


@pytest.mark.parametrize("center", [-1, 4, 1.0])
def test_bad_center_rank_raises(center):
    with pytest.raises(ValueError, match="center_rank"):
        topology.StarGraph(4, center_rank=center)


@pytest.mark.parametrize("style", [-1, 3, "left"])
def test_bad_connect_style_raises(style):
    with pytest.raises(ValueError, match="connect_style"):
        topology.RingGraph(4, connect_style=style)


@pytest.mark.parametrize("shape", [(3, 3), (2,), (2, 2, 2), 8, (0, 8), (2.0, 4), {2, 4}])
def test_bad_mesh_shape_raises(shape):
    with pytest.raises(ValueError, match="shape"):
        topology.MeshGrid2DGraph(8, shape=shape)


def test_numpy_integers_are_accepted():
    G = topology.RingGraph(np.int64(5), connect_style=np.int32(1))
    assert sorted(G.nodes) == list(range(5))


def test_topology_imports_only_numpy_and_networkx():
    code = (
        "import sys, topology; "
        "bad = [m for m in ('bluefog_lite', 'torch', 'mpi4py') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_bluefog_lite_re_exports_the_topology_functions_as_bluefog_torch_does():
    """bluefog.torch re-exports these from its topology_util; scripts call bf.RingGraph etc."""
    import bluefog_lite as bf
    names = ["GetRecvWeights", "GetSendWeights", "IsRegularGraph", "IsTopologyEquivalent",
             "ExponentialTwoGraph", "ExponentialGraph", "FullyConnectedGraph", "MeshGrid2DGraph", "RingGraph",
             "StarGraph", "SymmetricExponentialGraph", "GetDynamicOnePeerSendRecvRanks",
             "GetExp2DynamicSendRecvMachineRanks", "GetInnerOuterRingDynamicSendRecvRanks",
             "GetInnerOuterExpo2DynamicSendRecvRanks"]
    for name in names:
        assert getattr(bf, name) is getattr(topology, name), name
        assert name in bf.__all__ and name in dir(bf), name
    assert sorted(bf.RingGraph(4).edges()) == sorted(topology.RingGraph(4).edges())


def test_is_power_of_is_exact_in_integers():
    assert topology.isPowerOf(243, 3) and topology.isPowerOf(1, 5) and topology.isPowerOf(2 ** 60, 2)
    assert not topology.isPowerOf(12, 2) and not topology.isPowerOf(3 ** 20 + 1, 3)
    for bad in ((0, 2), (4, 1), (2.5, 2)):
        with pytest.raises(ValueError):
            topology.isPowerOf(*bad)


def test_mesh_grid_shape_may_be_a_numpy_pair_but_not_a_string():
    G = topology.MeshGrid2DGraph(6, shape=np.array([2, 3]))
    assert sorted(G.edges()) == sorted(topology.MeshGrid2DGraph(6, shape=(2, 3)).edges())
    with pytest.raises(ValueError, match="pair"):
        topology.MeshGrid2DGraph(6, shape="23")

"""Weight helpers of ``topology`` and pure-numpy average consensus on the builders."""

import math

import networkx as nx
import numpy as np
import pytest

import topology

MIXING_SIZES = [2, 3, 5, 8, 12, 16, 17]

UNDIRECTED = {
    "symexp": topology.SymmetricExponentialGraph,
    "mesh": topology.MeshGrid2DGraph,
    "star": topology.StarGraph,
    "ring0": topology.RingGraph,
    "full": topology.FullyConnectedGraph,
}
DIRECTED_CIRCULANT = {
    "exp2": topology.ExponentialTwoGraph,
    "exp3": lambda n: topology.ExponentialGraph(n, base=3),
    "ring1": lambda n: topology.RingGraph(n, 1),
    "ring2": lambda n: topology.RingGraph(n, 2),
}


def second_largest_modulus(W):
    moduli = np.sort(np.abs(np.linalg.eigvals(W)))[::-1]
    assert moduli[0] == pytest.approx(1.0)
    return moduli[1]


def consensus_errors(W, steps, seed=0):
    """Distances to the mean of x_{t+1} = W^T x_t (receiver j: sum_i W[i, j] x_i)."""
    x = np.random.default_rng(seed).normal(size=W.shape[0])
    mean = x.mean()
    errors = []
    for _ in range(steps + 1):
        errors.append(np.linalg.norm(x - mean))
        x = W.T @ x
    return np.array(errors), x, mean


def check_spectral_bound(W):
    lam2 = second_largest_modulus(W)
    assert lam2 < 1 - 1e-9, "graph should be connected and aperiodic"
    # Steps until lam2**t < 1e-10 (capped; lam2 == 0 converges in one step).
    steps = 1 if lam2 < 1e-12 else min(math.ceil(math.log(1e-10) / math.log(lam2)), 2000)
    errors, x, mean = consensus_errors(W, steps)
    # W is symmetric or circulant, hence normal: ||W^t e|| <= lam2^t ||e|| for
    # e orthogonal to the ones vector, so C = ||x_0 - mean|| exactly.
    bound = errors[0] * lam2 ** np.arange(steps + 1) * (1 + 1e-9) + 1e-12
    assert (errors <= bound).all()
    np.testing.assert_allclose(x, mean, atol=1e-8 * max(1.0, errors[0]))


@pytest.mark.parametrize("n", MIXING_SIZES)
@pytest.mark.parametrize("case", sorted(UNDIRECTED))
def test_undirected_mixing_converges_at_spectral_rate(case, n):
    check_spectral_bound(topology.mixing_matrix(UNDIRECTED[case](n)))


@pytest.mark.parametrize("n", MIXING_SIZES)
@pytest.mark.parametrize("case", sorted(DIRECTED_CIRCULANT))
def test_directed_circulant_mixing_converges_at_spectral_rate(case, n):
    check_spectral_bound(topology.mixing_matrix(DIRECTED_CIRCULANT[case](n)))


@pytest.mark.parametrize("n", [2, 5, 16])
def test_fully_connected_averages_in_one_step(n):
    errors, _, _ = consensus_errors(topology.mixing_matrix(topology.FullyConnectedGraph(n)), 1)
    assert errors[1] < 1e-12


# ---- mixing_matrix -------------------------------------------------------------


@pytest.mark.parametrize("build", [topology.StarGraph, topology.ExponentialTwoGraph])
def test_mixing_matrix_matches_networkx(build):
    G = build(7)
    expected = nx.to_numpy_array(G, nodelist=range(7))
    np.testing.assert_array_equal(topology.mixing_matrix(G), expected)


def test_mixing_matrix_rejects_nodes_not_0_to_n_minus_1():
    G = nx.DiGraph()
    G.add_edge(1, 2, weight=1.0)
    with pytest.raises(ValueError, match="nodes"):
        topology.mixing_matrix(G)


@pytest.mark.parametrize("label", [float, lambda v: bool(v)])
def test_nodes_that_only_compare_equal_to_ranks_are_refused(label):
    """0.0 == 0 and True == 1, but a graph on them would hand out float or bool ranks."""
    G = nx.relabel_nodes(topology.RingGraph(2), label)
    for read in (topology.mixing_matrix, lambda g: topology.GetRecvWeights(g, 0), topology.IsRegularGraph):
        with pytest.raises(ValueError, match=r"nodes 0\.\.1 \(one per rank\), got 2 nodes \[(0\.0|False)"):
            read(G)


def test_mixing_matrix_missing_weight_counts_as_one():
    G = nx.DiGraph([(0, 1)])
    np.testing.assert_array_equal(topology.mixing_matrix(G), [[0.0, 1.0], [0.0, 0.0]])


# ---- GetRecvWeights / GetSendWeights -------------------------------------------


@pytest.mark.parametrize("bad", [None, "heavy", True])
def test_a_weight_that_is_not_a_number_is_named(bad):
    G = nx.DiGraph([(0, 1, {"weight": 0.5}), (1, 0, {"weight": bad})])
    for read in (topology.mixing_matrix, lambda g: topology.GetRecvWeights(g, 0),
                 lambda g: topology.GetSendWeights(g, 1)):
        with pytest.raises(ValueError, match=r"edge 1 -> 0 has weight .*must be a real number"):
            read(G)


def test_an_integer_weight_too_large_for_a_float_is_named():
    G = nx.DiGraph([(0, 1, {"weight": 0.5}), (1, 0, {"weight": 10 ** 400})])
    for read in (topology.mixing_matrix, lambda g: topology.GetRecvWeights(g, 0),
                 lambda g: topology.GetSendWeights(g, 1)):
        with pytest.raises(ValueError, match=r"edge 1 -> 0 has weight 1000.*too large for a float"):
            read(G)


def test_multigraphs_are_refused():
    with pytest.raises(ValueError, match="not a multigraph"):
        topology.mixing_matrix(nx.MultiDiGraph([(0, 1), (0, 1), (1, 0)]))


def test_recv_and_send_weights_exponential():
    G = topology.ExponentialTwoGraph(4)
    self_w, recv = topology.GetRecvWeights(G, 0)
    assert self_w == pytest.approx(1 / 3)
    assert recv == pytest.approx({2: 1 / 3, 3: 1 / 3})
    self_w, send = topology.GetSendWeights(G, 0)
    assert self_w == pytest.approx(1 / 3)
    assert send == pytest.approx({1: 1 / 3, 2: 1 / 3})


def test_recv_and_send_weights_star():
    G = topology.StarGraph(5, center_rank=2)
    self_w, recv = topology.GetRecvWeights(G, 2)
    assert self_w == pytest.approx(0.2)
    assert recv == pytest.approx({0: 0.2, 1: 0.2, 3: 0.2, 4: 0.2})
    self_w, send = topology.GetSendWeights(G, 4)
    assert self_w == pytest.approx(0.8)
    assert send == pytest.approx({2: 0.2})


@pytest.mark.parametrize("n", [1, 4, 9])
def test_recv_weights_are_columns_and_send_weights_are_rows(n):
    G = topology.MeshGrid2DGraph(n)
    W = topology.mixing_matrix(G)
    for r in range(n):
        self_w, recv = topology.GetRecvWeights(G, r)
        assert self_w == W[r, r] and sum(recv.values()) + self_w == pytest.approx(1.0)
        assert recv == {i: W[i, r] for i in range(n) if i != r and W[i, r] != 0}
        self_w, send = topology.GetSendWeights(G, r)
        assert send == {j: W[r, j] for j in range(n) if j != r and W[r, j] != 0}


def test_missing_self_loop_gives_zero_self_weight():
    G = nx.DiGraph()
    G.add_weighted_edges_from([(0, 1, 0.5), (1, 0, 0.25)])
    assert topology.GetRecvWeights(G, 0) == (0.0, {1: 0.25})
    assert topology.GetSendWeights(G, 0) == (0.0, {1: 0.5})


def test_undirected_graph_is_read_both_ways():
    G = nx.Graph()
    G.add_weighted_edges_from([(0, 0, 0.5), (0, 1, 0.5), (1, 1, 0.5)])
    assert topology.GetRecvWeights(G, 1) == (0.5, {0: 0.5})
    assert topology.GetSendWeights(G, 1) == (0.5, {0: 0.5})


@pytest.mark.parametrize("rank", [-1, 4, 1.5, None])
@pytest.mark.parametrize("helper", [topology.GetRecvWeights, topology.GetSendWeights])
def test_weights_bad_rank_raises(helper, rank):
    with pytest.raises(ValueError, match="rank"):
        helper(topology.RingGraph(4), rank)


# ---- IsRegularGraph ------------------------------------------------------------


@pytest.mark.parametrize(
    "G",
    [
        topology.ExponentialTwoGraph(12),
        topology.ExponentialGraph(10, base=3),
        topology.SymmetricExponentialGraph(17),
        topology.RingGraph(6, 2),
        topology.FullyConnectedGraph(5),
        topology.MeshGrid2DGraph(4),
        topology.StarGraph(2),
        topology.StarGraph(1),
    ],
)
def test_regular_graphs(G):
    assert topology.IsRegularGraph(G)


@pytest.mark.parametrize("G", [topology.StarGraph(4), topology.MeshGrid2DGraph(6)])
def test_irregular_graphs(G):
    assert not topology.IsRegularGraph(G)


def test_same_in_degrees_but_different_out_degrees_is_not_regular():
    G = nx.DiGraph([(0, 1), (0, 2), (1, 0)])
    assert {d for _, d in G.in_degree()} == {1}
    assert not topology.IsRegularGraph(G)


# ---- IsTopologyEquivalent ------------------------------------------------------


def test_equivalent_same_builder_and_coinciding_builders():
    assert topology.IsTopologyEquivalent(topology.RingGraph(7), topology.RingGraph(7))
    assert topology.IsTopologyEquivalent(topology.RingGraph(2), topology.FullyConnectedGraph(2))
    assert topology.IsTopologyEquivalent(topology.RingGraph(3), topology.ExponentialTwoGraph(3))


def test_not_equivalent_different_graphs_or_sizes():
    assert not topology.IsTopologyEquivalent(topology.RingGraph(4), topology.ExponentialTwoGraph(4))
    assert not topology.IsTopologyEquivalent(topology.RingGraph(4), topology.RingGraph(5))
    assert not topology.IsTopologyEquivalent(topology.RingGraph(5, 1), topology.RingGraph(5, 2))


def test_equivalent_none_is_false():
    assert not topology.IsTopologyEquivalent(None, topology.RingGraph(3))
    assert not topology.IsTopologyEquivalent(topology.RingGraph(3), None)
    assert not topology.IsTopologyEquivalent(None, None)


def test_equivalent_ignores_node_insertion_order():
    G = topology.StarGraph(4)
    H = nx.DiGraph()
    H.add_nodes_from(reversed(range(4)))
    H.add_weighted_edges_from(reversed(list(G.edges(data="weight"))))
    assert topology.IsTopologyEquivalent(G, H)


def test_equivalent_weight_tolerance_and_zero_weight_edges():
    G, H = topology.RingGraph(4), topology.RingGraph(4)
    H[0][1]["weight"] += 1e-14
    assert topology.IsTopologyEquivalent(G, H)
    H[0][1]["weight"] += 1e-9
    assert not topology.IsTopologyEquivalent(G, H)
    H = topology.RingGraph(4)
    H.add_edge(0, 2, weight=0.0)
    assert not topology.IsTopologyEquivalent(G, H)

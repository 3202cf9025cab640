"""Reading weights and structure off a topology graph.

Conventions as in :mod:`topology.builders`: nodes ``0..n-1``, edge ``i -> j``
with attribute ``'weight'`` = ``W[i][j]``, the weight ``j`` gives to what it
receives from ``i``.  An edge without a ``'weight'`` attribute counts as
weight 1.0 (the networkx convention, as in ``nx.to_numpy_array``).
"""

import numbers
from typing import Dict, Tuple

import networkx as nx
import numpy as np

from ._validate import check_rank, check_topology

__all__ = [
    "mixing_matrix",
    "GetRecvWeights",
    "GetSendWeights",
    "IsRegularGraph",
    "IsTopologyEquivalent",
]

_EQUIVALENCE_TOLERANCE = 1e-12


def _weight(topo: nx.DiGraph, src: int, dst: int) -> float:
    return _as_weight(topo.edges[src, dst].get("weight", 1.0), src, dst)


def _as_weight(weight, src, dst) -> float:
    """An edge's weight as a float; ValueError naming the edge if it is not a real number."""
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        raise ValueError(f"edge {src} -> {dst} has weight {weight!r}; an edge weight must be a real number")
    try:
        return float(weight)
    except OverflowError:
        raise ValueError(f"edge {src} -> {dst} has weight {weight!r}, too large for a float") from None


def mixing_matrix(topo: nx.DiGraph) -> np.ndarray:
    """Return ``W`` (n x n float array) with ``W[i, j]`` = weight of ``i -> j``.

    Absent edges give 0.  Example: ``mixing_matrix(RingGraph(3))`` is the
    3 x 3 matrix with every entry 1/3.

    Raises ValueError if the nodes are not ``0..n-1``.
    """
    topo = check_topology(topo)
    n = topo.number_of_nodes()
    matrix = np.zeros((n, n))
    for src, dst, weight in topo.edges(data="weight", default=1.0):
        matrix[src, dst] = _as_weight(weight, src, dst)
    return matrix


def GetRecvWeights(topo: nx.DiGraph, rank: int) -> Tuple[float, Dict[int, float]]:
    """Return ``(self_weight, {src: weight})`` for what ``rank`` receives.

    ``src`` runs over the in-neighbors (predecessors) of ``rank``, self
    excluded; ``self_weight`` is the self-loop weight, 0.0 if there is none.

    Example: ``GetRecvWeights(ExponentialTwoGraph(4), 0)`` is
    ``(1/3, {2: 1/3, 3: 1/3})``.

    Raises ValueError if ``rank`` is not a node of ``topo``.
    """
    topo = check_topology(topo)
    rank = check_rank(rank, topo.number_of_nodes())
    self_weight = _weight(topo, rank, rank) if topo.has_edge(rank, rank) else 0.0
    weights = {src: _weight(topo, src, rank) for src in sorted(topo.predecessors(rank))}
    weights.pop(rank, None)
    return self_weight, weights


def GetSendWeights(topo: nx.DiGraph, rank: int) -> Tuple[float, Dict[int, float]]:
    """Return ``(self_weight, {dst: weight})`` for what ``rank`` sends.

    ``dst`` runs over the out-neighbors (successors) of ``rank``, self
    excluded; ``self_weight`` is the self-loop weight, 0.0 if there is none.

    Example: ``GetSendWeights(ExponentialTwoGraph(4), 0)`` is
    ``(1/3, {1: 1/3, 2: 1/3})``.

    Raises ValueError if ``rank`` is not a node of ``topo``.
    """
    topo = check_topology(topo)
    rank = check_rank(rank, topo.number_of_nodes())
    self_weight = _weight(topo, rank, rank) if topo.has_edge(rank, rank) else 0.0
    weights = {dst: _weight(topo, rank, dst) for dst in sorted(topo.successors(rank))}
    weights.pop(rank, None)
    return self_weight, weights


def IsRegularGraph(topo: nx.DiGraph) -> bool:
    """True iff all nodes have the same in-degree and the same out-degree.

    Self-loops count in both degrees.  Example: ``ExponentialTwoGraph(8)`` is
    regular, ``StarGraph(4)`` is not.  A graph with no node is regular.
    (Bluefog's compared each node's in-degree + out-degree; the answers differ
    only for directed graphs whose nodes trade in-edges for out-edges.)
    """
    topo = check_topology(topo)
    in_degrees = {d for _, d in topo.in_degree()}
    out_degrees = {d for _, d in topo.out_degree()}
    return len(in_degrees) <= 1 and len(out_degrees) <= 1


def IsTopologyEquivalent(topo1: nx.DiGraph, topo2: nx.DiGraph) -> bool:
    """True iff both graphs have the same nodes, edges and weights.

    Weights are compared up to 1e-12; an explicit zero-weight edge differs
    from a missing edge (it still makes the two ranks neighbors).  ``None``
    for either argument gives False; anything else that is not a topology
    (not a networkx graph on nodes 0..n-1) raises ValueError, where Bluefog's
    returned False.

    Example: ``IsTopologyEquivalent(RingGraph(2), FullyConnectedGraph(2))``
    is True; ``IsTopologyEquivalent(RingGraph(4), ExponentialTwoGraph(4))``
    is False.
    """
    if topo1 is None or topo2 is None:
        return False
    topo1, topo2 = check_topology(topo1, "topo1"), check_topology(topo2, "topo2")
    if topo1.number_of_nodes() != topo2.number_of_nodes():
        return False
    if set(topo1.edges) != set(topo2.edges):
        return False
    difference = np.abs(mixing_matrix(topo1) - mixing_matrix(topo2))
    return bool(difference.max(initial=0.0) <= _EQUIVALENCE_TOLERANCE)

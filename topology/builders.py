"""Static topology builders.

Every builder is a pure function ``size -> networkx.DiGraph`` with

* nodes ``0..size-1`` (one per rank);
* a self-loop on every node;
* an edge attribute ``'weight'`` on every edge.

An edge ``i -> j`` with weight ``W[i][j]`` means that agent ``j`` multiplies
what it receives from ``i`` by ``W[i][j]`` (row ``i`` of ``W`` is what ``i``
sends, column ``j`` is what ``j`` combines).  Every column of ``W`` sums to 1,
and for all builders of this module every row does as well (``W`` is doubly
stochastic), so repeated neighbor averaging converges to the exact average.

``size == 1`` is valid for every builder and gives a single self-loop of
weight 1.
"""

from collections.abc import Sequence
from fractions import Fraction
from typing import Dict, Iterable, Optional, Tuple

import networkx as nx
import numpy as np

from ._validate import check_int, check_rank

__all__ = [
    "ExponentialTwoGraph",
    "ExponentialGraph",
    "SymmetricExponentialGraph",
    "MeshGrid2DGraph",
    "StarGraph",
    "RingGraph",
    "FullyConnectedGraph",
]


def _graph_from_weights(size: int, weights: Dict[Tuple[int, int], float]) -> nx.DiGraph:
    """Build a DiGraph on ``0..size-1`` from ``{(src, dst): weight}``, edges added in
    (src, dst) order: successors, predecessors and edges iterate in ascending rank
    order, as in Bluefog's graphs (built from a matrix)."""
    graph = nx.DiGraph()
    graph.add_nodes_from(range(size))
    graph.add_weighted_edges_from((i, j, float(w)) for (i, j), w in sorted(weights.items()))
    return graph


def _circulant(size: int, offsets: Iterable[int]) -> nx.DiGraph:
    """Circulant graph ``i -> (i + off) % size`` with uniform weights.

    ``offsets`` must contain 0 (the self-loop) and be distinct modulo ``size``.
    """
    offsets = sorted(set(off % size for off in offsets))
    weight = 1.0 / len(offsets)
    return _graph_from_weights(
        size, {(i, (i + off) % size): weight for i in range(size) for off in offsets}
    )


def _is_power_of(value: int, base: int) -> bool:
    """True iff ``value == base**k`` for some integer ``k >= 0``."""
    if value < 1:
        return False
    while value % base == 0:
        value //= base
    return value == 1


def isPowerOf(x: int, base: int) -> bool:
    """True iff ``x == base**k`` for an integer ``k >= 0`` (exact, in integers;
    Bluefog's helper of the same name). Raises ValueError unless x >= 1 and base >= 2
    are integers."""
    return _is_power_of(check_int(x, "x", minimum=1), check_int(base, "base", minimum=2))


def ExponentialGraph(size: int, base: int = 2) -> nx.DiGraph:
    """Directed exponential graph: each rank sends to ranks ``base**k`` ahead.

    Edges: ``i -> (i + off) % size`` for ``off = 0`` (self-loop) and every
    ``off = base**k < size`` (``k >= 0``: 1, base, base**2, ...).
    Weights: uniform, ``1 / (number of offsets)`` on every edge including the
    self-loop.  The graph is circulant, hence regular and doubly stochastic.

    Example: ``ExponentialGraph(8)`` has offsets ``{0, 1, 2, 4}``; rank 0
    sends to 1, 2, 4 and receives from 7, 6, 4; every weight is 1/4.
    ``ExponentialGraph(9, base=3)`` has offsets ``{0, 1, 3}``, weights 1/3.

    Raises ValueError if ``size < 1`` or ``base < 2``.
    """
    size = check_int(size, "size", minimum=1)
    base = check_int(base, "base", minimum=2)
    offsets = [0]
    power = 1
    while power < size:
        offsets.append(power)
        power *= base
    return _circulant(size, offsets)


def ExponentialTwoGraph(size: int) -> nx.DiGraph:
    """``ExponentialGraph(size, base=2)``: offsets 0, 1, 2, 4, ... < size.

    Example: ``ExponentialTwoGraph(4)``: rank 0 sends to 1 and 2, every
    weight (self included) is 1/3.
    """
    return ExponentialGraph(size, base=2)


def SymmetricExponentialGraph(size: int, base: int = 4) -> nx.DiGraph:
    """Undirected exponential graph: neighbors at distance ``base**k`` either way.

    Edges: self-loop, plus ``i -> (i + off) % size`` for every
    ``1 <= off < size`` such that ``min(off, size - off)`` is a power of
    ``base`` (``base**k``, ``k >= 0``).  The offset set is symmetric, so every
    edge exists in both directions.
    Weights: uniform, ``1 / (number of offsets incl. 0)``; doubly stochastic.

    Example: ``SymmetricExponentialGraph(10)`` (base 4): distances 1 and 4
    count, so offsets are ``{0, 1, 4, 6, 9}`` and every weight is 1/5.

    Raises ValueError if ``size < 1`` or ``base < 2``.
    """
    size = check_int(size, "size", minimum=1)
    base = check_int(base, "base", minimum=2)
    offsets = [0] + [off for off in range(1, size) if _is_power_of(min(off, size - off), base)]
    return _circulant(size, offsets)


def _mesh_shape(size: int, shape: Optional[Tuple[int, int]]) -> Tuple[int, int]:
    """Validate ``shape`` or pick rows = largest divisor of ``size`` <= sqrt(size)."""
    if shape is None:
        rows = max(r for r in range(1, size + 1) if r * r <= size and size % r == 0)
        return rows, size // rows
    if isinstance(shape, np.ndarray):       # (Bluefog accepts an array)
        shape = tuple(shape.tolist()) if shape.ndim == 1 else shape
    # a set has no order; a string is a sequence of characters
    if not isinstance(shape, Sequence) or isinstance(shape, (str, bytes)) or len(shape) != 2:
        raise ValueError(f"shape must be a pair (rows, cols), got {shape!r}")
    rows, cols = shape
    rows = check_int(rows, "shape[0]", minimum=1)
    cols = check_int(cols, "shape[1]", minimum=1)
    if rows * cols != size:
        raise ValueError(f"shape {shape!r} has {rows * cols} cells but size is {size}")
    return rows, cols


def MeshGrid2DGraph(size: int, shape: Optional[Tuple[int, int]] = None) -> nx.DiGraph:
    """2-D grid (no wrap-around) with Metropolis-Hastings weights.

    Layout: ``rows x cols`` with ``rows`` the largest divisor of ``size`` that
    is ``<= sqrt(size)`` (so a prime size gives a ``1 x size`` path), unless
    ``shape=(rows, cols)`` is given.  Rank ``r * cols + c`` sits at row ``r``,
    column ``c``.
    Edges: self-loop and both directions to the up/down/left/right neighbors.
    Weights: with ``deg`` = number of neighbors + 1 (the self-loop counts),
    ``W[i][j] = 1 / max(deg_i, deg_j)`` for neighbors and
    ``W[i][i] = 1 - sum_{j != i} W[i][j]``.  Symmetric and doubly stochastic.

    Example: ``MeshGrid2DGraph(6)`` is 2 x 3::

        0 - 1 - 2
        |   |   |
        3 - 4 - 5

    ``deg`` is 3 for the corners and 4 for 1 and 4, so ``W[0][1] = 1/4``,
    ``W[0][3] = 1/3``, ``W[0][0] = 5/12`` and rank 1 gives 1/4 to everything.

    Raises ValueError if ``size < 1`` or ``shape`` does not have ``size`` cells.
    """
    size = check_int(size, "size", minimum=1)
    rows, cols = _mesh_shape(size, shape)
    neighbors = {i: [] for i in range(size)}
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            if c + 1 < cols:
                neighbors[i].append(i + 1)
                neighbors[i + 1].append(i)
            if r + 1 < rows:
                neighbors[i].append(i + cols)
                neighbors[i + cols].append(i)
    degree = {i: len(nbrs) + 1 for i, nbrs in neighbors.items()}
    weights = {}
    for i, nbrs in neighbors.items():
        # Fractions keep the self weight exact (e.g. 1 - 1/4 - 1/3).
        out = {j: Fraction(1, max(degree[i], degree[j])) for j in nbrs}
        weights[(i, i)] = 1 - sum(out.values())
        weights.update(((i, j), w) for j, w in out.items())
    return _graph_from_weights(size, weights)


def StarGraph(size: int, center_rank: int = 0) -> nx.DiGraph:
    """Star: every leaf exchanges with ``center_rank`` and nobody else.

    Edges: self-loops, ``center <-> leaf`` in both directions.
    Weights: ``1/size`` on both directions of every spoke, ``1 - 1/size`` on
    each leaf's self-loop and ``1/size`` on the centre's self-loop.
    Symmetric and doubly stochastic.

    Example: ``StarGraph(4)``: ``W[0][0] = 1/4``, ``W[0][k] = W[k][0] = 1/4``
    and ``W[k][k] = 3/4`` for ``k = 1, 2, 3``.

    Raises ValueError if ``size < 1`` or ``center_rank`` not in ``[0, size)``.
    """
    size = check_int(size, "size", minimum=1)
    center = check_rank(center_rank, size, "center_rank")
    spoke = 1.0 / size
    weights = {(center, center): spoke}
    for leaf in range(size):
        if leaf != center:
            weights[(leaf, leaf)] = 1.0 - spoke
            weights[(center, leaf)] = spoke
            weights[(leaf, center)] = spoke
    return _graph_from_weights(size, weights)


def RingGraph(size: int, connect_style: int = 0) -> nx.DiGraph:
    """Ring, bidirectional (``connect_style=0``) or one-way (1: left, 2: right).

    Edges and weights:

    * style 0: ``i -> i-1`` and ``i -> i+1`` (mod ``size``) plus self-loop,
      all with weight 1/3;
    * style 1 (left): ``i -> i-1`` only, weight 1/2, self-loop 1/2;
    * style 2 (right): ``i -> i+1`` only, weight 1/2, self-loop 1/2.

    Small sizes: ``size == 1`` is a single self-loop of weight 1.  With
    ``size == 2`` left and right are the same rank, so every style gives the
    same graph: weight 1/2 on the self-loop and 1/2 to the other rank.
    Every variant is circulant and doubly stochastic.

    Example: ``RingGraph(5)``: rank 0 sends to 4 and 1 with weight 1/3;
    ``RingGraph(5, connect_style=2)``: rank 0 sends to 1 only, weight 1/2.

    Raises ValueError if ``size < 1`` or ``connect_style`` not in {0, 1, 2}.
    """
    size = check_int(size, "size", minimum=1)
    connect_style = check_int(connect_style, "connect_style")
    offsets_by_style = {0: (0, -1, 1), 1: (0, -1), 2: (0, 1)}
    if connect_style not in offsets_by_style:
        raise ValueError(f"connect_style must be 0, 1 or 2, got {connect_style}")
    # _circulant merges offsets that coincide modulo size (n = 1, 2).
    return _circulant(size, offsets_by_style[connect_style])


def FullyConnectedGraph(size: int) -> nx.DiGraph:
    """Complete graph: every rank sends to every rank, all weights ``1/size``.

    Example: ``FullyConnectedGraph(3)`` has 9 edges (3 self-loops), each of
    weight 1/3; one averaging step yields the exact mean.

    Raises ValueError if ``size < 1``.
    """
    size = check_int(size, "size", minimum=1)
    return _circulant(size, range(size))

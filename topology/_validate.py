"""Argument checks shared by the builders, helpers and schedules."""

import numbers

import networkx as nx


def check_int(value, name, minimum=None):
    """Return ``value`` as an ``int``; raise ValueError naming ``name`` if bad.

    Booleans are rejected although they are ``int`` subclasses: ``RingGraph(True)``
    is much more likely a bug than a request for one agent.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_rank(value, size, name="rank"):
    """Return ``value`` as an ``int`` in ``[0, size)``; raise ValueError otherwise."""
    value = check_int(value, name)
    if not 0 <= value < size:
        raise ValueError(f"{name} must be in [0, {size}), got {value}")
    return value


def check_topology(topo, name="topo"):
    """Return ``topo`` as a DiGraph on nodes ``0..n-1``; raise ValueError otherwise.

    An undirected ``nx.Graph`` is accepted and read as having both directions
    of every edge.
    """
    if not isinstance(topo, nx.Graph) or topo.is_multigraph():
        raise ValueError(f"{name} must be a networkx graph (not a multigraph), got {type(topo).__name__}")
    n = topo.number_of_nodes()
    if not has_rank_nodes(topo, n):
        raise ValueError(f"{name} must have nodes 0..{n - 1} (one per rank), got {nodes_shown(topo)}")
    return topo if topo.is_directed() else topo.to_directed()


def has_rank_nodes(G, n):
    """Whether G's nodes are exactly the integers 0..n-1 (0.0 or True are not
    ranks although they compare equal to 0 and 1)."""
    return (G.number_of_nodes() == n
            and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in G.nodes)
            and set(G.nodes) == set(range(n)))


def nodes_shown(G, most=6):
    """G's nodes for an error message: 'nodes [0.0, 1.0, ...]'."""
    nodes = list(G.nodes)
    listed = ", ".join(repr(v) for v in nodes[:most]) + (", ..." if len(nodes) > most else "")
    return f"{len(nodes)} nodes [{listed}]"

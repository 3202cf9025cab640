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
    if set(topo.nodes) != set(range(n)):
        raise ValueError(f"{name} must have nodes 0..{n - 1} (one per rank)")
    return topo if topo.is_directed() else topo.to_directed()

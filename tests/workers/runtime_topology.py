"""set_topology / load_topology / neighbor queries and their errors; machine queries."""
import networkx as nx
import numpy as np
import torch

import bluefog_lite as bf
import topology as topo

bf.init()
rank, size = bf.rank(), bf.size()
assert topo.IsTopologyEquivalent(bf.load_topology(), topo.ExponentialGraph(size))
assert bf.mpi_threads_supported()
assert bf.local_size() == size and bf.machine_size() == 1 and bf.is_homogeneous()

assert bf.set_topology(topo.RingGraph(size), is_weighted=True)
assert bf.in_neighbor_ranks() == sorted({(rank - 1) % size, (rank + 1) % size})
assert bf.is_topo_weighted()
for bad, exc, text in ((topo.RingGraph(size + 1), ValueError, "nodes 0.."),
                       ("not a graph", TypeError, "networkx")):
    try:
        bf.set_topology(bad)
        raise AssertionError("bad topology accepted")
    except exc as e:
        assert text in str(e), str(e)
# agents passing different graphs: the same error everywhere
try:
    bf.set_topology(topo.RingGraph(size) if rank == 0 else topo.StarGraph(size))
    raise AssertionError("different graphs accepted")
except ValueError as e:
    assert "different graphs" in str(e)
assert topo.IsTopologyEquivalent(bf.load_topology(), topo.RingGraph(size))   # unchanged
# the graph by keyword: Bluefog's name (topology=) and the specification's (G=); not both
assert bf.set_topology(topology=topo.StarGraph(size))
assert bf.in_neighbor_ranks() == ([0] if rank else list(range(1, size)))
assert bf.set_topology(G=topo.RingGraph(size))
assert bf.in_neighbor_ranks() == sorted({(rank - 1) % size, (rank + 1) % size})
try:
    bf.set_topology(topo.StarGraph(size), G=topo.StarGraph(size))
    raise AssertionError("a graph passed twice was accepted")
except TypeError as e:
    assert "pass the graph once" in str(e), str(e)
assert topo.IsTopologyEquivalent(bf.load_topology(), topo.RingGraph(size))   # unchanged
# an undirected networkx graph is read as both directions
assert bf.set_topology(nx.cycle_graph(size))
assert bf.out_neighbor_ranks() == sorted({(rank - 1) % size, (rank + 1) % size})
# the edges in use with other weights: installed (load_topology() hands the weights out;
# Bluefog compared them), also unweighted, which still averages uniformly
G = nx.cycle_graph(size).to_directed()
G.add_edges_from((i, i) for i in range(size))
nx.set_edge_attributes(G, {e: 0.5 if e[0] == e[1] else 0.25 for e in G.edges}, "weight")
assert bf.set_topology(G)
assert bf.load_topology() is G and topo.GetRecvWeights(bf.load_topology(), rank)[0] == 0.5
assert torch.allclose(bf.neighbor_allreduce(torch.full((2,), float(rank))),
                      torch.full((2,), (rank + (rank - 1) % size + (rank + 1) % size) / 3))
# numpy integer labels are the same graph as Python ints (numpy 2 prints them differently)
H = nx.relabel_nodes(topo.RingGraph(size), {i: np.int64(i) for i in range(size)}) if rank == 0 \
    else topo.RingGraph(size)
assert bf.set_topology(H) and bf.in_neighbor_ranks() == sorted({(rank - 1) % size, (rank + 1) % size})
# an integer weight too large for a float, on one agent: every agent raises
H = topo.RingGraph(size)
if rank == 1:
    H.edges[1, 1]["weight"] = 10 ** 400
try:
    bf.set_topology(H, is_weighted=True)
    raise AssertionError("a weight of 10**400 was accepted")
except ValueError as e:
    assert "finite" in str(e) or "rank 1" in str(e), str(e)
# the weight attributes of an unweighted graph are not used: they need not be numbers
H = topo.RingGraph(size)
nx.set_edge_attributes(H, None, "weight")
assert bf.set_topology(H) and bf.set_topology(H) and bf.load_topology() is H
assert bf.set_topology(topo.RingGraph(size)) and bf.load_topology() is not H
# refused while an operation is in flight on some agent: rank 0 waits for rank 1,
# which sends only after set_topology
if rank == 0:
    h = bf.neighbor_allreduce_nonblocking(torch.ones(2), self_weight=0.5, src_weights={1: 0.5},
                                          dst_weights=[], enable_topo_check=False, name="open")
ok = bf.set_topology(topo.ExponentialGraph(size))
assert ok is False, "set_topology must refuse while an operation is in flight somewhere"
if rank == 1:
    bf.neighbor_allreduce(torch.ones(2) * 3, self_weight=1.0, src_weights={}, dst_weights=[0],
                          enable_topo_check=False, name="open")
if rank == 0:
    assert torch.equal(bf.synchronize(h), torch.full((2,), 2.0))
assert bf.set_topology(topo.ExponentialGraph(size)) is True
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

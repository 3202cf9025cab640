"""neighbor_allreduce / neighbor_allgather / pair_gossip against numpy references
computed from the mixing matrix (every agent can compute every agent's input)."""
import networkx as nx
import numpy as np
import torch

import bluefog_lite as bf
import topology as topo

bf.init()
rank, size = bf.rank(), bf.size()


def data(r, shape=(5, 3), dtype=np.float64):
    return np.random.default_rng(100 + r).normal(size=shape).astype(dtype)


def close(a, b, tol=1e-6):
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def static_reference(G, weighted, dtype=np.float64, shape=(5, 3)):
    W = topo.mixing_matrix(G)
    if not weighted:  # uniform 1/(indegree+1) on the receiving side
        A = (W > 0).astype(float)
        W = A / A.sum(axis=0, keepdims=True)
    return sum(W[i, rank] * data(i, shape, dtype) for i in range(size))


# -- static topologies, default weights, float32/float64 --------------------------
for builder in (topo.ExponentialGraph, topo.RingGraph, topo.StarGraph, topo.MeshGrid2DGraph,
                topo.SymmetricExponentialGraph, topo.FullyConnectedGraph):
    G = builder(size)
    for weighted in (False, True):
        assert bf.set_topology(G, is_weighted=weighted)
        for dtype, tol in ((np.float64, 1e-12), (np.float32, 1e-5)):
            x = torch.from_numpy(data(rank, dtype=dtype))
            before = x.clone()
            y = bf.neighbor_allreduce(x, name=f"static.{builder.__name__}.{weighted}")
            close(y, static_reference(G, weighted, dtype), tol)
            assert y.dtype == x.dtype and torch.equal(x, before), "input must be left untouched"

assert bf.set_topology(topo.ExponentialGraph(size))
assert bf.in_neighbor_ranks() == sorted({(rank - 2 ** k) % size for k in range(size.bit_length())
                                         if 2 ** k < size})

# -- explicit self/src weights (static): unlisted in-neighbors count 0 -------------
ins = bf.in_neighbor_ranks()
srcw = {r: 0.1 * (k + 1) for k, r in enumerate(ins[:-1])} if len(ins) > 1 else {}
y = bf.neighbor_allreduce(torch.from_numpy(data(rank)), self_weight=0.25, src_weights=srcw, name="expl")
close(y, 0.25 * data(rank) + sum(w * data(r) for r, w in srcw.items()))

# -- dynamic one-peer Exp-2 with list and dict dst_weights ------------------------
gens = [topo.GetDynamicOnePeerSendRecvRanks(topo.ExponentialTwoGraph(size), r) for r in range(size)]
for step in range(4):
    plans = [next(g) for g in gens]
    send, recv = plans[rank]
    y = bf.neighbor_allreduce(torch.from_numpy(data(rank)), self_weight=0.5,
                              src_weights={r: 0.5 for r in recv}, dst_weights=send, name="dyn.list")
    close(y, 0.5 * data(rank) + sum(0.5 * data(r) for r in recv))
    # dict dst weights: the sender scales what it sends
    y = bf.neighbor_allreduce(torch.from_numpy(data(rank)), self_weight=0.3,
                              src_weights={r: 1.0 for r in recv}, dst_weights={d: 0.7 for d in send},
                              name="dyn.dict", enable_topo_check=False)
    close(y, 0.3 * data(rank) + sum(0.7 * data(r) for r in recv))

# -- dynamic pattern that is not a graph edge: everyone sends to rank 0 ------------
send = [0] if rank else []
recv = list(range(1, size)) if rank == 0 else []
y = bf.neighbor_allreduce(torch.from_numpy(data(rank)), self_weight=1.0,
                          src_weights={r: 1.0 for r in recv}, dst_weights=send, name="gather0")
close(y, sum(data(r) for r in range(size)) if rank == 0 else data(rank))

# -- topology check: a send without a receive raises the same error everywhere ----
try:
    bf.neighbor_allreduce(torch.ones(2), self_weight=1.0, src_weights={},
                          dst_weights=[(rank + 1) % size], name="badtopo")
    raise AssertionError("mismatched dynamic topology was not detected")
except ValueError as e:
    assert "do not match" in str(e) and f"rank 0 sends to rank {1 % size}" in str(e), str(e)

# -- integers, non-contiguous, zero elements ---------------------------------------
xi = torch.arange(6, dtype=torch.int64) * (rank + 1) * 10
y = bf.neighbor_allreduce(xi, self_weight=0.5, src_weights={r: 0.5 / len(ins) for r in ins}, name="int")
ref = 0.5 * np.arange(6) * (rank + 1) * 10 + sum(0.5 / len(ins) * np.arange(6) * (r + 1) * 10 for r in ins)
assert y.dtype == torch.int64 and np.array_equal(y.numpy(), np.round(ref)), (y, ref)
xt = torch.from_numpy(data(rank, (3, 5))).t()
assert not xt.is_contiguous()
close(bf.neighbor_allreduce(xt, name="noncontig"), static_reference(topo.ExponentialGraph(size), False,
                                                                    shape=(3, 5)).T)
z = bf.neighbor_allreduce(torch.empty(0, 4), name="empty")
assert z.shape == (0, 4)

# -- neighbor_allgather: static and dynamic, first dimension differs per rank ------
def rows(r):
    return torch.full((r + 1, 2), float(r))

g = bf.neighbor_allgather(rows(rank), name="ag.static")
assert torch.equal(g, torch.cat([rows(r) for r in ins])), g
src = [(rank - 1) % size, (rank + 2) % size] if size > 2 else [(rank + 1) % size]
dst = sorted({(rank + 1) % size, (rank - 2) % size}) if size > 2 else [(rank + 1) % size]
g = bf.neighbor_allgather(rows(rank), src_ranks=src, dst_ranks=dst, name="ag.dyn")
assert torch.equal(g, torch.cat([rows(r) for r in src])), (src, g)

# -- pair_gossip with the partner rank ^ 1 ----------------------------------------
if size % 2 == 0:
    p = rank ^ 1
    close(bf.pair_gossip(torch.from_numpy(data(rank)), p, name="pg"), 0.5 * data(rank) + 0.5 * data(p))
    close(bf.pair_gossip(torch.from_numpy(data(rank)), p, self_weight=0.2, pair_weight=0.8, name="pg2"),
          0.2 * data(rank) + 0.8 * data(p))

# -- shape mismatch between neighbors: receivers raise a clear error ---------------
shape = (4,) if rank == 0 else (5,)
must_raise = 0 in ins or (rank == 0 and bool(ins))    # an in-neighbor's shape differs from its own
try:
    bf.neighbor_allreduce(torch.ones(shape), name="mismatch")
    assert not must_raise, f"rank {rank} received a tensor of another shape and did not raise"
except ValueError as e:
    assert must_raise, f"rank {rank} raised though its in-neighbors match: {e}"
    assert "rank" in str(e) and "same shape" in str(e), str(e)
bf.barrier()

# -- many nonblocking ops in flight, synchronized in reverse order ------------------
handles = [(k, bf.neighbor_allreduce_nonblocking(torch.from_numpy(data(rank) * (k + 1)), name=f"many.{k}"))
           for k in range(40)]
ref = static_reference(topo.ExponentialGraph(size), False)
for k, h in reversed(handles):
    close(bf.synchronize(h), ref * (k + 1))

# -- name reuse while in flight is refused; handles cannot be synchronized twice ---
h = bf.neighbor_allreduce_nonblocking(torch.ones(3), name="dup")
try:
    bf.neighbor_allreduce_nonblocking(torch.ones(3), name="dup")
    raise AssertionError("duplicate in-flight name accepted")
except ValueError as e:
    assert "already in flight" in str(e)
bf.wait(h)
try:
    bf.synchronize(h)
    raise AssertionError("double synchronize accepted")
except ValueError as e:
    assert "already synchronized" in str(e)

# -- inference of sources/destinations (collective) ------------------------------
dsts = [(rank + 1) % size, (rank + 3) % size] if size > 3 else [(rank + 1) % size]
srcs, W = bf.InferSourceFromDestinationRanks(dsts, construct_adjacency_matrix=True)
expected = sorted({r for r in range(size) for d in ([(r + 1) % size, (r + 3) % size] if size > 3
                                                     else [(r + 1) % size]) if d == rank} - {rank})
assert srcs == expected, (srcs, expected)
# Bluefog's matrix: i -> j edges and self-loops, each column the uniform average
# of what its agent receives (1 / (in-degree + 1))
W_ref = np.eye(size)
for r in range(size):
    for d in ([(r + 1) % size, (r + 3) % size] if size > 3 else [(r + 1) % size]):
        W_ref[r, d] = 1.0
in_degree = [sum(1 for r in range(size) if r != j and W_ref[r, j]) for j in range(size)]
W_ref = W_ref / np.array([k + 1.0 for k in in_degree])
assert W.dtype == np.float64 and np.allclose(W, W_ref), (W, W_ref)
assert np.allclose(W.sum(axis=0), 1.0)
assert srcs == [r for r in range(size) if r != rank and W[r, rank] > 0]
back, W_back = bf.InferDestinationFromSourceRanks(srcs, construct_adjacency_matrix=True)
assert back == sorted(set(dsts) - {rank}), (back, dsts)
assert np.allclose(W_back, W_ref), (W_back, W_ref)    # the same pattern, told from the other side
# ... and ready for a weighted topology: averaging over it is W's columns
assert bf.set_topology(nx.from_numpy_array(W, create_using=nx.DiGraph), is_weighted=True)
x_all = np.arange(size * 3, dtype=np.float64).reshape(size, 3) ** 1.5
got = bf.neighbor_allreduce(torch.from_numpy(x_all[rank].copy()), name="inferred")
assert np.allclose(got.numpy(), W[:, rank] @ x_all), (got, W[:, rank] @ x_all)

bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

"""A neighbor that runs ahead in a loop of one name: rank 0 averages what ranks 1 and
2 send (edges 1 -> 0 and 2 -> 0). While rank 0 waits for rank 2 in the first op,
rank 1, which needs nothing from anyone, finishes it and starts the next op of the
same name. Its data is queued behind the entry rank 0 already holds, so it is a
later operation's: rank 0 must leave it with rank 1 instead of taking a second
receive buffer for it. Between rank 0's first and second op (rank 2 held back),
rank 1's round-1 data may come into a free pooled buffer, but its round-2 data,
queued behind it, must not take the other one: rank 2's round-1 data needs it.
Every result matches the mixing matrix and two 1 MB buffers serve all rounds."""
import time

import networkx as nx
import torch
from mpi4py import MPI

import bluefog_lite as bf
from bluefog_lite._runtime import state

bf.init()
go = MPI.COMM_WORLD.Dup()    # rank 0 tells rank 2 when to join
r = bf.rank()
assert bf.size() == 3
G = nx.DiGraph()
G.add_nodes_from(range(3))
G.add_edges_from([(1, 0), (2, 0)])
assert bf.set_topology(G)
n = 1 << 18                  # 1 MB of float32: sent as its own message, not inline
rounds = 3
value = lambda rank, i: float(100 * rank + i)  # noqa: E731
weights = ({"self_weight": 0.5, "src_weights": {1: 0.25, 2: 0.25}} if r == 0
           else {"self_weight": 1.0, "src_weights": {}})
stream = state().engine.stream


def op(i):
    return bf.neighbor_allreduce_nonblocking(torch.full((n,), value(r, i)), name="loop", **weights)


def expected(i):
    return 0.5 * value(0, i) + 0.25 * (value(1, i) + value(2, i)) if r == 0 else value(r, i)


def free_buffers():
    return sum(len(b) for b in stream.pool._free.values())


def until_rank1_announces(what):
    """Until rank 1's data is queued two deep (the round rank 0 is at, and the next);
    then the later one must still be with rank 1."""
    deadline = time.monotonic() + 30
    while len(stream.inbox.get((1, "loop"), ())) < 2:
        assert time.monotonic() < deadline, f"rank 1's {what} never announced"
        time.sleep(0.01)
    time.sleep(0.1)          # a wrongly posted receive would show by now
    held = [large.keys for large in stream.unposted]
    assert held == [[(1, "loop")]], f"rank 1's {what} was taken in early: held {held}"


results = []
if r == 0:
    h = op(0)
    until_rank1_announces("round 1")    # rank 1 finished round 0 while we wait for rank 2
    assert not stream.pending_recvs, "a receive posted for an operation rank 0 has not started"
    assert free_buffers() == 0, f"{free_buffers()} pooled buffers while only rank 1's round-0 data should be held"
    go.send(None, dest=2)
    results.append(bf.synchronize(h))
    # No op running now; rank 1's round 1 may take a free buffer, and rank 1 goes on to round 2.
    until_rank1_announces("round 2")
    assert free_buffers() == 1, (f"{free_buffers()} free pooled buffers: rank 1's round-2 data must "
                                 "leave one for rank 2's round 1")
    go.send(None, dest=2)
    results += [bf.synchronize(op(i)) for i in range(1, rounds)]
    # round 0 held one buffer (rank 1's data) and took one for rank 2's: two, reused after
    assert free_buffers() == 2, f"{free_buffers()} pooled 1 MB buffers after {rounds} rounds with 2 in-neighbors"
elif r == 1:
    results = [bf.synchronize(op(i)) for i in range(rounds)]
else:
    go.recv(source=0)        # rank 0 is in round 0, waiting for this agent
    results = [bf.synchronize(op(0))]
    go.recv(source=0)        # rank 1 is two rounds ahead of rank 0
    results += [bf.synchronize(op(i)) for i in range(1, rounds)]
for i, got in enumerate(results):
    assert torch.equal(got, torch.full((n,), expected(i))), (i, got[:4])
go.Free()
print(f"AGENT OK {r}", flush=True)
bf.shutdown()

"""Agents issuing the same neighbor_allreduce calls in different orders, waiting in
between, while fusion groups some of them (tests/test_ops.py): rank 0 issues a and b
nonblocking (one fused group), waits for a, then calls c, then waits for b; its
neighbors call a, c and b blocking, in that order. Their b waits for rank 0's c,
which waits for rank 0's a, which would wait for the rest of its group (b) if the
group could only complete as one: the stall inspector splits a group that waits long
with some members' inputs in. Then a chain that splits one group twice. Every
result against numpy.

With the argument "never-b" (BLUEFOG_OP_TIMEOUT_S set by the test): the others
never call b. Rank 0's a still completes, and only b times out, named in the error.
With "large": a split group whose buffer went out as one large message, taken by a
neighbor only after the group's members completed. With "shut": a neighbor that
never takes it, and the shutdown warning naming the group."""
import sys
import time

import numpy as np
import torch

import bluefog_lite as bf
import topology as topo
from bluefog_lite._runtime import state

bf.init(topology_fn=topo.ExponentialTwoGraph)
rank, size = bf.rank(), bf.size()
stats = state().engine.stream.stats


def data(r, round_, k):
    return np.random.default_rng([r, round_, "abcxyz".index(k)]).normal(size=(6,))


def want(round_, k):
    """The default static average: uniform over self and the in-neighbors."""
    ins = bf.in_neighbor_ranks()
    w = 1.0 / (len(ins) + 1)
    return w * data(rank, round_, k) + sum(w * data(r, round_, k) for r in ins)


def grouped(*calls):
    """The handles of calls made while this thread holds the communication thread's
    loop (its drive lock), so that the thread admits them at once: one fused group."""
    engine = state().engine
    with engine._drive:
        handles = [call() for call in calls]
    engine._handback.set()
    return handles


def nonblocking(x, name):
    return lambda: bf.neighbor_allreduce_nonblocking(x, name=name)


if sys.argv[1:] == ["never-b"]:
    from bluefog_lite._stalls import OpTimeout
    x = {k: torch.from_numpy(data(rank, 0, k)) for k in "ab"}
    if rank == 0:
        ha, hb = grouped(nonblocking(x["a"], "a"), nonblocking(x["b"], "b"))
        np.testing.assert_allclose(bf.synchronize(ha).numpy(), want(0, "a"), rtol=1e-12)
        assert stats["fused_groups"] == 1, stats["fused_groups"]
        try:
            bf.synchronize(hb)
            raise AssertionError("b did not time out")
        except OpTimeout as exc:
            assert str(exc).startswith("NEIGHBOR_ALLREDUCE 'b' timed out"), exc
            print("B TIMED OUT", flush=True)
    else:
        bf.neighbor_allreduce(x["a"], name="a")
        time.sleep(4.0)      # (rank 0 waits for b's timeout before the barrier)
    bf.barrier()
    bf.shutdown()
    print(f"AGENT OK {rank}", flush=True)
    sys.exit(0)

if sys.argv[1:] == ["shut"]:
    # rank 0 -> 1 only, and 0 <-> 2 <-> 3 <-> 0: rank 1 never calls, so the large send of
    # rank 0's split group to it is never taken; shutdown (after BLUEFOG_STALL_WARNING_S)
    # warns naming the group
    import networkx as nx
    g = nx.DiGraph([(i, i) for i in range(size)] + [(0, 1), (0, 2), (2, 0), (3, 0), (2, 3), (3, 2)])
    assert bf.set_topology(g)
    big = {k: torch.from_numpy(np.random.default_rng([rank, ord(k)]).normal(size=8000)) for k in "abc"}
    if rank == 0:
        for h in grouped(*(nonblocking(big[k], k) for k in "abc")):
            bf.synchronize(h)
        assert stats["fused_groups"] == 1, stats["fused_groups"]
    elif rank in (2, 3):
        ha = bf.neighbor_allreduce_nonblocking(big["a"], name="a")
        time.sleep(0.5)
        hb, hc = (bf.neighbor_allreduce_nonblocking(big[k], name=k) for k in "bc")
        for h in (ha, hb, hc):
            bf.synchronize(h)
    bf.shutdown()
    print(f"AGENT OK {rank}", flush=True)
    sys.exit(0)

if sys.argv[1:] == ["large"]:
    # three 64,000-byte members: a group of 192 KB, whose buffer goes to each neighbor as
    # one large message (kept in the sender's memory until the receiver takes it).
    # Rank 1 takes it only at 4 s, long after rank 0's split group completed its members
    big = {k: torch.from_numpy(np.random.default_rng([rank, ord(k)]).normal(size=8000)) for k in "abc"}

    def big_want(k):
        ins = bf.in_neighbor_ranks()
        mine = [np.random.default_rng([r, ord(k)]).normal(size=8000) for r in [rank, *ins]]
        return sum(mine) / len(mine)
    got = {}
    if rank == 0:
        handles = grouped(*(nonblocking(big[k], k) for k in "abc"))
        got = {k: bf.synchronize(h) for k, h in zip("abc", handles)}
        assert stats["fused_groups"] == 1, stats["fused_groups"]
        junk = [torch.randn(8000 * 3) for _ in range(50)]     # memory freed too early would be reused
    elif rank == 1:
        time.sleep(4.0)
        got = {k: bf.neighbor_allreduce(big[k], name=k) for k in "abc"}
    else:
        ha = bf.neighbor_allreduce_nonblocking(big["a"], name="a")
        time.sleep(1.5)       # rank 0's group waits for b and c: it is split, a completes first
        hb, hc = (bf.neighbor_allreduce_nonblocking(big[k], name=k) for k in "bc")
        got = {"a": bf.synchronize(ha), "b": bf.synchronize(hb), "c": bf.synchronize(hc)}
    for k in "abc":
        np.testing.assert_allclose(got[k].numpy(), big_want(k), rtol=1e-12, atol=1e-12, err_msg=k)
    bf.barrier()
    bf.shutdown()
    print(f"AGENT OK {rank}", flush=True)
    sys.exit(0)

fused = 0
for round_ in range(4):
    x = {k: torch.from_numpy(data(rank, round_, k)) for k in "abc"}
    names = {k: f"{k}.{round_}" for k in "abc"}
    got = {}
    if rank == 0:
        before = stats["fused_groups"]
        ha, hb = grouped(nonblocking(x["a"], names["a"]), nonblocking(x["b"], names["b"]))
        got["a"] = bf.synchronize(ha)
        fused += stats["fused_groups"] > before
        got["c"] = bf.neighbor_allreduce(x["c"], name=names["c"])
        got["b"] = bf.synchronize(hb)
    else:
        for k in "acb":
            got[k] = bf.neighbor_allreduce(x[k], name=names[k])
    for k in "abc":
        np.testing.assert_allclose(got[k].numpy(), want(round_, k), rtol=1e-12, err_msg=f"{names[k]}")

# a chain: rank 0 groups a, b and c; the others call a, x, b, y, c. The group is split
# twice: a completes, then b (the group's runner split again), then c
for round_ in range(4, 6):
    x = {k: torch.from_numpy(data(rank, round_, k)) for k in "abcxy"}
    names = {k: f"{k}.{round_}" for k in "abcxy"}
    got = {}
    if rank == 0:
        before = stats["fused_groups"]
        handles = dict(zip("abc", grouped(*(nonblocking(x[k], names[k]) for k in "abc"))))
        got["a"] = bf.synchronize(handles["a"])
        fused += stats["fused_groups"] > before
        got["x"] = bf.neighbor_allreduce(x["x"], name=names["x"])
        got["b"] = bf.synchronize(handles["b"])
        got["y"] = bf.neighbor_allreduce(x["y"], name=names["y"])
        got["c"] = bf.synchronize(handles["c"])
    else:
        for k in "axbyc":
            got[k] = bf.neighbor_allreduce(x[k], name=names[k])
    for k in "abcxy":
        np.testing.assert_allclose(got[k].numpy(), want(round_, k), rtol=1e-12, err_msg=f"{names[k]}")
if rank == 0:
    print(f"FUSED ROUNDS {fused}", flush=True)
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

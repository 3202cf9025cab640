"""A call whose arguments were accepted but that fails on one agent before it has
sent its data (an allocation that fails, a tensor that cannot be packed, a GPU
error surfacing at the copy to the host): the agents waiting for that data raise
at once, naming the agent and its error, instead of waiting until the stall
warning (or for good). The failing agent raises its own error, drops what its
neighbors sent for the call, and the next call of the same name pairs up again.

Rank 1's packing of outgoing tensors raises MemoryError while ARMED (on the
communication thread, and in the caller for the blocking calls it runs). Every
failing case is followed by the same call without the failure, checked against
numpy. BLUEFOG_OP_TIMEOUT_S (set by the test) turns a hang into an OpTimeout.
"""
import os
import time

import numpy as np
import torch

import bluefog_lite as bf
import bluefog_lite._collective_tasks as collective_tasks
import bluefog_lite._neighbor_tasks as tasks
import bluefog_lite._quick as quick
import topology as topo
from _reference import uniform_mixing

bf.init()
rank, size = bf.rank(), bf.size()
assert size == 4
G = topo.ExponentialGraph(size)      # rank r sends to r+1, r+2 and receives from r-1, r-2
bf.set_topology(G)
M = uniform_mixing(G)
FAILING = 1
TIMEOUT_S = float(os.environ["BLUEFOG_OP_TIMEOUT_S"])
ARMED = [False]
_Outgoing = tasks.Outgoing


class FailingOutgoing(_Outgoing):
    def __init__(self, *args, **kwargs):
        if ARMED[0] and rank == FAILING:
            raise MemoryError("injected: no memory to pack the tensor")
        super().__init__(*args, **kwargs)


tasks.Outgoing = FailingOutgoing

# the caller's own packing of small and large blocking calls (_quick.py)
stream = bf._runtime.state().engine.stream
_small_packet, _tensor_bytes = stream.small_packet, quick.tensor_bytes


QUICK_FAILURES = [0]


def failing(real):
    def packing(*args):
        if ARMED[0] and rank == FAILING:
            QUICK_FAILURES[0] += 1
            raise MemoryError("injected: no memory to pack the tensor")
        return real(*args)
    return packing


stream.small_packet, quick.tensor_bytes = failing(_small_packet), failing(_tensor_bytes)


def data(r, shape, seed):
    return np.random.default_rng(seed * 10 + r).normal(size=shape).astype(np.float32)


def outcome(fn):
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def check_failure(what, got, receives_from_failing):
    if rank == FAILING:
        assert got and got[0] == "MemoryError" and "injected" in got[1], (what, got)
    elif receives_from_failing:
        assert got and got[0] == "ValueError", (what, got)
        assert f"rank {FAILING} " in got[1] and "MemoryError: injected" in got[1], (what, got)
    else:
        assert got is None, (what, got)


def case(what, call, receives_from_failing, reference):
    """call(armed) -> result; run it failing on rank 1, then again (checked against the reference)."""
    ARMED[0] = True
    try:
        check_failure(what, outcome(lambda: call(True)), receives_from_failing)
    finally:
        ARMED[0] = False
    bf.barrier()
    got = call(False)
    np.testing.assert_allclose(got.numpy(), reference, rtol=1e-5, atol=1e-5, err_msg=what)
    bf.barrier()


def mixed(shape, seed):
    return sum(M[rank, i] * data(i, shape, seed).astype(np.float64) for i in range(size))


from_failing = M[rank, FAILING] > 0 and rank != FAILING

# one nonblocking neighbor_allreduce, a small and a large (4 MB) tensor
for shape in [(5, 3), (1 << 20,)]:
    case(f"neighbor_allreduce {shape}",
         lambda armed, s=shape: bf.synchronize(bf.neighbor_allreduce_nonblocking(
             torch.from_numpy(data(rank, s, 1)), name=f"pk.nar.{s[0]}")),
         from_failing, mixed(shape, 1))

# blocking ones, run by their caller (a small one and a large one)
for k, shape in enumerate([(5, 3), (1 << 17,)]):
    case(f"blocking neighbor_allreduce {shape}",
         lambda armed, s=shape: bf.neighbor_allreduce(torch.from_numpy(data(rank, s, 6)), name=f"pk.q.{s[0]}"),
         from_failing, mixed(shape, 6))
    assert rank != FAILING or QUICK_FAILURES[0] == k + 1, "the caller did not run the call"

# a fused group of small ones: every member fails on the agents that receive from rank 1
shapes = [(7,), (3, 4), (100,)]


def fused(armed):
    hs = [bf.neighbor_allreduce_nonblocking(torch.from_numpy(data(rank, s, 2 + k)), name=f"pk.fused.{k}")
          for k, s in enumerate(shapes)]
    results, errors = [], []
    for h in hs:
        try:
            results.append(bf.synchronize(h))
        except Exception as exc:
            errors.append(exc)
    if errors:
        assert len(errors) == len(hs), errors     # the whole group failed, every member says so
        raise errors[0]
    return torch.cat([t.reshape(-1) for t in results])


case("fused", fused, from_failing,
     np.concatenate([mixed(s, 2 + k).reshape(-1) for k, s in enumerate(shapes)]))

# dynamic weights: a scaled copy per destination
dst = {(rank + 1) % size: 0.5}
src = {(rank - 1) % size: 1.0}
case("scaled", lambda armed: bf.synchronize(bf.neighbor_allreduce_nonblocking(
    torch.from_numpy(data(rank, (6,), 3)), self_weight=0.5, src_weights=src, dst_weights=dst, name="pk.dyn")),
     rank == (FAILING + 1) % size,
     0.5 * data(rank, (6,), 3) + 0.5 * data((rank - 1) % size, (6,), 3))

# neighbor_allgather (blocking: it is not run by the caller)
case("neighbor_allgather", lambda armed: bf.neighbor_allgather(torch.from_numpy(data(rank, (2, 3), 4)),
                                                               name="pk.nag"),
     from_failing, np.concatenate([data(s, (2, 3), 4) for s in bf.in_neighbor_ranks()]))

# pair_gossip between 0-1 and 2-3
peer = rank ^ 1
case("pair_gossip", lambda armed: bf.pair_gossip(torch.from_numpy(data(rank, (4,), 5)), peer, name="pk.pg"),
     peer == FAILING, 0.5 * (data(rank, (4,), 5) + data(peer, (4,), 5)))

# machine-local allreduce and hierarchical_neighbor_allreduce (BLUEFOG_RANKS_PER_MACHINE=2:
# machines {0, 1} and {2, 3}): rank 1's machine has no sum, so the same local rank of the
# other machine fails too, and so does the agent there that waits for rank 0's
assert bf.local_size() == 2
local = [r for r in range(size) if r // 2 == rank // 2]
case("local allreduce", lambda armed: bf.allreduce(torch.from_numpy(data(rank, (5,), 7)), is_hierarchical_local=True,
                                                   name="pk.local"),
     rank // 2 == FAILING // 2, np.mean([data(r, (5,), 7) for r in local], axis=0))
other = [r for r in range(size) if r // 2 != rank // 2]
case("hierarchical", lambda armed: bf.hierarchical_neighbor_allreduce(torch.from_numpy(data(rank, (5,), 8)),
                                                                      name="pk.hna"),
     True, np.mean([data(r, (5,), 8) for r in range(size)], axis=0))

# a collective that fails on one agent after the agents agreed on it, before its MPI call:
# the others wait in that call (here until BLUEFOG_OP_TIMEOUT_S), and the failing agent's
# next collective is refused (it would pair with theirs) instead of mixing data
_copied = collective_tasks.copied


def failing_copy(*ops):
    if ARMED[0] and rank == FAILING:
        raise MemoryError("injected: the copy failed")
    return _copied(*ops)


collective_tasks.copied = failing_copy
ARMED[0] = True
got = outcome(lambda: bf.allreduce(torch.ones(3), name="pk.ar"))
ARMED[0] = False
if rank == FAILING:
    assert got and got[0] == "MemoryError", got
    time.sleep(TIMEOUT_S - 1)     # (its barrier below must not time out waiting for theirs)
else:
    assert got and got[0] == "OpTimeout", got
got = outcome(lambda: bf.allreduce(torch.ones(3), name="pk.ar.next"))
assert got and got[0] == "RuntimeError" and "cannot run" in got[1], got
if rank == FAILING:
    assert ("failed on this agent (rank 1) after the agents agreed on it, before its MPI call "
            "(MemoryError") in got[1], got
bf.barrier()

print(f"AGENT OK {rank}", flush=True)
bf.shutdown()

"""A call whose arguments were accepted but that fails on one agent before it has
sent its data (an allocation that fails, a tensor that cannot be packed, a GPU
error surfacing at the copy to the host): the agents waiting for that data raise
at once, naming the agent and its error, instead of waiting until the stall
warning (or for good). The failing agent raises its own error, drops what its
neighbors sent for the call, and the next call of the same name pairs up again.

Rank 1's packing of outgoing tensors raises MemoryError while ARMED (on the
communication thread, and in the caller for the blocking calls it runs). Every
failing case is followed by the same call without the failure, checked against
numpy. Then collectives that fail after the agents agreed on them, before their
MPI call, on every agent and on one. BLUEFOG_OP_TIMEOUT_S (set by the test) turns
a hang into an OpTimeout.
"""
import threading

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
_small_packet, _memory = stream.small_packet, quick._memory


QUICK_FAILURES = [0]


def failing(real):
    def packing(*args):
        if ARMED[0] and rank == FAILING:
            QUICK_FAILURES[0] += 1
            raise MemoryError("injected: no memory to pack the tensor")
        return real(*args)
    return packing


stream.small_packet, quick._memory = failing(_small_packet), failing(_memory)

# the caller's allocation of the result (before it sends: after, its neighbors' inputs
# would stay queued and feed its next call of the name)
_empty_like = quick.torch.empty_like


def failing_empty_like(*args, **kwargs):
    if ALLOC_ARMED[0] and rank == FAILING and threading.current_thread() is threading.main_thread():
        QUICK_FAILURES[0] += 1
        raise MemoryError("injected: no memory to pack the tensor")
    return _empty_like(*args, **kwargs)


ALLOC_ARMED = [False]
quick.torch.empty_like = failing_empty_like

# a failure once the data is queued (here in marking the sends): the destinations have this
# call's data and get no note (a note would feed their next call of the name)
_mark_sends = tasks.mark_sends
AFTER_SENDS = [False]


def failing_mark(*args):
    if AFTER_SENDS[0] and rank == FAILING:
        raise MemoryError("injected: after the sends")
    return _mark_sends(*args)


tasks.mark_sends = failing_mark


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
        assert got and got[0] == "MemoryError" and "injected:" in got[1], (what, got)
    elif receives_from_failing:
        assert got and got[0] == "ValueError", (what, got)
        assert f"rank {FAILING} " in got[1] and "MemoryError: injected" in got[1], (what, got)
    else:
        assert got is None, (what, got)


def case(what, call, receives_from_failing, reference, arm=ARMED, failing_first=False):
    """call() -> result; run it with the failure armed (arm[0] True) on rank 1 (an agent
    that does not receive from it gets the reference), then again (checked against the
    reference). failing_first: rank 1 makes its call, and fails, before the others make
    theirs (a blocking call is run by its caller only while the communication thread
    sleeps: a neighbor's large tensor arriving first wakes it, and it takes the call)."""
    if failing_first and rank != FAILING:
        bf.barrier()
    arm[0] = True
    try:
        if receives_from_failing or rank == FAILING:
            check_failure(what, outcome(call), receives_from_failing)
        else:
            np.testing.assert_allclose(call().numpy(), reference, rtol=1e-5, atol=1e-5, err_msg=what + " (failing)")
    finally:
        arm[0] = False
    if failing_first and rank == FAILING:
        bf.barrier()
    bf.barrier()
    got = call()
    np.testing.assert_allclose(got.numpy(), reference, rtol=1e-5, atol=1e-5, err_msg=what)
    bf.barrier()


def mixed(shape, seed):
    return sum(M[rank, i] * data(i, shape, seed).astype(np.float64) for i in range(size))


from_failing = M[rank, FAILING] > 0 and rank != FAILING

# one nonblocking neighbor_allreduce, a small and a large (4 MB) tensor
for shape in [(5, 3), (1 << 20,)]:
    case(f"neighbor_allreduce {shape}",
         lambda s=shape: bf.synchronize(bf.neighbor_allreduce_nonblocking(
             torch.from_numpy(data(rank, s, 1)), name=f"pk.nar.{s[0]}")),
         from_failing, mixed(shape, 1))

# blocking ones, run by their caller (a small one and a large one); the others' calls come
# after rank 1 failed (its note waits for them) and send it data it drops
for k, shape in enumerate([(5, 3), (1 << 17,)]):
    case(f"blocking neighbor_allreduce {shape}",
         lambda s=shape: bf.neighbor_allreduce(torch.from_numpy(data(rank, s, 6)), name=f"pk.q.{s[0]}"),
         from_failing, mixed(shape, 6), failing_first=True)
    assert rank != FAILING or QUICK_FAILURES[0] == 2 * k + 1, "the caller did not run the call"
    case(f"blocking neighbor_allreduce {shape}, allocation",
         lambda s=shape: bf.neighbor_allreduce(torch.from_numpy(data(rank, s, 9)), name=f"pk.qa.{s[0]}"),
         from_failing, mixed(shape, 9), ALLOC_ARMED, failing_first=True)
    assert rank != FAILING or QUICK_FAILURES[0] == 2 * k + 2, "the caller did not run the call"

case("after the sends", lambda: bf.synchronize(bf.neighbor_allreduce_nonblocking(
    torch.from_numpy(data(rank, (6,), 10)), name="pk.after")), False, mixed((6,), 10), AFTER_SENDS)

# a fused group of small ones: every member fails on the agents that receive from rank 1
shapes = [(7,), (3, 4), (100,)]


def fused():
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
case("scaled", lambda: bf.synchronize(bf.neighbor_allreduce_nonblocking(
    torch.from_numpy(data(rank, (6,), 3)), self_weight=0.5, src_weights=src, dst_weights=dst, name="pk.dyn")),
     rank == (FAILING + 1) % size,
     0.5 * data(rank, (6,), 3) + 0.5 * data((rank - 1) % size, (6,), 3))

# neighbor_allgather (blocking: it is not run by the caller)
case("neighbor_allgather", lambda: bf.neighbor_allgather(torch.from_numpy(data(rank, (2, 3), 4)),
                                                               name="pk.nag"),
     from_failing, np.concatenate([data(s, (2, 3), 4) for s in bf.in_neighbor_ranks()]))

# pair_gossip between 0-1 and 2-3
peer = rank ^ 1
case("pair_gossip", lambda: bf.pair_gossip(torch.from_numpy(data(rank, (4,), 5)), peer, name="pk.pg"),
     peer == FAILING, 0.5 * (data(rank, (4,), 5) + data(peer, (4,), 5)))

# machine-local allreduce and hierarchical_neighbor_allreduce (BLUEFOG_RANKS_PER_MACHINE=2:
# machines {0, 1} and {2, 3}): rank 1's machine has no sum, so the same local rank of the
# other machine fails too, and so does the agent there that waits for rank 0's
assert bf.local_size() == 2
local = [r for r in range(size) if r // 2 == rank // 2]
case("local allreduce", lambda: bf.allreduce(torch.from_numpy(data(rank, (5,), 7)), is_hierarchical_local=True,
                                                   name="pk.local"),
     rank // 2 == FAILING // 2, np.mean([data(r, (5,), 7) for r in local], axis=0))
other = [r for r in range(size) if r // 2 != rank // 2]
case("hierarchical", lambda: bf.hierarchical_neighbor_allreduce(torch.from_numpy(data(rank, (5,), 8)),
                                                                      name="pk.hna"),
     True, np.mean([data(r, (5,), 8) for r in range(size)], axis=0))

# collectives that fail after the agents agreed on them, before their MPI call
COPY_FAILS = {"pk.ar.all": range(size), "pk.ar": [FAILING], "pk.ag.all": range(size)}   # name: where it fails
_copied = collective_tasks.copied


def failing_copy(*ops):
    if rank in COPY_FAILS.get(ops[0].name, ()):
        raise MemoryError("injected: the copy failed")
    return _copied(*ops)


collective_tasks.copied = failing_copy
ones = torch.full((3,), float(rank))
mean = np.full(3, (size - 1) / 2)

# on every agent: nothing is pending anywhere, and the next collectives run
got = outcome(lambda: bf.allreduce(ones, name="pk.ar.all"))
assert got and got[0] == "MemoryError", got
np.testing.assert_allclose(bf.allreduce(ones, name="pk.ar.after").numpy(), mean)
np.testing.assert_allclose(bf.broadcast(ones, 2, name="pk.bc.after").numpy(), np.full(3, 2.0))

# on one agent: the others wait in that call's MPI collective for good (here until
# BLUEFOG_OP_TIMEOUT_S), which would pair with the failed agent's next MPI collective (mixing
# their data): that one waits for their word that they failed too, which never comes; also
# when another collective failed on every agent in between (their words for it do come)
h = bf.allreduce_nonblocking(ones, name="pk.ar")
got = outcome(lambda: bf.allgather(ones, name="pk.ag.all"))
assert got and got[0] == "MemoryError", got
h_next = bf.allreduce_nonblocking(ones, name="pk.ar.next")
got = outcome(lambda: bf.synchronize(h))
assert got and got[0] == ("MemoryError" if rank == FAILING else "OpTimeout"), got
got = outcome(lambda: bf.synchronize(h_next))
assert got and got[0] == "OpTimeout", got     # (not a result mixing pk.ar's and pk.ar.next's data)
got = outcome(lambda: bf.allgather(ones, name="pk.ag"))
assert got and got[0] == "RuntimeError" and "cannot run" in got[1] and "timed out on this agent" in got[1], got
bf.barrier()

print(f"AGENT OK {rank}", flush=True)
bf.shutdown()

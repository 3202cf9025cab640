"""win_mutex excludes: (1) an agent holding its own mutex keeps every other agent
waiting for it; (2) agents accumulating into rank 0 under the mutex while rank 0
collects (and resets) under it produce the exact sum; (3) a critical-section
marker written under the mutex is never seen by rank 0 reading under it.
Topology: StarGraph(n), so every leaf is an in-neighbor of rank 0."""
import sys
import time

import numpy as np
import torch

import bluefog_lite as bf
import topology as topo

bf.init()
rank, size = bf.rank(), bf.size()
assert bf.set_topology(topo.StarGraph(size))
rng = np.random.default_rng(rank)
LEAVES = list(range(1, size))

# -- (1) the holder keeps the others out for as long as it holds ---------------------------
x = torch.zeros(16, dtype=torch.float64)
bf.win_create(x, "m", zero_init=True)
# Every agent runs on this host, so time.monotonic() is one clock: a leaf must get the mutex
# after rank 0 began to let it go, however the scheduler spaces the calls.
HOLD_S = 0.5
if rank == 0:
    with bf.win_mutex("m", for_self=True):
        bf.barrier()
        time.sleep(HOLD_S)
        stamp = time.monotonic()        # (before the release)
else:
    bf.barrier()
    with bf.win_mutex("m", ranks=[0]):
        stamp = time.monotonic()        # (after the acquisition)
stamps = bf.allgather(torch.tensor([stamp], dtype=torch.float64), name="mutex.stamps").tolist()
for r in LEAVES:
    assert stamps[r] > stamps[0], f"rank {r} got the mutex {stamps[0] - stamps[r]:.3f} s before rank 0 let go"
    assert stamps[r] - stamps[0] < 30, f"rank {r} got the mutex {stamps[r] - stamps[0]:.1f} s after rank 0 let go"

# -- (2) exact sum: accumulates and collect-with-reset never interleave -----------------------
ROUNDS = 25


def contribution(r, k):
    return torch.arange(16, dtype=torch.float64) * (r + 1) + 1000.0 * k   # integers: exact sums


def leaves_done(what):
    """Rank 0 polls this signal while it works; leaves join it when they are done."""
    return bf.allreduce_nonblocking(torch.zeros(1), name=f"done.{what}")


if rank == 0:
    done, collects = leaves_done("sum"), 0
    while not bf.poll(done):
        bf.win_update_then_collect("m")          # require_mutex=True by default
        collects += 1
        time.sleep(0.001)
    bf.synchronize(done)
    bf.win_update_then_collect("m")
    expected = sum(contribution(r, k) for r in LEAVES for k in range(ROUNDS))
    assert torch.equal(x, expected), f"lost or doubled updates: {(x - expected).tolist()}"
    assert collects > 3, "rank 0 should have collected while the leaves were accumulating"
else:
    for k in range(ROUNDS):
        time.sleep(rng.uniform(0, 0.002))
        if k % 3 == 0:     # the op takes the mutex itself
            bf.win_accumulate(contribution(rank, k), "m", require_mutex=True)
        else:              # the agent holds it; the op's own require_mutex is then re-entrant
            with bf.win_mutex("m", ranks=[0]):
                bf.win_accumulate(contribution(rank, k), "m", require_mutex=k % 3 == 1)
    bf.synchronize(leaves_done("sum"))
bf.barrier()

# -- (3) a marker set and cleared inside the critical section is never seen under the mutex -----
ones, zeros = torch.ones(16, dtype=torch.float64), torch.zeros(16, dtype=torch.float64)
if rank == 0:
    done, reads = leaves_done("marker"), 0
    while not bf.poll(done):
        y = bf.win_update("m", 0.0, {r: 1.0 for r in LEAVES}, clone=True, require_mutex=True)
        assert float(y.sum()) == 0.0, f"saw a leaf inside its critical section: {y.tolist()}"
        reads += 1
    bf.synchronize(done)
    assert reads > 3
else:
    for k in range(10):
        with bf.win_mutex("m"):                    # default: the out-neighbors, here [0]
            bf.win_put(ones, "m")
            time.sleep(0.002)
            bf.win_put(zeros, "m")
        time.sleep(rng.uniform(0, 0.002))
    bf.synchronize(leaves_done("marker"))
bf.barrier()

# -- (4) win_get(require_mutex=True) refreshes the agent's own exposed copy under its own
#        mutex: while a leaf holds rank 0's mutex, rank 0's win_get cannot finish --------------
if rank == 1:
    with bf.win_mutex("m", ranks=[0]):
        bf.barrier()                               # rank 0 starts its win_get now
        bf.barrier()                               # ... and has looked at it
elif rank == 0:
    bf.barrier()
    h = bf.win_get_nonblocking("m", require_mutex=True)
    time.sleep(0.3)
    done_while_held = bf.win_poll(h)
    bf.barrier()
    bf.win_wait(h)
    assert not done_while_held, "win_get refreshed rank 0's exposed copy while rank 1 held rank 0's mutex"
else:
    bf.barrier()
    bf.barrier()
bf.barrier()

# -- (5) inside a win_mutex block that holds other agents' mutexes, win_get(require_mutex=True)
#        does not wait for the agent's own: rank 1 holds rank 0's mutex, rank 0 holds rank 1's,
#        and each gets (it waited for its own, held by the other: a deadlock) ----------------------
if rank in (0, 1):
    with bf.win_mutex("m", ranks=[1 - rank]):
        bf.barrier()                               # both blocks are entered
        bf.win_get("m", require_mutex=True)
        bf.barrier()
else:
    bf.barrier()
    bf.barrier()
bf.barrier()
bf.win_free("m")
sys.stdout.write(f"AGENT OK {rank}\n")
bf.shutdown()

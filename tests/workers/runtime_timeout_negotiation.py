"""A collective that only some agents call times out there (in the agents'
agreement); the others never called it. Before, those agents' collectives were one
ahead of the others' for good: every later barrier paired with the others'
previous one and returned without waiting, set_topology returned True on two agents
and left the topology unchanged on the other two. Now the agents that time out tell
the others, whose next collective is refused with an OpTimeout naming them (it
would pair with the call they gave up); the sequence is used up everywhere, so the
same calls made again pair up, and barriers wait again. A refused allreduce whose
headers did not match (it met a given-up barrier) leaves MPI collectives running: no
agent could have made its MPI call."""
import sys
import time

import torch

import bluefog_lite as bf
import topology

bf.init()
r, n = bf.rank(), bf.size()
EARLY = (0, 1)


def times_out(text, fn, *args):
    """fn(*args) raises a TimeoutError saying text."""
    try:
        fn(*args)
    except TimeoutError as e:
        assert text in str(e), e
        return
    raise AssertionError(f"rank {r}: {fn.__name__} did not raise a TimeoutError saying {text!r}")


def refused(fn, *args):
    times_out("was refused: ranks [0, 1] timed out in their collective", fn, *args)


def timed_out(fn, *args):
    times_out("timed out after", fn, *args)


# -- a barrier that ranks 2 and 3 never call ------------------------------------------------
# (BLUEFOG_OP_TIMEOUT_S=3: ranks 0 and 1 give up at 3 s; 2 and 3 call their next collective at
# 4.5 s; 0 and 1 theirs at 6 s, once 2 and 3 are past the refused one, which returns at once;
# margins of 1.5 s, for a loaded host)
if r in EARLY:
    timed_out(bf.barrier)
    time.sleep(3)
else:
    time.sleep(4.5)
    refused(bf.barrier)             # the first collective after: it met their withdrawn barrier
bf.barrier()
for i in range(2):                  # barriers synchronize again: rank 0 is 2 s late to each
    if r == 0:
        time.sleep(2.0)
    t0 = time.monotonic()
    bf.barrier()
    waited = time.monotonic() - t0
    assert r == 0 or waited > 1.0, f"rank {r}: barrier {i} returned after {waited:.2f} s"

# -- set_topology on some agents only ----------------------------------------------------------
if r in EARLY:
    timed_out(bf.set_topology, topology.RingGraph(n))
    time.sleep(3)
else:
    time.sleep(4.5)
    refused(bf.set_topology, topology.RingGraph(n))
assert bf.set_topology(topology.RingGraph(n))       # every agent, made again: it pairs up
assert sorted(bf.in_neighbor_ranks()) == sorted({(r - 1) % n, (r + 1) % n}), bf.in_neighbor_ranks()
got = bf.neighbor_allreduce(torch.full((3,), float(r)), name="ring")
assert torch.allclose(got, torch.full((3,), (r + (r - 1) % n + (r + 1) % n) / 3.0)), got

# -- an MPI collective refused where the headers disagree (ranks 2 and 3's allreduce met the
# barrier ranks 0 and 1 gave up): nobody could have made its MPI call, so MPI collectives go on
if r in EARLY:
    timed_out(bf.barrier)
    time.sleep(3)
else:
    time.sleep(4.5)
    refused(lambda: bf.allreduce(torch.ones(2), name="refused.sum"))

# -- MPI collectives still run (no MPI collective timed out)
assert torch.equal(bf.allreduce(torch.full((2,), float(r)), average=False, name="sum"),
                   torch.full((2,), n * (n - 1) / 2))
bf.shutdown()
sys.stdout.write(f"AGENT OK {r}\n")

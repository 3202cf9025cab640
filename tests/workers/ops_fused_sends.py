"""A fused group whose task has finished but whose large send (4 x 40 KB fused: one
160 KB message) a slow receiver has not taken yet, 3 agents: rank 0 receives from 1
and sends to 1 and 2; rank 2 takes its data late.

- "late": rank 1's inputs are in before rank 0's group starts, so its task finishes
  at once and the group then waits only for its send. It was "split" by the stall
  inspector (its last wait was kept): the split took the next round's inputs and the
  communication thread crashed completing the lead twice. Every round right.
- "timeout" (BLUEFOG_OP_TIMEOUT_S=2): rank 2 comes after 5 s; every member of
  rank 0's group fails with the timeout (only the first did, the others returned
  their results), and rank 2 still gets rank 0's data."""
import sys
import time

import torch

import bluefog_lite as bf
from bluefog_lite._runtime import state
from bluefog_lite._stalls import OpTimeout

bf.init()
r = bf.rank()
assert bf.size() == 3
N, K = 10000, 4
names = [f"m{i}" for i in range(K)]
sw = 0.5
srcw, dstw = {0: ({1: 0.5}, {1: 1.0, 2: 1.0}), 1: ({0: 0.5}, {0: 1.0}), 2: ({0: 0.5}, {})}[r]
mode = sys.argv[1]


def value(rank, rnd, i):
    return float(rank * 100 + rnd * 10 + i)


def calls(rnd):
    # Submitted while holding the loop (the engine's drive lock), so that it admits the four
    # together, as one fused group: on a loaded host it could take m0 alone (its settling wait
    # is ~0.2 ms), whose 40 KB send MPI completes without the receiver (eagerly), and m0
    # returned in the "timeout" mode.
    with state().engine._drive:
        return [bf.neighbor_allreduce_nonblocking(torch.full((N,), value(r, rnd, i)), self_weight=sw, src_weights=srcw,
                                                  dst_weights=dstw, enable_topo_check=False, name=n)
                for i, n in enumerate(names)]


def want(rnd, i):
    return sw * value(r, rnd, i) + sum(w * value(s, rnd, i) for s, w in srcw.items())


if mode == "late":
    for rnd in range(6):
        if r == 0:
            time.sleep(0.5)     # rank 1's inputs are in before rank 0's group starts
        if r == 2:
            time.sleep(1.0)     # takes rank 0's slab late
        for i, h in enumerate(calls(rnd)):
            got = bf.synchronize(h)
            assert torch.equal(got, torch.full((N,), want(rnd, i))), f"rank {r} round {rnd} {names[i]}: {got[0]}"
else:
    if r == 2:
        time.sleep(5.0)     # (ranks 0 and 1 have 2 s to exchange: margin for a loaded host)
    for i, h in enumerate(calls(0)):
        if r == 0:
            try:
                bf.synchronize(h)
                raise AssertionError(f"rank 0: {names[i]} returned although its group's send timed out")
            except OpTimeout as exc:
                assert "own sends" in str(exc) and "'m0'" in str(exc), exc
        else:
            assert torch.equal(bf.synchronize(h), torch.full((N,), want(0, i))), f"rank {r}: {names[i]}"
if mode == "late":
    bf.barrier()
print(f"AGENT OK {r}", flush=True)
bf.shutdown()

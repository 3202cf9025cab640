"""A collective that times out leaves the agents' collectives out of step: ranks 0-2
time out in allreduce 'ar1' before rank 3 joins it; rank 3 then made its MPI call,
which would pair with their next allreduce and mix the two calls' data (it did:
'ar2' returned a wrong average on ranks 0-2, without an error). Now every agent
where a collective timed out refuses later MPI collectives with a RuntimeError naming
it, and rank 3's ar1 is refused (a TimeoutError: the others gave it up), which ends
its MPI collectives too; barrier, neighbor operations and topology checks still work;
shutdown, which cannot free the window left (freeing is a collective), warns and ends."""
import sys
import time

import numpy as np
import torch

import bluefog_lite as bf
import topology

bf.init(topology_fn=topology.RingGraph)
r, n = bf.rank(), bf.size()
bf.win_create(torch.zeros(2), "kept")    # shutdown cannot free it (a collective): it says so
t0 = time.monotonic()
if r == n - 1:
    time.sleep(5.0)                      # BLUEFOG_OP_TIMEOUT_S=2: the others give up first
try:
    bf.allreduce(torch.full((2,), float(r)), name="ar1")
    raise AssertionError(f"rank {r}: ar1 completed")
except TimeoutError:
    pass
time.sleep(max(0.0, t0 + 10.0 - time.monotonic()))    # every agent is past ar1 now
try:
    got = bf.allreduce(torch.full((2,), 100.0 + r), name="ar2")
    raise AssertionError(f"rank {r}: ar2 ran after a timed-out collective and returned {got.tolist()}")
except RuntimeError as e:
    # (rank 3's ar1 was refused, as the others had given it up: its later MPI collectives end too)
    assert ("ALLREDUCE 'ar2' cannot run: the collective ALLREDUCE 'ar1' timed out on this agent" in str(e)
            if r < n - 1 else "ALLREDUCE 'ar2' cannot run: ranks [0, 1, 2] timed out in their collective" in str(e)), e
bf.barrier()           # no MPI collective call: still works
x = torch.full((3,), float(r))
got = bf.neighbor_allreduce(x, name="after")
np.testing.assert_allclose(got.numpy(), np.full(3, (r + (r - 1) % n + (r + 1) % n) / 3.0))
got = bf.neighbor_allreduce(x, self_weight=0.5, src_weights={(r - 1) % n: 0.5}, dst_weights=[(r + 1) % n],
                            name="after.checked")       # dynamic, with its topology check (a negotiation)
np.testing.assert_allclose(got.numpy(), np.full(3, (r + (r - 1) % n) / 2.0))
bf.shutdown()
sys.stdout.write(f"AGENT OK {r}\n")

"""Machines {0, 1} and {2, 3} (BLUEFOG_RANKS_PER_MACHINE=2). Rank 1 starts a nonblocking
hierarchical_neighbor_allreduce and shuts down without synchronizing it; rank 0, its
machine peer, comes 4.5 s late (past the 3 s that ops wait for a departing agent).
Rank 1's machine sum, which ranks 2 and 3 wait for, needs rank 0: rank 1 must not
count as leaving while its own operation is in flight (the job aborted)."""
import time

import numpy as np
import torch

import bluefog_lite as bf

bf.init()
r = bf.rank()
x = torch.full((4,), float(r), dtype=torch.float64)
if r == 1:
    bf.hierarchical_neighbor_allreduce_nonblocking(x, name="h")
else:
    if r == 0:
        time.sleep(4.5)
    y = bf.hierarchical_neighbor_allreduce(x, name="h")
    # Exp-2 over 2 machines: each machine averages its own sum and the other's
    np.testing.assert_allclose(y.numpy(), np.full(4, 1.5))
print(f"AGENT OK {r}", flush=True)
bf.shutdown()

"""After a caught op timeout, the next op of the same name must use fresh data only:
rank 1 joins round 1 after the others have timed out (its data arrives late), then
every agent runs round 2 with new values, which must match the mixing matrix."""
import time

import numpy as np
import torch

import bluefog_lite as bf
import topology
from bluefog_lite._stalls import OpTimeout

bf.init()
r, n = bf.rank(), bf.size()
A = (topology.mixing_matrix(topology.ExponentialGraph(n)) > 0).astype(float)
W = A / A.sum(axis=0, keepdims=True)      # default weights: uniform 1/(in-degree+1)
bf.barrier()
t0 = time.monotonic()
if r == 1:
    time.sleep(3.0)                       # the others time out after 1.5 s
    bf.neighbor_allreduce(torch.full((8,), 1.0 + r), name="x")
elif 1 in bf.in_neighbor_ranks():
    try:
        bf.neighbor_allreduce(torch.full((8,), 1.0 + r), name="x")
        raise AssertionError("round 1 should have timed out")
    except OpTimeout as exc:
        assert "timed out" in str(exc) and "[1]" in str(exc), exc
else:
    bf.neighbor_allreduce(torch.full((8,), 1.0 + r), name="x")
# no collective here (it would time out too): wait until rank 1's late round 1 is surely done
time.sleep(max(0.0, t0 + 5.0 - time.monotonic()))
values = np.array([1000.0 + 7 * j for j in range(n)])
y = bf.neighbor_allreduce(torch.full((8,), values[r]), name="x")
expected = (W.T @ values)[r]
assert torch.allclose(y, torch.full((8,), expected, dtype=y.dtype)), (r, y[0].item(), expected)
print(f"AGENT OK {r}", flush=True)
bf.shutdown()

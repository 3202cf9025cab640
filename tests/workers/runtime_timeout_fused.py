"""A fused group that times out: every member fails with the timeout (the message of a
grouped lead names its fused members), and the next ops of the same names use fresh
data only. Rank 1 joins round 1 after the others have timed out; its late data,
sent as its own group, must be dropped member by member."""
import time

import numpy as np
import torch

import bluefog_lite as bf
import topology
from bluefog_lite._stalls import OpTimeout
from bluefog_lite._runtime import state

K = 12
bf.init()
r, n = bf.rank(), bf.size()
A = (topology.mixing_matrix(topology.ExponentialGraph(n)) > 0).astype(float)
W = A / A.sum(axis=0, keepdims=True)      # default weights: uniform 1/(in-degree+1)
stats = state().engine.stream.stats


def burst(value):
    handles = [bf.neighbor_allreduce_nonblocking(torch.full((8,), value + k), name=f"g.{k}") for k in range(K)]
    results = []
    for h in handles:
        try:
            results.append(bf.synchronize(h))
        except OpTimeout as exc:
            results.append(exc)
    return results


bf.barrier()
t0 = time.monotonic()
if r == 1:
    time.sleep(3.0)                       # the others time out after 1.5 s
before = stats["fused_ops"]
results = burst(1.0 + r)
if 1 in bf.in_neighbor_ranks() and r != 1:
    assert all(isinstance(x, OpTimeout) for x in results), [type(x).__name__ for x in results]
    assert all("timed out" in str(x) and "[1]" in str(x) for x in results), results[0]
    fused = stats["fused_ops"] > before   # (fusion needs the burst queued before the thread admits it)
    if fused:
        assert any("fused with" in str(x) for x in results), [str(x) for x in results]
else:
    fused = False
    assert not any(isinstance(x, Exception) for x in results), results
# no collective here (it would time out too): wait until rank 1's late round 1 is surely done
time.sleep(max(0.0, t0 + 5.0 - time.monotonic()))
values = np.array([1000.0 + 7 * j for j in range(n)])
results = burst(values[r])
for k, y in enumerate(results):
    expected = (W.T @ (values + k))[r]
    assert torch.allclose(y, torch.full((8,), expected, dtype=y.dtype)), (r, k, y[0].item(), expected)
# the check of the grouped lead's message above ran on some agent
timed_out_fused = bf.allgather(torch.tensor([float(fused)]), name="fused.flags")
assert timed_out_fused.sum() > 0, "no timed-out burst was fused on any agent: the fused case went untested"
print(f"rank {r}: fused ops {stats['fused_ops']}", flush=True)
print(f"AGENT OK {r}", flush=True)
bf.shutdown()

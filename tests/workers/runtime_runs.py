"""init() after shutdown() in one process (4 agents, 6 runs): a run's messages
never reach a later run, and the communicators of ended runs are freed (drained
first) at the init() after next, not kept for good (MPICH ran out after ~1000 runs). In each run, after a neighbor_allreduce of every agent, rank
1 makes another call of that name that it refuses (its tensor is inside a torch.func
transform) while the others are shutting down: it tells its out-neighbors, whose
runs have ended (they no longer receive). The next run's call of that name must
average that run's inputs (numpy reference) and nothing may be left untaken
(mpi_helpers checks the warning). Before, the next run's communicator got the freed
one's context id from MPICH, and the late notice reached it: that call was refused
with rank 1's old error. (Freed undrained at the init() after next, the same.)"""
import time

import numpy as np
import torch

import bluefog_lite as bf
import topology
from bluefog_lite import _mpi

for run in range(6):
    bf.init()
    assert len(_mpi._retired) <= 2, f"run {run}: {len(_mpi._retired)} communicators kept (the last run's two)"
    rank, size = bf.rank(), bf.size()
    W = topology.mixing_matrix(bf.load_topology())
    got = bf.neighbor_allreduce(torch.full((3,), rank + 10.0 * run, dtype=torch.float64), name="x")
    want = sum(W[k, rank] * (k + 10.0 * run) for k in range(size))
    np.testing.assert_allclose(got.numpy(), np.full(3, want), rtol=1e-12, err_msg=f"run {run}")
    if rank == 1:
        time.sleep(0.3)     # (the others are in shutdown meanwhile)
        try:
            torch.func.grad(lambda t: bf.neighbor_allreduce(t, name="x").sum())(torch.ones(3, dtype=torch.float64))
            raise AssertionError("an operation took a tensor of a torch.func transform")
        except TypeError as e:
            assert "inside a torch.func transform" in str(e), e
    bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

"""Rank 1 joins a neighbor_allreduce late: the others warn (naming the op and rank 1);
with BLUEFOG_OP_TIMEOUT_S the stall becomes an exception on every waiting agent."""
import sys
import time

import torch

import bluefog_lite as bf
import topology as topo

bf.init(topology_fn=topo.FullyConnectedGraph)
rank, mode = bf.rank(), sys.argv[1]
if mode == "warn":
    if rank == 1:
        time.sleep(3.0)
    y = bf.neighbor_allreduce(torch.ones(3) * rank, name="late.op")
    assert torch.allclose(y, torch.full((3,), (bf.size() - 1) / 2))
else:  # fatal: rank 1 never joins; everybody else must get a TimeoutError naming rank 1
    if rank != 1:
        try:
            bf.neighbor_allreduce(torch.ones(3), name="never.joined")
            raise AssertionError("expected a timeout")
        except TimeoutError as e:
            assert "never.joined" in str(e) and "[1]" in str(e), str(e)
    else:
        time.sleep(3.0)   # the others time out after ~2 s, then all meet in the barrier
    bf.barrier()   # everyone, rank 1 included, is still healthy afterwards
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

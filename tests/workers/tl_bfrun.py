"""Started by bfrun --timeline-filename: a few named operations, nothing else."""
import torch

import bluefog_lite as bf

bf.init()
x = torch.ones(16)
for _ in range(3):
    bf.neighbor_allreduce(x, name="x")
bf.allreduce(x, name="y")
bf.shutdown()
print(f"AGENT OK {bf._runtime._state.rank}", flush=True)

"""Rank 0 ends its program with a nonblocking neighbor_allreduce 'a' in flight that
rank 1 never joins: rank 1 waits in allreduce 'b', which rank 0 never starts. Rank 0's
shutdown must not wait for 'a' (its stall warning time) before it says it is leaving:
rank 1's wait names it and ends the job within seconds."""
import os
import time

import torch

import bluefog_lite as bf

bf.init()
x = torch.ones(3)
if bf.rank() == 0:
    bf.neighbor_allreduce_nonblocking(x, name="a")
    os.write(1, f"rank 0 leaves at {time.monotonic()}\n".encode())    # (one clock for a host's processes)
else:
    bf.allreduce(x, name="b")

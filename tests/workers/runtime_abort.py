"""An unhandled exception on rank 2 must end the whole job (the others are blocked)."""
import time

import torch

import bluefog_lite as bf

bf.init()
if bf.rank() == 2:
    print(f"RAISING AT {time.monotonic()}", flush=True)     # (one clock for every process of a host)
    raise RuntimeError("deliberate failure on rank 2")
bf.allreduce(torch.ones(2), name="blocked.forever")
print("UNREACHABLE", flush=True)

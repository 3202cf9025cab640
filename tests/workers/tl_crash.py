"""Two agents record continuously; rank 1 SIGKILLs itself mid-run (argv[1] seconds in)."""
import os
import signal
import sys
import time

import torch

import bluefog_lite as bf

bf.init()
deadline = time.monotonic() + float(sys.argv[1])
x = torch.ones(1024)
i = 0
while True:
    with bf.timeline_context("loop", "ITERATION"):
        bf.timeline_start_activity("loop", "INNER")
        bf.neighbor_allreduce(x, name="x")
        bf.timeline_end_activity("loop")
    i += 1
    if bf.rank() == 1 and time.monotonic() > deadline:
        print(f"rank 1 killing itself after {i} iterations", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

"""Agents that average in a loop until one of them fails (tests/test_reliability.py).

argv[1] says how the job is hit once every agent has run a while:
  raise   rank 2 raises an exception nobody catches
  kill    rank 1 kills itself with SIGKILL
  exit N  rank 2 calls sys.exit(N) while the others keep averaging with it
  loop    nobody fails: the test interrupts bfrun (Ctrl-C)
Every agent prints ``RUNNING <rank> <pid>`` once it has run a few iterations.
With REL_DIE_WINDOW=1 a window exists too (shutdown then frees it: a collective).
"""
import os
import signal
import sys
import time

import torch

import bluefog_lite as bf

mode = sys.argv[1]
bf.init()
rank = bf.rank()
if os.environ.get("REL_DIE_WINDOW") == "1":
    bf.win_create(torch.zeros(4), "w")
x = torch.full((256,), float(rank))
started = None
i = 0
while True:
    with bf.timeline_context("loop", "ITERATION"):
        x = bf.neighbor_allreduce(x, name="x")
    i += 1
    if i == 20:
        os.write(1, f"RUNNING {rank} {os.getpid()}\n".encode())
        started = time.monotonic()
    if started is None or time.monotonic() - started < 1.0:
        continue
    if mode == "raise" and rank == 2:
        raise RuntimeError(f"deliberate failure on rank 2 after {i} iterations")
    if mode == "kill" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "exit" and rank == 2:
        os.write(1, f"rank 2 calls sys.exit({sys.argv[2]}) after {i} iterations at {time.monotonic()}\n".encode())
        sys.exit(int(sys.argv[2]))

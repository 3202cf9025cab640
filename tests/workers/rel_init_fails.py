"""A program that does not catch errors from init() (tests/test_reliability.py):
with a bad BLUEFOG_TIMELINE prefix init raises on every agent and the job ends
there; no agent gets past init."""
import os
import time

import torch

import bluefog_lite as bf

os.write(1, f"INIT AT {time.monotonic()}\n".encode())     # imports done: from here the job must end soon
bf.init()
os.write(1, f"PAST INIT {bf.rank()}\n".encode())
bf.allreduce(torch.ones(2), name="after.init")
bf.shutdown()

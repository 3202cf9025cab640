"""A `while not bf.poll(h): pass` loop lets the communication thread run: poll gives
the interpreter away when the operation is not done. With a long switch interval
(0.5 s) a loop that kept it would hand the interpreter over only every 0.5 s, so
each operation (several hand-overs) would take seconds; the results are checked too."""
import sys
import time

import numpy as np
import torch

import bluefog_lite as bf

bf.init()
r, n = bf.rank(), bf.size()
sys.setswitchinterval(0.5)
t0 = time.monotonic()
for i in range(20):
    h = bf.neighbor_allreduce_nonblocking(torch.full((1000,), float(r + i)), name="polled")
    while not bf.poll(h):
        pass
    got = bf.synchronize(h)
    np.testing.assert_allclose(got.numpy(), np.full(1000, np.mean([j + i for j in range(n)])))
took = time.monotonic() - t0
assert took < 4.0, f"rank {r}: 20 polled operations took {took:.1f} s: the poll loop starves the thread"
sys.setswitchinterval(0.005)
bf.shutdown()
sys.stdout.write(f"AGENT OK {r}\n")

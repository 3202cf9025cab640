"""Finite values near a dtype's largest stay finite where the exact average is finite:
a small blocking neighbor_allreduce on the quick path (it summed before scaling:
2e38 + 2e38 overflowed float32), and a float16 hierarchical_neighbor_allreduce
(machines exchanged float16 machine *sums*: 2 x 40000 overflowed float16).
Run with BLUEFOG_RANKS_PER_MACHINE=2."""
import sys

import numpy as np
import torch

import bluefog_lite as bf
from bluefog_lite._runtime import state

bf.init()
r = bf.rank()
stats = state().engine.stream.stats
quick_before = stats["quick"]
for i in range(400):       # (a call whose neighbors are not in within its yield window goes the usual way)
    got = bf.neighbor_allreduce(torch.full((4,), 2e38), name="big")
    np.testing.assert_allclose(got.numpy(), np.full(4, 2e38, np.float32), rtol=1e-6)
    seen = torch.tensor([float(stats["quick"] > quick_before)])
    if i >= 19 and bf.allreduce(seen, average=False, name="quick.seen").item() == bf.size():     # on every agent
        break
assert stats["quick"] > quick_before, "no call took the quick path"
for x in (torch.tensor([40000.0, 1.0], dtype=torch.float16), torch.tensor([60000.0, -0.5], dtype=torch.float16)):
    got = bf.hierarchical_neighbor_allreduce(x, name="h16")
    assert torch.equal(got, x), (r, x, got)
sys.stdout.write(f"AGENT OK {r}\n")
bf.shutdown()

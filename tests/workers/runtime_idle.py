"""An idle agent's communication thread sleeps: with nothing in flight and every
peer on this host (each can ring it), it wakes about every idle_poke_s (50 ms),
not every 2 ms progress poke. Then a nonblocking and a blocking operation
(including a large tensor, whose descriptor rings an idle agent) still complete
with the right values."""
import time

import numpy as np
import torch

import bluefog_lite as bf
import topology
from _reference import uniform_mixing
from bluefog_lite._runtime import state

bf.init(topology_fn=topology.ExponentialTwoGraph)
n, r = bf.size(), bf.rank()
eng = state().engine
assert eng.doorbell.covers_all, "test needs every agent on one host with a bound bell"
bf.neighbor_allreduce(torch.ones(4), name="warm")
bf.barrier()
time.sleep(0.2)                          # let every agent settle into its idle sleep
before, t0 = eng.wakeups, time.monotonic()
time.sleep(1.0)
woke, idle_s = eng.wakeups - before, time.monotonic() - t0
# 50 ms -> ~20 per second; the 2 ms poke gives ~500
assert woke <= 60 * idle_s, f"rank {r}: the idle thread woke {woke} times in {idle_s:.2f} s"

mix = uniform_mixing(topology.ExponentialTwoGraph(n))     # new x = mix @ x
x = np.random.default_rng(3).standard_normal((n, 1 << 17)).astype(np.float32)   # 512 KB: own message
if r % 2:
    time.sleep(0.3)                      # odd agents start late: even ones' data arrives while they idle
h = bf.neighbor_allreduce_nonblocking(torch.from_numpy(x[r].copy()), name="big")
got = bf.synchronize(h)
assert np.allclose(got.numpy(), (mix @ x.astype(np.float64))[r], rtol=1e-5, atol=1e-5), f"rank {r}: big op wrong"
small = bf.neighbor_allreduce(torch.full((3,), float(r)), name="small")
assert np.allclose(small.numpy(), (mix @ np.arange(n, dtype=np.float64))[r]), f"rank {r}: small op wrong"
bf.barrier()
print(f"AGENT OK {r} (idle wake-ups {woke} in {idle_s:.2f} s)", flush=True)
bf.shutdown()

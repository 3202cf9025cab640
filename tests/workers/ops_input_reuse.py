"""A caller may change its input as soon as an operation returns: neighbors must still
get the value it had at the call. One agent starts each round late, so the other
agent's data has already arrived when it calls (its op finishes at once)."""
import time

import torch

import bluefog_lite as bf

bf.init()
r, n = bf.rank(), bf.size()
ins = bf.in_neighbor_ranks()
self_w = 1.0 / (len(ins) + 1)
value = lambda rank: float(10 * rank + 1)  # noqa: E731
expected = self_w * (value(r) + sum(value(j) for j in ins))
wrong = 0
for rnd in range(150):
    x = torch.full((16,), value(r))
    bf.barrier()
    if r == rnd % n:
        time.sleep(0.002)
    if rnd % 2:
        y = bf.neighbor_allreduce(x, name="x")
    else:
        y = bf.synchronize(bf.neighbor_allreduce_nonblocking(x, name="x"))
    x.fill_(-1000.0)          # the caller reuses its input right away
    wrong += int(not torch.allclose(y, torch.full((16,), expected)))
assert wrong == 0, f"rank {r}: {wrong} of 150 rounds averaged a changed input"
print(f"AGENT OK {r}", flush=True)
bf.shutdown()

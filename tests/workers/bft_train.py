"""Four agents train a small MLP over a ring with the AWC optimizer wrapper (which
installs the FORWARD/BACKWARD hooks itself) and end every step with a blocking
neighbor_allreduce named "sync". Rank 3 sleeps 50 ms before each sync: it is
the known straggler. The test sets BLUEFOG_TIMELINE and reads the files."""
import sys
import time

import torch

import bluefog_lite as bf
import topology as topo

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
SLOW_RANK, SLEEP_S = 3, 0.05

bf.init(topology_fn=topo.RingGraph)
r = bf.rank()
torch.manual_seed(r)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                            torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model)
for step in range(STEPS):
    opt.zero_grad()
    loss = model(torch.randn(64, 16)).pow(2).mean()
    loss.backward()
    opt.step()
    if r == SLOW_RANK:
        time.sleep(SLEEP_S)
    bf.neighbor_allreduce(loss.detach().reshape(1), name="sync")
bf.shutdown()
print(f"AGENT OK {r}", flush=True)

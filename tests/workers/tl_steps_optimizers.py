"""The step window counts the steps of every optimizer: a plain torch.optim optimizer
(no wrapper) and a wrapper (whose own step() steps the wrapped optimizer: counted once).
Without any optimizer the window never opens, and shutdown says so.

argv[1]: plain | wrapped | none. Steps k = 0, 1, ...: one neighbor_allreduce named
step<k>, then the optimizer's step."""
import os
import sys
import warnings

import torch

import bluefog_lite as bf
from bluefog_lite.timeline import _recorder

mode = sys.argv[1]
bf.init()
start = int(os.environ["BLUEFOG_TIMELINE_START_STEP"])
end = int(os.environ["BLUEFOG_TIMELINE_END_STEP"])
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
if mode == "wrapped":
    opt = bf.DistributedAdaptWithCombineOptimizer(opt, model)
x = torch.ones(8)
for k in range(end + 3):
    assert (_recorder.current is not None) == (start <= k <= end) or mode == "none", (k, mode)
    bf.neighbor_allreduce(x, name=f"step{k}")
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    if mode != "none":
        opt.step()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    bf.shutdown()
for w in caught:
    print(f"WARNING {w.category.__name__}: {w.message}", flush=True)
print(f"AGENT OK {bf._runtime._state.rank}", flush=True)

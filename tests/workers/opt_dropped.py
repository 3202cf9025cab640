"""A wrapper and its model that the program drops are freed (tests/test_optimizers.py).

Ten wrappers of each kind train a model of 1 MB for two steps, each inside a
function; afterwards none of them and none of their models may be alive. ATC's and gradient allreduce's gradient hooks (kept by autograd, where
Python's garbage collector does not look) held their wrapper, and so its model,
gradients and optimizer state, for good."""
import gc
import weakref

import torch

import bluefog_lite as bf

bf.init()
rank = bf.rank()


def trained(make):
    model = torch.nn.Linear(512, 512)
    opt = make(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), model)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 512)).square().mean().backward()
        opt.step()
    if isinstance(opt, bf.DistributedWinPutOptimizer):
        opt.free_windows()
    return weakref.ref(opt), weakref.ref(model)


WRAPPERS = {
    "atc": bf.DistributedAdaptThenCombineOptimizer,
    "gar": bf.DistributedGradientAllreduceOptimizer,
    "awc": bf.DistributedAdaptWithCombineOptimizer,
    "winput": bf.DistributedWinPutOptimizer,
}
for kind, make in WRAPPERS.items():
    refs = [trained(make) for _ in range(10)]
    gc.collect()
    alive = [(i, what) for i, pair in enumerate(refs) for what, r in zip(("wrapper", "model"), pair) if r() is not None]
    assert not alive, f"{kind}: dropped ones still alive: {alive}"
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

"""A wrapper and its model that the program drops are freed; a wrapper dropped
while its model is kept lives as long as the model (tests/test_optimizers.py).

Ten wrappers of each kind train a model of 1 MB for two steps, each inside a
function; afterwards none of them and none of their models may be alive. ATC's and
gradient allreduce's gradient hooks (kept by autograd, where Python's garbage
collector does not look) held their wrapper, and so its model, gradients and
optimizer state, for good."""
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


def wrapped(make, model):
    opt = make(torch.optim.SGD(model.parameters(), lr=0.01), model)
    model(torch.randn(8, 512)).square().mean().backward()
    opt.step()
    return weakref.ref(opt)


# A wrapper the program drops while it keeps the model lives as long as the model (its
# hooks stay on it until remove_hooks()), on every agent alike, whenever the garbage
# collector runs: a second wrapper is refused everywhere, and the first one's hooks go
# on (freed by the collector at its own time on each agent, gradient allreduce's went
# on communicating on some agents and not on others).
for kind, make in WRAPPERS.items():
    if kind == "winput":
        continue        # (its windows: freed by free_windows(), which a dropped one cannot be asked to)
    model = torch.nn.Linear(512, 512)
    first = wrapped(make, model)
    if rank == 0:
        gc.collect()
    assert first() is not None, f"{kind}: a wrapper whose model is alive was freed"
    if kind == "gar":
        torch.jit.script(model)     # (no module hook holds it: TorchScript refuses models with those)
    try:
        wrapped(make, model)
    except ValueError as exc:
        assert "the model already has a" in str(exc), exc
    else:
        raise AssertionError(f"{kind}: a second wrapper on the model was not refused")
    first().remove_hooks()
    gc.collect()
    assert first() is None, f"{kind}: a wrapper whose hooks were removed and that nothing holds is alive"
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

"""Calls on a wrapper between its steps (4 agents):

1. synchronize() right after step(), on rank 0 alone (as before saving a checkpoint;
   on every agent for the gradient-allreduce wrapper, which averages again), changes nothing: for every wrapper the parameters stay as they are at that call and
   (but for WinPut, whose combine takes what has landed) the run ends bitwise where the
   same run without those calls ends. (It began a round of its own: ATC stepped again with the last gradient, AWC averaged once more, and
   rank 0 went a round out of step with the others.)
2. WinPut with src_weights set and self_weight not raises a ValueError naming both on
   every agent, before anything is sent (the default weights were used, silently);
   with both unset again the next step works.
3. load_state_dict whose wrapper counters are refused (forward counts of another
   number of models) leaves the wrapped optimizer as it was (its state was loaded first)."""
import torch

import bluefog_lite as bf
from _mlp import data, make

bf.init()
rank, size = bf.rank(), bf.size()
LR, STEPS = 0.1, 3
WRAPPERS = {"awc": bf.DistributedAdaptWithCombineOptimizer, "atc": bf.DistributedAdaptThenCombineOptimizer,
            "gar": bf.DistributedGradientAllreduceOptimizer, "winput": bf.DistributedWinPutOptimizer}


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(kind, extra_sync):
    model = make()
    prefix = {"window_prefix" if kind == "winput" else "name_prefix": f"{kind}{extra_sync}."}
    opt = WRAPPERS[kind](torch.optim.SGD(model.parameters(), lr=LR), model, **prefix)
    for s in range(STEPS):
        opt.zero_grad()
        model(data(rank, s)).pow(2).mean().backward()
        opt.step()
        # (the gradient-allreduce wrapper averages again, as in Bluefog: every agent calls it)
        if extra_sync and (rank == 0 or kind == "gar"):
            before = flat(model)
            opt.synchronize()
            assert torch.equal(flat(model), before), f"{kind}: synchronize() after step() changed the model"
    bf.barrier()
    opt.remove_hooks()
    return flat(model)


# 1.
for kind in WRAPPERS:
    with_calls, without = train(kind, True), train(kind, False)
    # (WinPut combines what has landed so far: two runs need not be equal)
    assert kind == "winput" or torch.equal(with_calls, without), f"rank {rank}: {kind} went out of step"

# gradient allreduce with gradients set by hand (no hook sees them): synchronize() after
# step() averages them every time, as in Bluefog
model = torch.nn.Linear(2, 1, bias=False)
with torch.no_grad():
    model.weight.zero_()
opt = bf.DistributedGradientAllreduceOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model, name_prefix="hand.")
mean = (size + 1) / 2
for it in range(3):
    model.weight.grad = torch.full_like(model.weight, float(rank + 1))
    opt.synchronize()
    assert torch.equal(model.weight.grad, torch.full_like(model.weight, mean)), (it, model.weight.grad)
    with opt.skip_synchronize():
        opt.step()
    assert torch.equal(model.weight.detach(), torch.full_like(model.weight, -mean * (it + 1))), it
opt.remove_hooks()

# 2.
model = make()
opt = bf.DistributedWinPutOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model, window_prefix="knobs.")
opt.src_weights = {s: 0.0 for s in bf.in_neighbor_ranks()}
opt.zero_grad()
model(data(rank, 0)).pow(2).mean().backward()
try:
    opt.step()
    raise AssertionError("WinPut used src_weights without self_weight")
except ValueError as exc:
    assert "self_weight and src_weights must be set together" in str(exc), exc
opt.src_weights = None
opt.step()
bf.barrier()
opt.remove_hooks()

# 3.
model = make()
opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model, name_prefix="load")
state = opt.state_dict()
state["param_groups"][0]["lr"] = 0.5
state["bluefog_lite"]["forwards"] = [0, 0, 0]      # two models' counts and the step's
try:
    opt.load_state_dict(state)
    raise AssertionError("forward counts of two models were loaded into a wrapper of one")
except ValueError as exc:
    assert "forward counts" in str(exc), exc
assert opt.param_groups[0]["lr"] == LR, opt.param_groups[0]["lr"]
opt.remove_hooks()
print(f"AGENT OK {rank}", flush=True)
bf.shutdown()

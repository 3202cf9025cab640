"""An optimizer wrapper whose step failed (bad weights set for one step, the error
caught) works again from the next step: it behaves exactly as a fresh wrapper on the
same parameters (nothing left in flight, no name in use, no half-finished round).
Bad knobs: a self_weight that is no number; dst_weights without src_weights (dynamic,
the topology check off), whose source ranks cannot be read: before, the op refused
the parameters' names on every agent for the rest of the run; dst_weights naming the
agent itself: before, the next step waited for ever (each agent dropped its sender's
next data for the failed step, for which nothing had been sent)."""
import copy
import sys

import torch

import bluefog_lite as bf

bf.init()
rank = bf.rank()
kind = sys.argv[1]
torch.manual_seed(rank)
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)).double()
data = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)


def wrap(net):
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)
    if kind == "awc":
        return bf.DistributedAdaptWithCombineOptimizer(opt, net)
    return bf.DistributedAdaptThenCombineOptimizer(opt, net)


def step(net, dopt):
    dopt.zero_grad()
    torch.nn.functional.mse_loss(net(data[0]), data[1]).backward()
    dopt.step()


n = bf.size()
BAD = [("self_weight", dict(self_weight="a", src_weights={})),
       ("dst_weights alone", dict(self_weight=0.5, dst_weights={(rank + 1) % n: 1.0})),
       ("dst_weights naming itself", dict(self_weight=0.5, src_weights={(rank - 1) % n: 0.5}, dst_weights=[rank]))]
start = copy.deepcopy(model.state_dict())
for what, knobs in BAD:
    model.load_state_dict(start)
    twin = copy.deepcopy(model)
    dopt = wrap(model)
    before = copy.deepcopy(model.state_dict())
    for k, v in knobs.items():      # bad for one step
        setattr(dopt, k, v)
    failed = None
    try:
        step(model, dopt)
    except (TypeError, ValueError) as exc:
        failed = exc
    dopt.self_weight = dopt.src_weights = dopt.dst_weights = None
    assert failed is not None, f"{what}: the bad step did not fail"
    if kind == "awc":     # (ATC takes its local steps before it communicates)
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), f"rank {rank}: {what}: {k} changed by the failed step"
    model.load_state_dict(before)
    dopt.optimizer.state.clear()          # (ATC: its local steps' momentum)
    for _ in range(3):
        step(model, dopt)
    dopt.remove_hooks()
    fresh = wrap(twin)
    for _ in range(3):
        step(twin, fresh)
    fresh.remove_hooks()
    for (k, v), (_, w) in zip(model.state_dict().items(), twin.state_dict().items()):
        assert torch.allclose(v, w, rtol=1e-12, atol=1e-14), f"rank {rank}: {what}: {k} differs from a fresh wrapper's"
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

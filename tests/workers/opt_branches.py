"""Optimizer wrappers whose communication follows hooks, on a model whose
forward takes a data-dependent branch: each agent uses branch a or b, differently
from its neighbors and from step to step, and no agent ever uses branch d.

Reference: every agent simulates all agents with plain torch (no communication),
the wrapper's update written out by hand:
- gar: the gradient averaged over agents, zeros where an agent did not use a
  parameter; a parameter no agent used keeps grad None (SGD skips it: its weight
  decay would move it), but one used by one agent whose gradient is exactly zero
  (branch e, behind a dead ReLU) gets the zero average on every agent, and weight
  decay (before, the agents without it dropped it and only that agent decayed);
- awc: m = combine_r(x), x_r <- m - lr * (grad_r(x_r) + wd * m);
- atc: x_r <- combine_r(x_k - lr * (grad_k(x_k) + wd * x_k)),
where combine_r is the mean (allreduce) or agent r's column of the mixing matrix
(neighbor_allreduce on the default topology).
Odd steps synchronize() first and step() inside skip_synchronize() (as for gradient
clipping). Before, the hooks of the branches launched the allreduces in different orders on
different agents, and every agent raised "different order"."""
import copy
import sys

import torch

import bluefog_lite as bf
import topology as topo

bf.init()
rank, size = bf.rank(), bf.size()
wrapper, comm = sys.argv[1], sys.argv[2]     # comm: "ar" (allreduce) or "nar" (neighbor_allreduce)
# "ar_set": allreduce set after creation (Bluefog's communication_type setter); "dyn":
# neighbor_allreduce with a one-peer ring each step (the shift 1, 2, 1, ...: the wrapper's
# dst_weights/src_weights) and enable_topo_check on, whose check is a collective matched
# by order (before, the branches' hooks started it in different orders: "different order")
comm, set_later = ("ar", True) if comm == "ar_set" else (comm, False)
# combine(values, r, t): what agent r gets from the agents' values at step t
W = topo.mixing_matrix(bf.load_topology()) if comm == "nar" else None


def shift(t):
    return 1 + t % 2


def combine(values, r, t):
    if comm == "dyn":
        return 0.5 * values[r] + 0.5 * values[(r - shift(t)) % size]
    if W is None:
        return sum(values) / size
    return sum(W[k, r] * values[k] for k in range(size))
LR, WD, STEPS = 0.1, 0.05, 6


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 4), torch.nn.Linear(3, 4)
        self.d = torch.nn.Linear(3, 4)          # never used
        self.e = torch.nn.Linear(3, 4)          # used by one agent per step, behind a dead ReLU
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x, branch, dead=False):
        out = self.head(torch.tanh(self.a(x) if branch == "a" else self.b(x)))
        if dead:    # e's gradient: exactly zero
            out = out + torch.relu(self.e(x)).sum(-1, keepdim=True)
        return out


def branch(r, t):
    return "a" if (r * 7 + t * 3) % size < size // 2 else "b"


def batch(r, t):
    g = torch.Generator().manual_seed(100 * t + r)
    return torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(5, 1, generator=g,
                                                                           dtype=torch.float64)


def loss_of(model, r, t):
    x, y = batch(r, t)
    return torch.nn.functional.mse_loss(model(x, branch(r, t), dead=(r + t) % size == 0), y)


def grads(model, r, t):
    """{name: gradient or None} of agent r's loss at step t."""
    model.zero_grad(set_to_none=True)
    loss_of(model, r, t).backward()
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


torch.manual_seed(0)
start = Branchy().double()
with torch.no_grad():
    start.e.bias.fill_(-100.0)
assert len({branch(r, t) for r in range(size) for t in range(STEPS)}) == 2

# ---- the reference: all agents simulated here ---------------------------------------------
sims = [copy.deepcopy(start) for _ in range(size)]
for t in range(STEPS):
    g = [grads(m, r, t) for r, m in enumerate(sims)]
    with torch.no_grad():
        params = [dict(m.named_parameters()) for m in sims]
        if wrapper == "gar":
            for n in params[0]:
                if all(g[r][n] is None for r in range(size)):
                    continue                        # nobody used it: SGD skips it
                avg = sum(torch.zeros_like(params[r][n]) if g[r][n] is None else g[r][n]
                          for r in range(size)) / size
                for r in range(size):
                    params[r][n].sub_(LR * (avg + WD * params[r][n]))
        else:
            def sgd(x, r, n):   # SGD's step from x on agent r's own gradient (skipped without one)
                return x if g[r][n] is None else x - LR * (g[r][n] + WD * x)
            for n in params[0]:
                if wrapper == "awc":    # combine, then step from the combined value
                    new = [sgd(combine([params[k][n] for k in range(size)], r, t), r, n) for r in range(size)]
                else:                   # step, then combine
                    stepped = [sgd(params[k][n], k, n) for k in range(size)]
                    new = [combine(stepped, r, t) for r in range(size)]
                for r in range(size):
                    params[r][n].copy_(new[r])
expected = dict(sims[rank].named_parameters())

# ---- the wrapper ---------------------------------------------------------------------------
model = copy.deepcopy(start)
sgd = torch.optim.SGD(model.parameters(), lr=LR, weight_decay=WD)
ar = bf.CommunicationType.allreduce if comm == "ar" else bf.CommunicationType.neighbor_allreduce
opt = {"gar": lambda: bf.DistributedGradientAllreduceOptimizer(sgd, model),
       "awc": lambda: bf.DistributedAdaptWithCombineOptimizer(sgd, model, communication_type=ar),
       "atc": lambda: bf.DistributedAdaptThenCombineOptimizer(sgd, model, communication_type=ar)}[wrapper]()
if set_later:
    opt.communication_type = bf.CommunicationType.neighbor_allreduce
    opt.communication_type = ar
    try:
        opt.communication_type = "allreduce"
        raise AssertionError("a communication_type that is not a bf.CommunicationType was taken")
    except TypeError as e:
        assert "must be a bf.CommunicationType, got 'allreduce'" in str(e), e
if comm == "dyn":
    opt.enable_topo_check = True
for t in range(STEPS):
    if comm == "dyn":
        opt.self_weight, opt.src_weights = 0.5, {(rank - shift(t)) % size: 0.5}
        opt.dst_weights = [(rank + shift(t)) % size]
    opt.zero_grad()
    loss_of(model, rank, t).backward()
    if t % 2:       # the pattern of gradient clipping: synchronize() must start the unused ones too
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
    else:
        opt.step()
    if wrapper == "gar":
        assert model.d.weight.grad is None, "no agent used branch d: its gradient must stay None"

for n, p in model.named_parameters():
    torch.testing.assert_close(p.detach(), expected[n].detach(), rtol=1e-10, atol=1e-12, msg=lambda m: f"{n}: {m}")
assert torch.equal(model.d.weight, start.d.weight), "branch d was never used: it must not move"
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

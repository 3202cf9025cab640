"""A layer frozen (requires_grad_(False)) after its wrapper was created is left alone
from the next pass on, as in Bluefog: AWC and ATC (neighbor_allreduce, and allreduce in
its fixed order) and WinPut neither send nor combine it. lr 0 and different parameters
on every agent: each step only mixes, so after s steps the communicated parameters are
(M^T)^s x0 (M: the mixing matrix W, or 1/n everywhere for allreduce); the first layer,
frozen after FROZEN_AT steps, keeps (M^T)^FROZEN_AT x0 while the second goes on."""
import numpy as np
import torch

import bluefog_lite as bf
import topology

bf.init()
rank, size = bf.rank(), bf.size()
W = topology.mixing_matrix(bf.load_topology())
STEPS, FROZEN_AT = 5, 2


def make(r):
    torch.manual_seed(20 + r)
    return torch.nn.Sequential(torch.nn.Linear(3, 4, dtype=torch.float64), torch.nn.Tanh(),
                               torch.nn.Linear(4, 2, dtype=torch.float64))


def step(opt, winput):
    """opt.step(); for WinPut, as a synchronous reference assumes: every put has landed
    before anyone combines, and nobody puts the next step's values before all combined."""
    if winput:
        for _, h in list(opt._handles.values()):
            bf.win_wait(h)
        opt._handles.clear()
        bf.barrier()
    opt.step()
    if winput:
        bf.barrier()


def flat(layer):
    return torch.cat([p.detach().reshape(-1) for p in layer.parameters()]).numpy()


first0 = np.stack([flat(make(r)[0]) for r in range(size)])
second0 = np.stack([flat(make(r)[2]) for r in range(size)])
neighbor, allreduce = bf.CommunicationType.neighbor_allreduce, bf.CommunicationType.allreduce
for wrapper, comm in ((bf.DistributedAdaptWithCombineOptimizer, neighbor),
                      (bf.DistributedAdaptWithCombineOptimizer, allreduce),
                      (bf.DistributedAdaptThenCombineOptimizer, neighbor),
                      (bf.DistributedAdaptThenCombineOptimizer, allreduce),
                      (bf.DistributedWinPutOptimizer, None)):
    M = np.full((size, size), 1.0 / size) if comm is allreduce else W
    model = make(rank)
    base = torch.optim.SGD(model.parameters(), lr=0.0)
    opt = wrapper(base, model) if comm is None else wrapper(base, model, comm)
    what = f"{wrapper.__name__} {comm}"
    for s in range(1, STEPS + 1):
        if s == FROZEN_AT + 1:
            model[0].requires_grad_(False)
        opt.zero_grad()
        model(torch.ones(5, 3, dtype=torch.float64)).sum().backward()
        step(opt, winput=comm is None)
        power = lambda n: np.linalg.matrix_power(M.T, n)  # noqa: E731
        np.testing.assert_allclose(flat(model[0]), (power(min(s, FROZEN_AT)) @ first0)[rank],
                                   rtol=1e-12, atol=1e-12, err_msg=f"{what}: frozen layer after step {s}")
        np.testing.assert_allclose(flat(model[2]), (power(s) @ second0)[rank],
                                   rtol=1e-12, atol=1e-12, err_msg=f"{what}: trained layer after step {s}")
    if comm is None:
        opt.free_windows()
    opt.remove_hooks()

# Frozen after the pass, before step() (every agent in the same step), while the agents
# take different branches: layer x is used by rank 0 only. The round was begun with x
# unfrozen, so every agent still communicates it in that step (rank 0 after its
# forward, the others in step()), and no agent from the next step on: no agent waits
# for another, and x keeps its value.
class Branches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(30 + rank)
        self.a, self.x, self.c = (torch.nn.Linear(2, 2, dtype=torch.float64) for _ in range(3))

    def forward(self, inp):
        h = self.a(inp)
        return self.c(self.x(h) if rank == 0 else h)


for wrapper, comm in ((bf.DistributedAdaptWithCombineOptimizer, neighbor),
                      (bf.DistributedAdaptWithCombineOptimizer, allreduce),
                      (bf.DistributedAdaptThenCombineOptimizer, neighbor),
                      (bf.DistributedAdaptThenCombineOptimizer, allreduce)):
    model = Branches()
    opt = wrapper(torch.optim.SGD(model.parameters(), lr=0.0), model, comm)
    for s in range(1, 5):
        opt.zero_grad()
        model(torch.ones(3, 2, dtype=torch.float64)).sum().backward()
        if s == 2:
            model.x.requires_grad_(False)
        opt.step()
        if s == 2:
            frozen_x = flat(model.x)
    np.testing.assert_array_equal(flat(model.x), frozen_x, err_msg=f"{wrapper.__name__} {comm}")
    opt.remove_hooks()

# A GAN's (or actor-critic's) pattern: D frozen while G's pass goes through it, unfrozen
# before D's own step. G's pass starts no communication of D, so it does not settle
# what D's round leaves out: every D step still mixes all of D.
for wrapper, comm in ((bf.DistributedAdaptWithCombineOptimizer, neighbor),
                      (bf.DistributedAdaptWithCombineOptimizer, allreduce),
                      (bf.DistributedAdaptThenCombineOptimizer, neighbor),
                      (bf.DistributedWinPutOptimizer, None)):
    M = np.full((size, size), 1.0 / size) if comm is allreduce else W
    torch.manual_seed(100 + rank)
    D, G = torch.nn.Linear(3, 1, dtype=torch.float64), torch.nn.Linear(2, 3, dtype=torch.float64)
    base = torch.optim.SGD(D.parameters(), lr=0.0)
    opt = wrapper(base, D) if comm is None else wrapper(base, D, comm)
    for it in range(3):
        with torch.no_grad():
            for p in D.parameters():
                p.add_(rank + it)       # the agents' copies differ before each D step
        before = bf.allgather(torch.from_numpy(flat(D))[None], name=f"gan.before.{it}").numpy()
        D.requires_grad_(True)
        opt.zero_grad()
        D(torch.ones(4, 3, dtype=torch.float64)).sum().backward()
        step(opt, winput=comm is None)
        np.testing.assert_allclose(flat(D), (M.T @ before)[rank], rtol=1e-12, atol=1e-12,
                                   err_msg=f"GAN pattern, {wrapper.__name__} {comm}, D step {it}")
        D.requires_grad_(False)     # G's pass through D
        D(G(torch.ones(4, 2, dtype=torch.float64))).sum().backward()
    D.requires_grad_(True)
    if comm is None:
        opt.free_windows()
    opt.remove_hooks()

# The same with num_steps_per_communication=2: G's pass through the frozen D does not
# count as a pass of D (as in Bluefog, whose counts skip frozen parameters), so D
# communicates every second D step (before, G's pass counted: every D step after the first).
for wrapper in (bf.DistributedAdaptWithCombineOptimizer, bf.DistributedWinPutOptimizer):
    torch.manual_seed(200 + rank)
    D, G = torch.nn.Linear(3, 1, dtype=torch.float64), torch.nn.Linear(2, 3, dtype=torch.float64)
    opt = wrapper(torch.optim.SGD(D.parameters(), lr=0.0), D, num_steps_per_communication=2)
    winput = wrapper is bf.DistributedWinPutOptimizer
    for it in range(1, 7):
        with torch.no_grad():
            for p in D.parameters():
                p.add_(rank + it)
        before = bf.allgather(torch.from_numpy(flat(D))[None], name=f"gan2.before.{it}").numpy()
        D.requires_grad_(True)
        opt.zero_grad()
        D(torch.ones(4, 3, dtype=torch.float64)).sum().backward()
        step(opt, winput)
        want = (W.T @ before)[rank] if it % 2 == 0 else before[rank]
        np.testing.assert_allclose(flat(D), want, rtol=1e-12, atol=1e-12,
                                   err_msg=f"GAN pattern, period 2, {wrapper.__name__}, D step {it}")
        D.requires_grad_(False)     # G's pass through D
        D(G(torch.ones(4, 2, dtype=torch.float64))).sum().backward()
    D.requires_grad_(True)
    if winput:
        opt.free_windows()
    opt.remove_hooks()

# A step whose only pass ran with the whole wrapped model frozen (the optimizer also
# holds a parameter outside it) counts no pass either: with k=2 the model communicates
# in steps 2 and 4 (before, such a step counted as "a step that saw no pass": 1 and 3)
for wrapper in (bf.DistributedAdaptWithCombineOptimizer, bf.DistributedWinPutOptimizer):
    torch.manual_seed(300 + rank)
    D = torch.nn.Linear(3, 1, dtype=torch.float64)
    extra = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))
    opt = wrapper(torch.optim.SGD(list(D.parameters()) + [extra], lr=0.0), D, num_steps_per_communication=2)
    winput = wrapper is bf.DistributedWinPutOptimizer
    for it in range(5):
        with torch.no_grad():
            for p in D.parameters():
                p.add_(rank + it)
        before = bf.allgather(torch.from_numpy(flat(D))[None], name=f"frozen.step.before.{it}").numpy()
        D.requires_grad_(it != 0)
        opt.zero_grad()
        (D(torch.ones(4, 3, dtype=torch.float64)) * extra).sum().backward()
        step(opt, winput)
        want = (W.T @ before)[rank] if it in (2, 4) else before[rank]
        np.testing.assert_allclose(flat(D), want, rtol=1e-12, atol=1e-12,
                                   err_msg=f"frozen-only step, {wrapper.__name__}, step {it}")
    D.requires_grad_(True)
    if winput:
        opt.free_windows()
    opt.remove_hooks()

# communication_type set during a step (after its pass) applies from the next step, as
# in Bluefog: this step's round stays neighbor_allreduce on every agent
model = make(rank)
opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, neighbor)
mean = np.full((size, size), 1.0 / size)
for s in range(1, 3):
    opt.zero_grad()
    model(torch.ones(5, 3, dtype=torch.float64)).sum().backward()
    if s == 1:
        opt.communication_type = allreduce
        assert opt.communication_type is allreduce
    opt.step()
    want = ((W.T if s == 1 else mean.T @ W.T) @ second0)[rank]
    np.testing.assert_allclose(flat(model[2]), want, rtol=1e-12, atol=1e-12, err_msg=f"type change, step {s}")
opt.remove_hooks()

# set between steps, after another model's pass through this one under "empty" (which
# starts nothing): the next step uses it
torch.manual_seed(7 + rank)
D, G = torch.nn.Linear(3, 1, dtype=torch.float64), torch.nn.Linear(2, 3, dtype=torch.float64)
opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(D.parameters(), lr=0.0), D,
                                              bf.CommunicationType.empty)
D(G(torch.ones(1, 2, dtype=torch.float64))).sum().backward()
opt.communication_type = allreduce
opt.zero_grad()
D(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
before = bf.allgather(torch.from_numpy(flat(D))[None], name="empty.before").numpy()
opt.step()
np.testing.assert_allclose(flat(D), before.mean(axis=0), rtol=1e-12, atol=1e-12, err_msg="set after 'empty'")
opt.remove_hooks()
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

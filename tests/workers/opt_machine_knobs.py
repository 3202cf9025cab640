"""AWC over hierarchical_neighbor_allreduce steered per step with Bluefog's knob names
(neighbor_machine_weights, send_neighbor_machines), against numpy: each step is
x <- 0.6 * (own machine's mean) + 0.4 * (previous machine's mean) - lr * grad.
Then AWC over neighbor_allreduce steered with the names of Bluefog's README dynamic
example (send_neighbors, neighbor_weights): x <- 0.5 * x + 0.5 * x[rank - 1] - lr * grad
(before, they were ignored without a word, and the wrapper used the static topology)."""
import numpy as np
import torch

import bluefog_lite as bf

bf.init()
rank, M, m = bf.rank(), bf.machine_size(), bf.machine_rank()
per = bf.local_size()
lr = 0.1


def start(r):
    return np.random.default_rng(7 + r).normal(size=5)


def grad(r):
    return np.arange(5.0) * (r + 1)


class Point(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.from_numpy(start(rank)))

    def forward(self):
        return (self.p * torch.from_numpy(grad(rank))).sum()


model = Point()
opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=lr), model,
                                              communication_type=bf.CommunicationType.hierarchical_neighbor_allreduce)
assert opt.enable_topo_check is False       # Bluefog's default for the wrappers
X = {r: start(r) for r in range(bf.size())}
for step in range(3):
    src, dst = {(m - 1) % M: 0.4}, [(m + 1) % M]
    opt.self_weight, opt.neighbor_machine_weights, opt.send_neighbor_machines = 0.6, src, dst
    assert opt.src_machine_weights == src and opt.dst_machine_weights == dst
    opt.zero_grad()
    model().backward()
    opt.step()
    mean = [np.mean([X[mm * per + l] for l in range(per)], axis=0) for mm in range(M)]
    X = {r: 0.6 * mean[r // per] + 0.4 * mean[(r // per - 1) % M] - lr * grad(r) for r in X}
    np.testing.assert_allclose(model.p.detach().numpy(), X[rank], rtol=1e-12, atol=1e-12)
opt.remove_hooks()

model = Point()
opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=lr), model)
n = bf.size()
X = {r: start(r) for r in range(n)}
for step in range(3):
    opt.send_neighbors, opt.neighbor_weights, opt.self_weight = [(rank + 1) % n], {(rank - 1) % n: 0.5}, 0.5
    assert opt.dst_weights == [(rank + 1) % n] and opt.src_weights == {(rank - 1) % n: 0.5}
    if step == 1:   # ranks computed with torch (0-d tensors), as the operations take them
        opt.dst_weights = [torch.tensor((rank + 1) % n)]
    opt.zero_grad()
    model().backward()
    opt.step()
    X = {r: 0.5 * X[r] + 0.5 * X[(r - 1) % n] - lr * grad(r) for r in X}
    np.testing.assert_allclose(model.p.detach().numpy(), X[rank], rtol=1e-12, atol=1e-12)
print(f"AGENT OK {rank}", flush=True)
bf.shutdown()

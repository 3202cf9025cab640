"""AWC and WinPut on a model with a parametrized layer (weight_norm: parameters
original0 and original1 in a ParametrizationList that runs whenever the weight is
read). With lr 0 each step only mixes: after s steps every agent's parameters are
(W^T)^s x0 (W the mixing matrix, x0 the agents' initial parameters). Reading the
weight outside a training pass on one agent (logging its norm) must not start
communication there: the others would never join it."""
import numpy as np
import torch
from torch.nn.utils import parametrizations

import bluefog_lite as bf
import topology

bf.init()
rank, size = bf.rank(), bf.size()
W = topology.mixing_matrix(bf.load_topology())


def make(r):
    torch.manual_seed(10 + r)       # different parameters on every agent
    return torch.nn.Sequential(parametrizations.weight_norm(torch.nn.Linear(3, 4, dtype=torch.float64)),
                               torch.nn.Tanh(), torch.nn.Linear(4, 2, dtype=torch.float64))


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


x0 = np.stack([flat(make(r)) for r in range(size)])
for wrapper in (bf.DistributedAdaptWithCombineOptimizer, bf.DistributedWinPutOptimizer):
    model = make(rank)
    opt = wrapper(torch.optim.SGD(model.parameters(), lr=0.0), model)
    assert {n for n, _ in model.named_parameters()} >= {"0.parametrizations.weight.original0",
                                                         "0.parametrizations.weight.original1"}
    for s in range(1, 4):
        opt.zero_grad()
        model(torch.ones(5, 3, dtype=torch.float64)).sum().backward()
        if wrapper is bf.DistributedWinPutOptimizer:
            for _, h in list(opt._handles.values()):    # every put has landed before anyone combines
                bf.win_wait(h)
            opt._handles.clear()
            bf.barrier()
        opt.step()
        if wrapper is bf.DistributedWinPutOptimizer:
            bf.barrier()            # nobody puts the next step's values before everyone combined
        want = (np.linalg.matrix_power(W.T, s) @ x0)[rank]
        np.testing.assert_allclose(flat(model), want, rtol=1e-12, atol=1e-12, err_msg=f"{wrapper.__name__} {s}")
        if rank == 0:
            norm = model[0].weight.norm()           # read in training mode, gradients enabled
            assert norm > 0 and not opt._handles, f"reading the weight started {list(opt._handles)}"
    if wrapper is bf.DistributedWinPutOptimizer:
        opt.free_windows()
    opt.remove_hooks()
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

"""step(closure) equals zero_grad + forward + backward + step() for every wrapper:
each wrapper trains a model one way, then a copy of the same start the other way,
on data that differs per agent (so communication changes the result)."""
import torch

import bluefog_lite as bf

bf.init()
rank = bf.rank()
torch.manual_seed(0)
start = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
g = torch.Generator().manual_seed(10 + rank)
X, Y = torch.randn(16, 3, generator=g, dtype=torch.float64), torch.randn(16, 1, generator=g, dtype=torch.float64)

WRAPPERS = {
    "awc": lambda o, m: bf.DistributedAdaptWithCombineOptimizer(o, m),
    "awc-allreduce": lambda o, m: bf.DistributedAdaptWithCombineOptimizer(o, m, bf.CommunicationType.allreduce),
    "atc": lambda o, m: bf.DistributedAdaptThenCombineOptimizer(o, m),
    "gar": lambda o, m: bf.DistributedGradientAllreduceOptimizer(o, m),
}


def train(make, with_closure, steps=5):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    model.load_state_dict(start.state_dict())
    opt = make(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), model)
    losses = []
    for _ in range(steps):
        def closure():
            opt.zero_grad()
            loss = (model(X) - Y).pow(2).mean()
            loss.backward()
            return loss
        if with_closure:
            with torch.no_grad():          # step() must enable grad for the closure, as torch does
                losses.append(opt.step(closure).item())
        else:
            losses.append(closure().item())
            opt.step()
    opt.remove_hooks()
    return [p.detach().clone() for p in model.parameters()], losses


for kind, make in WRAPPERS.items():
    explicit, loss_e = train(make, False)
    closed, loss_c = train(make, True)
    assert loss_c == loss_e, (kind, loss_c, loss_e)
    for a, b in zip(closed, explicit):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"{kind}: {m}")
    # communication mattered: the agents' results differ from a local-only run
    local, _ = train(lambda o, m: bf.DistributedAdaptWithCombineOptimizer(o, m, bf.CommunicationType.empty), False)
    assert any(not torch.allclose(a, b) for a, b in zip(local, explicit)), kind

bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

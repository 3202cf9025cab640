"""Optimizer wrappers on a heterogeneous linear least-squares problem at 4+ agents:
every communicating variant reaches the centralized solution; 'empty' does not."""
import copy
import sys

import numpy as np
import torch

import bluefog_lite as bf
import topology as topo

bf.init()
rank, size = bf.rank(), bf.size()
wrapper, comm, base = sys.argv[1], sys.argv[2], sys.argv[3]
with_closure = sys.argv[4:] == ["closure"]      # step(closure) instead of an explicit pass
torch.manual_seed(0)
d, m = 4, 40


def local_data(r):
    g = np.random.default_rng(r)
    A = g.normal(size=(m, d))
    b = A @ (np.arange(1.0, d + 1) + r) + 3.0 * r + g.normal(size=m)   # agents disagree
    return A, b


# centralized least-squares solution (with bias) from every agent's data
A_all = np.vstack([np.hstack([local_data(r)[0], np.ones((m, 1))]) for r in range(size)])
b_all = np.concatenate([local_data(r)[1] for r in range(size)])
x_star = np.linalg.lstsq(A_all, b_all, rcond=None)[0]

A, b = (torch.from_numpy(v) for v in local_data(rank))
model = torch.nn.Linear(d, 1).double()
with torch.no_grad():
    model.weight.zero_()
    model.bias.zero_()
lr = {"sgd": float(__import__("os").environ.get("LR", 0.05)), "adam": 0.05, "rmsprop": 0.01, "adagrad": 0.5, "adadelta": 2.0}[base]
opt = {"sgd": lambda p: torch.optim.SGD(p, lr=lr, momentum=0.5),
       "adam": lambda p: torch.optim.Adam(p, lr=lr),
       "rmsprop": lambda p: torch.optim.RMSprop(p, lr=lr),
       "adagrad": lambda p: torch.optim.Adagrad(p, lr=lr),
       "adadelta": lambda p: torch.optim.Adadelta(p, lr=lr)}[base](model.parameters())
ctype = {"nar": bf.CommunicationType.neighbor_allreduce, "dyn": bf.CommunicationType.neighbor_allreduce,
         "ar": bf.CommunicationType.allreduce, "empty": bf.CommunicationType.empty}.get(comm)
if wrapper == "awc":
    dopt = bf.DistributedAdaptWithCombineOptimizer(opt, model, communication_type=ctype)
elif wrapper == "atc":
    dopt = bf.DistributedAdaptThenCombineOptimizer(opt, model, communication_type=ctype)
elif wrapper == "gar":
    dopt = bf.DistributedGradientAllreduceOptimizer(opt, model)
elif wrapper == "winput":
    dopt = bf.DistributedWinPutOptimizer(opt, model, window_prefix="lr")
sched = torch.optim.lr_scheduler.StepLR(dopt, step_size=600, gamma=0.3)
schedule = topo.GetDynamicOnePeerSendRecvRanks(topo.ExponentialTwoGraph(size), rank)
bf.broadcast_parameters(model.state_dict(), root_rank=0)
steps = 1500
PACE = 10
for it in range(steps):
    if comm == "dyn":
        send, recv = next(schedule)
        dopt.self_weight, dopt.src_weights = 0.5, {r: 0.5 for r in recv}
        dopt.dst_weights, dopt.enable_topo_check = send, False

    def closure():
        dopt.zero_grad()
        loss = 0.5 * ((model(A).squeeze(1) - b) ** 2).mean()
        loss.backward()
        return loss
    if with_closure:
        dopt.step(closure)
    else:
        closure()
        dopt.step()
    sched.step()
    if wrapper == "winput" and (it + 1) % PACE == 0:
        # asynchronous: neighbors' values are up to PACE steps stale. The barrier keeps
        # the step rates equal: an agent that steps faster counts its local gradient
        # more often and pulls the fixed point toward its own data (free-running on an
        # oversubscribed host that bias ranged 0.02-0.27, set by the scheduler)
        bf.barrier()
if wrapper == "winput":   # asynchronous: gossip the final iterates a few rounds without steps
    for _ in range(30):
        for name, p in model.named_parameters():
            bf.win_put(p.detach(), "lr." + name)
        bf.barrier()
        for name, p in model.named_parameters():
            bf.win_update("lr." + name)
        bf.barrier()
    dopt.free_windows()
x = torch.cat([model.weight.detach().reshape(-1), model.bias.detach()]).numpy()
err = np.linalg.norm(x - x_star) / np.linalg.norm(x_star)
errs = bf.allgather(torch.tensor([err]), name="errs")
if rank == 0:
    print(f"{wrapper}/{comm}/{base}: relative distance to centralized solution "
          f"max {errs.max().item():.2e}", flush=True)
if comm == "empty":
    assert err > 0.2, f"no communication must not reach the centralized solution (err {err})"
else:
    assert err < 0.02, f"rank {rank}: relative error {err:.3e} to the centralized solution"
if wrapper == "gar":
    # gradient allreduce is centralized training on the pooled data: the same optimizer
    # and schedule in plain torch, on the mean of every agent's loss, step for step
    sim = torch.nn.Linear(d, 1).double()
    with torch.no_grad():
        sim.weight.zero_()
        sim.bias.zero_()
    sim_opt = {"sgd": lambda p: torch.optim.SGD(p, lr=lr, momentum=0.5),
               "adam": lambda p: torch.optim.Adam(p, lr=lr)}[base](sim.parameters())
    sim_sched = torch.optim.lr_scheduler.StepLR(sim_opt, step_size=600, gamma=0.3)
    data = [tuple(torch.from_numpy(v) for v in local_data(r)) for r in range(size)]
    for it in range(steps):
        sim_opt.zero_grad()
        (sum(0.5 * ((sim(Ar).squeeze(1) - br) ** 2).mean() for Ar, br in data) / size).backward()
        sim_opt.step()
        sim_sched.step()
    x_sim = torch.cat([sim.weight.detach().reshape(-1), sim.bias.detach()]).numpy()
    np.testing.assert_allclose(x, x_sim, rtol=1e-7, atol=1e-9, err_msg=f"rank {rank}: not the centralized run")
# state_dict round trip through the wrapper: what is saved comes back into the
# optimizer it wraps after its state and learning rate were overwritten
sd = copy.deepcopy(dopt.state_dict())
assert sd["state"] and sd["param_groups"][0]["lr"] == lr * 0.3 ** (steps // 600), sd["param_groups"]
for st in opt.state.values():
    for v in st.values():
        if torch.is_tensor(v):
            v.fill_(-7.0)
opt.param_groups[0]["lr"] = 123.0
dopt.load_state_dict(sd)
assert dopt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == lr * 0.3 ** (steps // 600)
back = opt.state_dict()["state"]
for i, st in sd["state"].items():
    for k, v in st.items():
        assert torch.equal(torch.as_tensor(back[i][k]), torch.as_tensor(v)), (i, k, back[i][k], v)
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

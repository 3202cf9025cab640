"""An optimizer that holds part of the model (a head fine-tuned on a backbone that still
requires gradients), accepted as in Bluefog: the wrappers train and communicate the
optimizer's parameters only, and leave the others as they are (the agents' backbones
differ here, so averaging them would show). Reference: every agent simulates all agents
with plain torch, the update written out by hand (as opt_branches.py):
- gar: the head's gradient averaged over agents, then SGD;
- awc: m = combine_r(x), x_r <- m - lr * (grad_r(x_r) + wd * m);
- atc: x_r <- combine_r(x_k - lr * (grad_k(x_k) + wd * x_k)),
combine_r: agent r's column of the default topology's mixing matrix. WinPut: only the
head gets windows, and the backbone stays. Then, per wrapper: a frozen layer that the
optimizer does not hold, unfrozen, is left alone without an error; the backbone added to
the optimizer (add_param_group) makes step() raise on every agent without stepping it
(the wrapper does not communicate it: the copies would drift); wrapped again, it trains.
Last, two parts of one model, each wrapped as its own model with its own optimizer, and
ATC's local steps of the optimizer's parameters outside the model."""
import copy

import torch

import bluefog_lite as bf
import topology as topo

bf.init()
rank, size = bf.rank(), bf.size()
W = topo.mixing_matrix(bf.load_topology())
LR, WD, STEPS = 0.1, 0.05, 4


def combine(values, r):
    return sum(W[k, r] * values[k] for k in range(size))


def batch(r, t):
    g = torch.Generator().manual_seed(100 * t + r)
    return torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(5, 1, generator=g, dtype=torch.float64)


def new_model(r):
    torch.manual_seed(r)         # every agent's layers differ
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4), torch.nn.Tanh(),
                            torch.nn.Linear(4, 1)).double()
    m[2].requires_grad_(False)   # frozen, and not in the optimizer (built from the trainable ones)
    return m


def loss_of(model, r, t):
    x, y = batch(r, t)
    return torch.nn.functional.mse_loss(model(x), y)


def head_grads(model, r, t):
    model.zero_grad(set_to_none=True)
    loss_of(model, r, t).backward()
    return {n: p.grad.clone() for n, p in model[4].named_parameters()}


def simulate(wrapper):
    """Agent rank's head after STEPS steps of wrapper, all agents simulated."""
    sims = [new_model(r) for r in range(size)]
    for t in range(STEPS):
        g = [head_grads(m, r, t) for r, m in enumerate(sims)]
        with torch.no_grad():
            heads = [dict(m[4].named_parameters()) for m in sims]
            for n in heads[0]:
                x = [heads[r][n].clone() for r in range(size)]
                if wrapper == "gar":
                    avg = sum(g[r][n] for r in range(size)) / size
                    new = [x[r] - LR * (avg + WD * x[r]) for r in range(size)]
                elif wrapper == "awc":
                    new = [combine(x, r) - LR * (g[r][n] + WD * combine(x, r)) for r in range(size)]
                else:
                    stepped = [x[k] - LR * (g[k][n] + WD * x[k]) for k in range(size)]
                    new = [combine(stepped, r) for r in range(size)]
                for r in range(size):
                    heads[r][n].copy_(new[r])
    return {n: p.detach().clone() for n, p in sims[rank][4].named_parameters()}


WRAPPERS = {"gar": bf.DistributedGradientAllreduceOptimizer, "awc": bf.DistributedAdaptWithCombineOptimizer,
            "atc": bf.DistributedAdaptThenCombineOptimizer, "winput": bf.DistributedWinPutOptimizer}
for name, wrapper in WRAPPERS.items():
    model = new_model(rank)
    start = copy.deepcopy(model)
    sgd = torch.optim.SGD(model[4].parameters(), lr=LR, weight_decay=WD)
    opt = wrapper(sgd, model)
    assert [n for n, _ in opt._named] == ["4.weight", "4.bias"], (name, opt._named)
    if name == "winput":
        assert sorted(bf.get_current_created_window_names()) == ["4.bias", "4.weight"], \
            bf.get_current_created_window_names()
    for t in range(STEPS):
        opt.zero_grad()
        loss_of(model, rank, t).backward()
        opt.step()
        if t == 1:
            model[2].requires_grad_(True)       # unfrozen, still not in the optimizer: not stepped, no error
    for i in (0, 2):
        for p, q in zip(model[i].parameters(), start[i].parameters()):
            assert torch.equal(p, q), f"{name}: layer {i}, not in the optimizer, moved"
    if name == "winput":
        assert not torch.equal(model[4].weight, start[4].weight), "winput: the head did not train"
    else:
        want = simulate(name)
        for n, p in model[4].named_parameters():
            torch.testing.assert_close(p.detach(), want[n], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name} {n}: {m}")
    # the backbone joins the optimizer: stepped by it but not communicated by the wrapper
    sgd.add_param_group({"params": model[0].parameters()})
    head = model[4].weight.detach().clone()
    opt.zero_grad()
    loss_of(model, rank, STEPS).backward()
    try:
        opt.step()
        raise AssertionError(f"{name}: step() with the backbone added to the optimizer did not raise")
    except RuntimeError as exc:
        assert "['0.weight', '0.bias'] of the model were not in the optimizer when" in str(exc), exc
    assert torch.equal(model[0].weight, start[0].weight), f"{name}: the refused backbone was stepped"
    assert not torch.equal(model[4].weight, head), f"{name}: the head was not stepped with the refusal"
    opt.remove_hooks()
    if name == "winput":
        opt.free_windows()
    again = wrapper(sgd, model)          # wrapped again: both train
    assert sorted(n for n, _ in again._named) == ["0.bias", "0.weight", "4.bias", "4.weight"], again._named
    again.zero_grad()
    loss_of(model, rank, STEPS + 1).backward()
    again.step()
    assert not torch.equal(model[0].weight, start[0].weight), f"{name}: the backbone did not train once wrapped"
    again.remove_hooks()
    if name == "winput":
        again.free_windows()

# a group's parameters replaced by as many others of the model (a phase switch): refused as well
model = new_model(rank)
start = copy.deepcopy(model)
sgd = torch.optim.SGD(model[4].parameters(), lr=LR)
opt = bf.DistributedAdaptWithCombineOptimizer(sgd, model)
opt.zero_grad()
loss_of(model, rank, 0).backward()
opt.step()                                # (the backbone has gradients: what the optimizer holds is looked at)
start = copy.deepcopy(model)
sgd.param_groups[0]["params"] = list(model[0].parameters())
opt.zero_grad()
loss_of(model, rank, 1).backward()
try:
    opt.step()
    raise AssertionError("step() with the group switched to the backbone did not raise")
except RuntimeError as exc:
    assert "['0.weight', '0.bias'] of the model were not in the optimizer when" in str(exc), exc
assert torch.equal(model[0].weight, start[0].weight), "the refused backbone was stepped"
opt.remove_hooks()

# parts of one model trained by different optimizers: each part wrapped as its own model, with
# its own name_prefix (the whole model twice is refused: one model takes one wrapper). With
# lr = 0 a step is the mixing alone: each agent gets its column of the mixing matrix applied
# to the agents' values.
model = new_model(rank)
start = [new_model(r) for r in range(size)]
awc = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.0), model[0],
                                              name_prefix="enc")
atc = bf.DistributedAdaptThenCombineOptimizer(torch.optim.Adam(model[4].parameters(), lr=0.0), model[4],
                                              name_prefix="dec")
for opt in (awc, atc):
    opt.zero_grad()
loss_of(model, rank, 0).backward()
awc.step()
atc.step()
for i in (0, 4):
    for n, p in model[i].named_parameters():
        want = combine([dict(m[i].named_parameters())[n].detach() for m in start], rank)
        torch.testing.assert_close(p.detach(), want, rtol=1e-12, atol=1e-12, msg=lambda m: f"part {i} {n}: {m}")
awc.remove_hooks()
atc.remove_hooks()

# ATC steps the optimizer's parameters outside the model itself (locally): found again when a
# group's params list is replaced by one of as many others
model = new_model(rank)
e1, e2 = (torch.zeros(3, dtype=torch.float64, requires_grad=True) for _ in range(2))
sgd = torch.optim.SGD([{"params": list(model[4].parameters())}, {"params": [e1]}], lr=1.0)
atc = bf.DistributedAdaptThenCombineOptimizer(sgd, model)
e3 = torch.zeros(3, dtype=torch.float64, requires_grad=True)
for extra in (e1, e2, e3):
    if extra is e3:
        sgd.param_groups[1]["params"][0] = e3       # (changed in place: the same list, as long)
    else:
        sgd.param_groups[1]["params"] = [extra]
    atc.zero_grad()
    loss_of(model, rank, 0).backward()
    extra.grad = torch.ones(3, dtype=torch.float64)
    atc.step()
assert all(torch.equal(e, -torch.ones(3, dtype=torch.float64)) for e in (e1, e2, e3)), (e1, e2, e3)
atc.remove_hooks()
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

"""Which steps communicate, and which hyper-parameters a step uses.

1. num_steps_per_communication=k: steps k, 2k, ... communicate (local steps in
   between, none after the last communication of a run of a multiple of k steps).
   With lr=0 the local steps change nothing, so after step s every agent's
   parameter is W^(s // k) x0 (W the Exp-2 mixing matrix), for AWC and ATC; also
   when the run is resumed after step 4 from the wrapper's state_dict() by a new
   wrapper (the state holds where the period stands).
2. After load_state_dict (what broadcast_optimizer_state does on every agent but
   the root), ATC's steps use the loaded hyper-parameters and later changes to
   param_groups (a learning-rate schedule), not the ones it was created with. Every
   wrapper follows its optimizer reloaded after wrapping (a schedule on the wrapper
   sets the rates its steps use) and steps a group added to it after wrapping.
3. A parameter unfrozen after wrapping is named by the next step (it would not be
   communicated).
4. Two wrapped models whose parameters have the same names: name_prefix; or one wrapper
   over the list of both.
5. Passes per step that do not divide k: not carried over, with a warning."""
import io
import warnings

import numpy as np
import torch

import bluefog_lite as bf
import topology

bf.init()
r, n = bf.rank(), bf.size()
W = topology.mixing_matrix(topology.ExponentialTwoGraph(n))      # W[i, j]: j's weight for i
x0 = np.array([[10.0 * j + 1, -3.0 * j] for j in range(n)])      # agent j's parameter
data = torch.randn(5, 2, dtype=torch.float64)

K, STEPS = 3, 7
for name, wrapper in (("awc", bf.DistributedAdaptWithCombineOptimizer),
                      ("atc", bf.DistributedAdaptThenCombineOptimizer)):
    model = torch.nn.Linear(2, 1, bias=False, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(x0[r]).view(1, 2))
    opt = wrapper(torch.optim.SGD(model.parameters(), lr=0.0), model, num_steps_per_communication=K)
    for s in range(1, STEPS + 1):
        opt.zero_grad()
        model(data).sum().backward()
        opt.step()
        want = (np.linalg.matrix_power(W.T, s // K) @ x0)[r]
        got = model.weight.detach().numpy().ravel()
        assert np.allclose(got, want, rtol=1e-12, atol=1e-12), \
            f"rank {r}, {name}, after step {s} of k={K}: {got} != W^{s // K} x0 = {want}"
        if s == 4:                  # a checkpoint, resumed by a new wrapper
            saved = io.BytesIO()
            torch.save(opt.state_dict(), saved)
            opt.remove_hooks()
            opt = wrapper(torch.optim.SGD(model.parameters(), lr=0.0), model, num_steps_per_communication=K)
            saved.seek(0)
            opt.load_state_dict(torch.load(saved))
    opt.remove_hooks()

# 1b. AWC counts forward passes, as Bluefog: k passes per step (gradient accumulation)
#     communicate in every step; eval-mode and no_grad forwards do not count
model = torch.nn.Linear(2, 1, bias=False, dtype=torch.float64)
with torch.no_grad():
    model.weight.copy_(torch.from_numpy(x0[r]).view(1, 2))
opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model,
                                              num_steps_per_communication=K)
for s in range(1, 4):
    opt.zero_grad()
    for _ in range(K):
        model(data).sum().backward()
    model.eval()
    model(data)
    model.train()
    with torch.no_grad():
        model(data)
    opt.step()
    want = (np.linalg.matrix_power(W.T, s) @ x0)[r]
    got = model.weight.detach().numpy().ravel()
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12), \
        f"rank {r}, AWC with {K} passes per step, k={K}: after step {s} {got} != W^{s} x0 = {want}"
opt.remove_hooks()

# 1c. ... and a model whose own forward is never called (its submodule is): no pass is
#     counted, each step counts as one, so steps k, 2k, ... still communicate
model = torch.nn.Sequential(torch.nn.Linear(2, 1, bias=False, dtype=torch.float64))
with torch.no_grad():
    model[0].weight.copy_(torch.from_numpy(x0[r]).view(1, 2))
opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model,
                                              num_steps_per_communication=K)
for s in range(1, STEPS + 1):
    opt.zero_grad()
    model[0](data).sum().backward()
    opt.step()
    want = (np.linalg.matrix_power(W.T, s // K) @ x0)[r]
    got = model[0].weight.detach().numpy().ravel()
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12), \
        f"rank {r}, AWC called through its submodule, k={K}: after step {s} {got} != W^{s // K} x0 = {want}"
opt.remove_hooks()

# 2. ATC after load_state_dict: lr set to 0 afterwards, so its local steps change nothing
model = torch.nn.Linear(2, 1, bias=False, dtype=torch.float64)
opt = bf.DistributedAdaptThenCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                                              model, communication_type=bf.CommunicationType.empty)
opt.load_state_dict(opt.state_dict())
for group in opt.param_groups:
    group["lr"] = 0.0
before = model.weight.detach().clone()
opt.zero_grad()
model(data).sum().backward()
opt.step()
assert torch.equal(model.weight.detach(), before), \
    f"rank {r}: ATC stepped with the learning rate it was created with, not the loaded/changed one"
opt.remove_hooks()

# 2b. The wrapped optimizer reloaded after wrapping (broadcast_optimizer_state on it, as a
#     script that wraps first may do): the wrapper's param_groups and state are its new
#     ones, so a schedule set on the wrapper (lr 0 from the start) is the one the steps use.
#     Then a parameter group added to the wrapped optimizer after wrapping (a learnable
#     scale outside the model) is stepped by every wrapper, as torch.optim would.
for wrapper, kwargs in ((bf.DistributedAdaptWithCombineOptimizer, {"communication_type": bf.CommunicationType.empty}),
                        (bf.DistributedAdaptThenCombineOptimizer, {"communication_type": bf.CommunicationType.empty}),
                        (bf.DistributedGradientAllreduceOptimizer, {}),
                        (bf.DistributedWinPutOptimizer, {"window_prefix": "reloaded"})):
    torch.manual_seed(5)       # the same weights everywhere: averaging changes nothing
    model = torch.nn.Linear(2, 1, bias=False, dtype=torch.float64)
    base = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    opt = wrapper(base, model, **kwargs)
    bf.broadcast_optimizer_state(base, 0)      # every agent but 0 loads new groups and state
    assert opt.param_groups is base.param_groups and opt.state is base.state, wrapper.__name__
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0)
    before = model.weight.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        model(data).sum().backward()
        opt.step()
    assert torch.equal(model.weight.detach(), before), \
        f"rank {r}, {wrapper.__name__}: stepped with lr {base.param_groups[0]['lr']} after the schedule set 0"
    scale, ref = torch.ones(1, dtype=torch.float64, requires_grad=True), torch.ones(1, dtype=torch.float64)
    base.add_param_group({"params": [scale], "lr": 0.25, "momentum": 0.0})
    for _ in range(2):
        opt.zero_grad()
        (model(data).sum() * scale).sum().backward()
        ref -= 0.25 * model(data).sum().detach()
        opt.step()
    assert torch.allclose(scale.detach(), ref, rtol=1e-12), (r, wrapper.__name__, scale, ref)
    opt.synchronize()
    opt.remove_hooks()
bf.win_free()

def step_refused(opt, net, what, untouched, *words):
    """A training step of net whose opt.step() must raise a RuntimeError containing words,
    leaving the parameters it refuses (untouched: a module) as they were (they were
    stepped first on each agent's own gradient, and wrapping again went on from copies
    that no longer agreed)."""
    before = [p.detach().clone() for p in untouched.parameters()]
    opt.zero_grad()
    net(data).sum().backward()
    try:
        opt.step()
        raise AssertionError(f"{type(opt).__name__}: {what} went unnoticed")
    except RuntimeError as exc:
        assert all(w in str(exc) for w in words), exc
    for old, p in zip(before, untouched.parameters()):
        assert torch.equal(old, p.detach()), f"{type(opt).__name__}: the refused step moved a parameter ({what})"


# 3. A parameter frozen when the wrapper was made, then unfrozen: the wrapper does not
#    communicate it, and says so at the first step that gives it a gradient
for wrapper in (bf.DistributedAdaptWithCombineOptimizer, bf.DistributedAdaptThenCombineOptimizer,
                bf.DistributedGradientAllreduceOptimizer):
    net = torch.nn.Sequential(torch.nn.Linear(2, 2, dtype=torch.float64), torch.nn.Linear(2, 1, dtype=torch.float64))
    net[0].requires_grad_(False)
    base = torch.optim.SGD(net[1].parameters(), lr=0.1)
    opt = wrapper(base, net)
    opt.zero_grad()
    net(data).sum().backward()
    opt.step()                                # fine while frozen
    net[0].requires_grad_(True)
    base.add_param_group({"params": net[0].parameters()})
    step_refused(opt, net, "a parameter unfrozen after wrapping", net[0], "['0.weight', '0.bias']",
                 "wrap the optimizer again")
    opt.remove_hooks()

# ... and where only some agents refuse (the unfrozen layer is used on rank 0 only), every agent
# still steps the communicated parameters: the gradient-allreduce wrapper's copies agree (the
# refusing agent skipped the whole step, and its copy went apart from the others')
for wrapper in (bf.DistributedGradientAllreduceOptimizer,):
    torch.manual_seed(5)          # (the same start on every agent)
    shared, side = torch.nn.Linear(2, 1, dtype=torch.float64), torch.nn.Linear(2, 1, dtype=torch.float64)
    net = torch.nn.ModuleDict({"shared": shared, "side": side})
    side.requires_grad_(False)
    base = torch.optim.SGD(shared.parameters(), lr=0.1)
    opt = wrapper(base, net)
    side.requires_grad_(True)
    base.add_param_group({"params": side.parameters()})
    before = [p.detach().clone() for p in side.parameters()]
    opt.zero_grad()
    out = shared(data) + (side(data) if r == 0 else 0)
    out.sum().backward()
    try:
        opt.step()
        assert r != 0, "rank 0 refused nothing"
    except RuntimeError as exc:
        assert r == 0 and "this step did not step them" in str(exc), (r, exc)
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, side.parameters())), "the refused layer moved"
    copies = bf.allgather(torch.cat([p.detach().reshape(1, -1) for p in shared.parameters()], 1),
                          name=f"refused.some.{wrapper.__name__}")
    assert torch.equal(copies, copies[:1].expand_as(copies)), (wrapper.__name__, copies)
    opt.remove_hooks()

# 3b. add_param_group on the wrapper adds to the wrapped optimizer (as Bluefog's subclass did;
#     it was refused); a layer added to the model after wrapping is not communicated, and
#     step() says so (the agents' copies drifted apart silently)
for wrapper in (bf.DistributedAdaptWithCombineOptimizer, bf.DistributedAdaptThenCombineOptimizer,
                bf.DistributedGradientAllreduceOptimizer, bf.DistributedWinPutOptimizer):
    net = torch.nn.Sequential(torch.nn.Linear(2, 2, dtype=torch.float64), torch.nn.Linear(2, 1, dtype=torch.float64))
    built_before = torch.nn.Linear(1, 1, dtype=torch.float64)    # (attached later: registers a module only)
    base = torch.optim.SGD(net.parameters(), lr=0.1)
    opt = wrapper(base, net)
    scale = torch.ones(1, dtype=torch.float64, requires_grad=True)
    opt.add_param_group({"params": [scale], "lr": 0.25})
    assert len(base.param_groups) == 2 and base.param_groups[1]["params"] == [scale], wrapper.__name__
    opt.zero_grad()
    out = net(data).sum()
    expected = 1.0 - 0.25 * out.item()      # (before backward: ATC steps the layers during it)
    (out * scale).sum().backward()
    opt.step()
    assert abs(scale.item() - expected) < 1e-12, (wrapper.__name__, scale.item(), expected)
    net.append(torch.nn.Linear(1, 1, dtype=torch.float64) if wrapper is bf.DistributedAdaptWithCombineOptimizer
               else built_before)
    opt.add_param_group({"params": net[2].parameters()})
    step_refused(opt, net, "a layer added after wrapping", net[2],
                 "parameters ['2.weight', '2.bias'] were added to the model")
    opt.remove_hooks()
    if wrapper is bf.DistributedWinPutOptimizer:
        opt.free_windows()

# ... but a parameter frozen after training, its old gradient left in place, is no alarm
net = torch.nn.Sequential(torch.nn.Linear(2, 2, dtype=torch.float64), torch.nn.Linear(2, 1, dtype=torch.float64))
net(data).sum().backward()                 # every parameter has a gradient now
net[0].requires_grad_(False)
opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(net[1].parameters(), lr=0.1), net)
opt.zero_grad()
net(data).sum().backward()
opt.step()
opt.remove_hooks()

# 4. Two wrapped models with parameters of the same names (a GAN's two nn.Sequential): with
#    both forwards before the steps, the second refuses and says why; with a name_prefix on
#    one of them both are averaged (lr 0: each parameter becomes W x0 after one step)
def pair(first=None, second=None):
    models = [torch.nn.Sequential(torch.nn.Linear(2, 1, bias=False, dtype=torch.float64)) for _ in range(2)]
    for k, m in enumerate(models):
        with torch.no_grad():
            m[0].weight.copy_(torch.from_numpy(x0[r] * (k + 1)).view(1, 2))
    opts = [bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), m,
                                                    name_prefix=(first, second)[k])
            for k, m in enumerate(models)]
    return models, opts


def second_refused(models, *words):
    """The second model's pass, while the first's is in flight, refuses with words."""
    models[0](data).sum().backward()
    try:
        models[1](data).sum().backward()
        raise AssertionError("two wrappers communicating under one name went unnoticed")
    except ValueError as exc:
        assert all(w in str(exc) for w in words), exc


models, opts = pair()
second_refused(models, "another DistributedAdaptWithCombineOptimizer has a parameter named '0.weight'",
               "give one of them a name_prefix")
opts[0].step()
for o in opts:
    o.synchronize()
    o.remove_hooks()
models, opts = pair("D", "D")          # the same prefix on both: the hint says so
second_refused(models, "give them different name_prefix values (both have 'D'), or call remove_hooks()")
for o in opts:
    o.remove_hooks()
models, opts = pair(None, "D")
for m in models:
    m.zero_grad()
    m(data).sum().backward()
for o in opts:
    o.step()
for k, m in enumerate(models):
    want = (W.T @ (x0 * (k + 1)))[r]
    assert np.allclose(m[0].weight.detach().numpy().ravel(), want, rtol=1e-12), (r, k, m[0].weight, want)
for o in opts:
    o.remove_hooks()

# ... and one wrapper over the list of both (Bluefog's other form of model): their names
# clash, so each model's index goes in front of its names (Bluefog refused), both are
# averaged; a second wrapper on one of them is refused while the first one's hooks are in
# place; bad lists are named
models, _ = pair()
for o in _:
    o.remove_hooks()
opt = bf.DistributedAdaptWithCombineOptimizer(
    torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.0), models)
assert [n for n, _ in opt._named] == ["0.0.weight", "1.0.weight"], opt._named
for m in models:
    m.zero_grad()
    m(data).sum().backward()
opt.step()
for k, m in enumerate(models):
    want = (W.T @ (x0 * (k + 1)))[r]
    assert np.allclose(m[0].weight.detach().numpy().ravel(), want, rtol=1e-12), (r, k, m[0].weight, want)
try:
    bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(models[1].parameters(), lr=0.0), models[1])
    raise AssertionError("a second wrapper on a listed model was accepted")
except ValueError as exc:
    assert "already has a DistributedAdaptWithCombineOptimizer" in str(exc), exc
opt.remove_hooks()
# with k=2, both models called once per step are one pass per step: steps 2, 4 communicate
models, _ = pair()
for o in _:
    o.remove_hooks()
opt = bf.DistributedAdaptWithCombineOptimizer(
    torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.0), models, num_steps_per_communication=2)
for s in range(1, 5):
    for m in models:
        m.zero_grad()
        m(data).sum().backward()
    opt.step()
    for k, m in enumerate(models):
        want = (np.linalg.matrix_power(W.T, s // 2) @ (x0 * (k + 1)))[r]
        assert np.allclose(m[0].weight.detach().numpy().ravel(), want, rtol=1e-12), (r, s, k, m[0].weight, want)
opt.remove_hooks()
for bad, exc, words in (([models[0], "D"], TypeError, "a non-empty list of them, got [Sequential, str]"),
                        ([], TypeError, "a non-empty list of them"),
                        ([models[0], models[0]], ValueError, "model lists the same module twice")):
    try:
        bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(models[0].parameters(), lr=0.0), bad)
        raise AssertionError(f"model={bad!r} accepted")
    except exc as e:
        assert words in str(e), e

# with k=3 and 2 passes per step, the passes beyond k are not carried over (as in Bluefog):
# steps 2, 4, 6 communicate, and the wrapper warns once (the docs said "the step that follows
# every k-th pass", i.e. steps 2, 3, 5, 6, and nothing warned)
model = torch.nn.Linear(2, 1, bias=False, dtype=torch.float64)
with torch.no_grad():
    model.weight.copy_(torch.from_numpy(x0[r]).view(1, 2))
opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model,
                                              num_steps_per_communication=3)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for s in range(1, 7):
        opt.zero_grad()
        (model(data).sum() + model(data).sum()).backward()
        opt.step()
        want = (np.linalg.matrix_power(W.T, s // 2) @ x0)[r]
        assert np.allclose(model.weight.detach().numpy().ravel(), want, rtol=1e-12), (r, s, model.weight, want)
said = [str(w.message) for w in caught if "not carried over" in str(w.message)]
assert len(said) == 1 and "4 training passes" in said[0] and "num_steps_per_communication=3" in said[0], said
opt.remove_hooks()

bf.barrier()
print(f"AGENT OK {r}", flush=True)
bf.shutdown()

"""synchronize() ends a round even when step() does not follow (a gradient scaler skips
step() when gradients overflow: opt.synchronize(); with opt.skip_synchronize():
scaler.step(opt)). Each wrapper trains 4 steps, step 1 skipped on the agents in SKIP
(all of them, or rank 0 alone), against a plain-torch simulation of the 4 agents with
the mixing matrix: AWC x <- W x, then the step unless skipped; ATC x <- W (x - lr g)
(its step ran in the gradient hooks); gradient allreduce: the average gradient, then
the step unless skipped; WinPut as AWC (every put landed before anyone combines).
Also: gradient allreduce's zero_grad() after backward() without step() (a skipped
batch, or a GAN's generator pass through the model) drops that pass's averages, with
agents on different branches too; remove_hooks() after a pass that raised completes
its round on every agent; with num_steps_per_communication=3 one agent's skipped
step() does not shift its communication period."""
import numpy as np
import torch

import bluefog_lite as bf
import topology
from _mlp import data, make

bf.init()
rank, size = bf.rank(), bf.size()
W = topology.mixing_matrix(bf.load_topology())      # W[j, i]: the weight of edge j -> i (j's for agent i)
STEPS, SKIPPED_STEP, LR = 4, 1, 0.1


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().numpy()


def simulate(kind, skip):
    models = [make() for _ in range(size)]
    for s in range(STEPS):
        grads = []
        for r, m in enumerate(models):
            m.zero_grad()
            m(data(r, s)).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        params = [[p.detach().clone() for p in m.parameters()] for m in models]
        stepping = [not (s == SKIPPED_STEP and r in skip) for r in range(size)]
        for r, m in enumerate(models):
            with torch.no_grad():
                for i, p in enumerate(m.parameters()):
                    if kind == "gar":
                        g = sum(grads[j][i] for j in range(size)) / size
                        p.copy_(params[r][i] - LR * g if stepping[r] else params[r][i])
                    elif kind == "atc":
                        p.copy_(sum(W[j, r] * (params[j][i] - LR * grads[j][i]) for j in range(size)))
                    else:       # awc, winput
                        mixed = sum(W[j, r] * params[j][i] for j in range(size))
                        p.copy_(mixed - LR * grads[r][i] if stepping[r] else mixed)
    return flat(models[rank])


def train(kind, skip):
    model = make()
    base = torch.optim.SGD(model.parameters(), lr=LR)
    opt = {"awc": bf.DistributedAdaptWithCombineOptimizer, "atc": bf.DistributedAdaptThenCombineOptimizer,
           "gar": bf.DistributedGradientAllreduceOptimizer, "winput": bf.DistributedWinPutOptimizer}[kind](base, model)
    for s in range(STEPS):
        opt.zero_grad()
        model(data(rank, s)).pow(2).mean().backward()
        if kind == "winput":
            for _, h in list(opt._handles.values()):    # every put has landed before anyone combines
                bf.win_wait(h)
            opt._handles.clear()
            bf.barrier()
        opt.synchronize()
        if not (s == SKIPPED_STEP and rank in skip):
            with opt.skip_synchronize():
                opt.step()
        if kind == "winput":
            bf.barrier()
    opt.remove_hooks()
    if kind == "winput":
        opt.free_windows()
    return flat(model)


for kind in ("awc", "atc", "gar", "winput"):
    for skip in (range(size), [0]):
        got, want = train(kind, set(skip)), simulate(kind, set(skip))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{kind}, step skipped on {list(skip)}")

# gradient allreduce: zero_grad() after backward() without step() drops that pass, also
# when the agents took different branches (their allreduces are completed in one order)
class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = torch.nn.Linear(5, 4), torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)

    def forward(self, x, branch):
        return self.head(torch.tanh(self.a(x) if branch == "a" else self.b(x)))


def branch(r, s):
    return "a" if (r < 2) == (s % 2 == 0) else "b"


def make_branchy():
    torch.manual_seed(2)
    return Branchy()


model = make_branchy()
opt = bf.DistributedGradientAllreduceOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model)
for s in range(3):
    opt.zero_grad()
    model(data(rank, s), branch(rank, s)).pow(2).mean().backward()
    if s == 0:
        continue                    # a skipped batch: the next zero_grad() drops its averages
    opt.step()
opt.zero_grad()
model(data(rank, 3), branch(rank, 3)).pow(2).mean().backward()
opt.zero_grad()                     # then nothing to step
opt.step()
ref = [make_branchy() for _ in range(size)]
for s in (1, 2):
    for r, m in enumerate(ref):
        m.zero_grad(set_to_none=True)
        m(data(r, s), branch(r, s)).pow(2).mean().backward()
    with torch.no_grad():
        for ps in zip(*(m.parameters() for m in ref)):
            if any(p.grad is not None for p in ps):
                g = sum(p.grad for p in ps if p.grad is not None) / size
                for p in ps:
                    p.sub_(LR * g)
np.testing.assert_allclose(flat(model), flat(ref[rank]), rtol=1e-5, atol=1e-6)
opt.remove_hooks()

# remove_hooks() after a pass that raised (ATC, allreduce in the fixed order, different
# branches): it completes that round on every agent, and a new wrapper trains
model = make_branchy()
opt = bf.DistributedAdaptThenCombineOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model,
                                              bf.CommunicationType.allreduce)
try:
    for _ in range(2):
        model(data(rank, 0), branch(rank, 0)).sum().backward()
    raise AssertionError("ATC accepted a second backward pass")
except RuntimeError as e:
    assert "second gradient before step()" in str(e), e
opt.remove_hooks()
opt = bf.DistributedAdaptThenCombineOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model,
                                              bf.CommunicationType.allreduce)
opt.zero_grad()
model(data(rank, 1), branch(rank, 1)).sum().backward()
opt.step()
rows = bf.allgather(torch.from_numpy(flat(model)).view(1, -1), name="after.remove_hooks")
assert all(torch.equal(rows[0], row) for row in rows), "the agents' averaged parameters differ"
opt.remove_hooks()

# num_steps_per_communication=3, rank 0 alone skips step() after synchronize() in step 3
# (a gradient scaler's overflow is per agent with AWC/ATC): its period goes on with the
# others'. lr 0: after step s every agent holds M^(s // 3) x0 (M: W, or 1/n everywhere for
# allreduce); the last case clears gradients with model.zero_grad() (not the wrapper's)
x0 = np.array([[10.0 * j + 1, -3.0 * j] for j in range(size)])
for wrapper, comm in ((bf.DistributedAdaptWithCombineOptimizer, bf.CommunicationType.neighbor_allreduce),
                      (bf.DistributedAdaptThenCombineOptimizer, bf.CommunicationType.neighbor_allreduce),
                      (bf.DistributedAdaptWithCombineOptimizer, bf.CommunicationType.allreduce)):
    M = W if comm is bf.CommunicationType.neighbor_allreduce else np.full((size, size), 1.0 / size)
    lin = torch.nn.Linear(2, 1, bias=False, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(x0[rank]).view(1, 2))
    opt = wrapper(torch.optim.SGD(lin.parameters(), lr=0.0), lin, comm, num_steps_per_communication=3)
    for s in range(1, 10):
        (lin.zero_grad if comm is bf.CommunicationType.allreduce else opt.zero_grad)()
        lin(torch.ones(3, 2, dtype=torch.float64)).sum().backward()
        opt.synchronize()
        if not (s == 3 and rank == 0):
            with opt.skip_synchronize():
                opt.step()
        want = (np.linalg.matrix_power(M.T, s // 3) @ x0)[rank]
        np.testing.assert_allclose(lin.weight.detach().numpy().ravel(), want, rtol=1e-12, atol=1e-12,
                                   err_msg=f"{wrapper.__name__} {comm}, after step {s}")
    opt.remove_hooks()

# gradient allreduce: clipping between backward() and step() without synchronize()
# first raced the allreduce still reading the gradient (a random mix of clipped and
# raw values): a clear error on every agent, after which the next step works; with
# synchronize() first, the clipped average is what the step uses
model = make()
opt = bf.DistributedGradientAllreduceOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model)
for s in range(2):
    opt.zero_grad()
    model(data(rank, s)).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    try:
        opt.step()
    except RuntimeError as e:
        assert "was changed after backward() started averaging it" in str(e), e
        assert "opt.synchronize() first" in str(e), e
    else:
        raise AssertionError("clipping a gradient whose allreduce was in flight went unnoticed")
opt.zero_grad()
model(data(rank, 7)).sum().backward()
raw = [bf.allreduce(p.grad, name=f"raw.{i}") for i, p in enumerate(model.parameters())]
opt.synchronize()
for p, r in zip(model.parameters(), raw):
    torch.testing.assert_close(p.grad, r, rtol=1e-6, atol=1e-7)
norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01))
with opt.skip_synchronize():
    opt.step()
assert norm > 0.01
for p, r in zip(model.parameters(), raw):
    torch.testing.assert_close(p.grad, r * (0.01 / (norm + 1e-6)), rtol=1e-6, atol=1e-7)
opt.remove_hooks()

# the same on one agent only (a clip that depends on its data), in a model with a layer
# that no agent uses: that agent raises; every agent still counts the users of the
# all-zero averages (the others did, and waited for it there) and drops that gradient;
# the next step works
class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.unused, self.used = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)

    def forward(self, x):
        return self.used(x)


heads = TwoHeads()
opt = bf.DistributedGradientAllreduceOptimizer(torch.optim.SGD(heads.parameters(), lr=0.0), heads)
for s, clipping in enumerate((1, None)):
    opt.zero_grad()
    heads(torch.ones(4, 2) * (rank + s + 1)).sum().backward()
    if rank == clipping:
        with torch.no_grad():
            heads.used.weight.grad.mul_(0.5)
    try:
        opt.step()
    except RuntimeError as e:
        assert rank == clipping and "was changed after backward() started averaging it" in str(e), e
    else:
        assert rank != clipping, "a changed gradient went unnoticed"
    assert heads.unused.weight.grad is None and heads.unused.bias.grad is None, (s, heads.unused.weight.grad)
    if clipping is None:    # (the average: 4 * the mean of (r + s + 1) per input column; in the step
        # before, the others' average may hold the clipping agent's gradient before or after its clip)
        want = 4 * (s + 1 + (size - 1) / 2)
        torch.testing.assert_close(heads.used.weight.grad, torch.full((1, 2), want), msg=lambda m: f"step {s}: {m}")
opt.remove_hooks()

# parameters joined into one tensor by the model (torch.cat: their gradients are slices
# of one buffer, with one version counter) are not taken for changed gradients, with
# num_steps_per_communication 1 and 2: the step uses the average of the summed passes
q, v = (torch.nn.Parameter(torch.ones(3, dtype=torch.float64)) for _ in range(2))
holder = torch.nn.Module()
holder.q, holder.v = q, v
for k in (1, 2):
    opt = bf.DistributedGradientAllreduceOptimizer(torch.optim.SGD([q, v], lr=0.0), holder,
                                                   num_steps_per_communication=k)
    for s in range(2):
        opt.zero_grad()
        for i in range(k):
            coef = torch.arange(6, dtype=torch.float64) * (rank + 1) + i
            (coef * torch.cat((q, v))).sum().backward()
        opt.step()
        want = sum(torch.arange(6, dtype=torch.float64) * (r + 1) + i for r in range(size) for i in range(k)) / size
        torch.testing.assert_close(torch.cat((q.grad, v.grad)), want, msg=lambda m: f"k={k}: {m}")
    opt.remove_hooks()

# gradients kept as views of one flat buffer (zero_grad(set_to_none=False)): the averages
# are written into the buffer, and each gradient stays a view of it
lin = torch.nn.Linear(3, 2, dtype=torch.float64)
flat_grads = torch.zeros(8, dtype=torch.float64)
lin.weight.grad, lin.bias.grad = flat_grads[:6].view(2, 3), flat_grads[6:]
opt = bf.DistributedGradientAllreduceOptimizer(torch.optim.SGD(lin.parameters(), lr=0.0), lin)
for s in range(2):
    opt.zero_grad(set_to_none=False)
    lin(torch.full((1, 3), float(rank + 1 + s), dtype=torch.float64)).sum().backward()
    want = bf.allreduce(flat_grads, name=f"flat.{s}")
    opt.step()
    assert lin.weight.grad.untyped_storage().data_ptr() == flat_grads.untyped_storage().data_ptr()
    torch.testing.assert_close(flat_grads, want)
opt.remove_hooks()

# one agent skips a batch the others train on (its loss was NaN: no backward()), with the
# loop clearing gradients through the model, as docs/optimizers.md says: synchronize()
# ends its round (ATC: a forward pass since step() was not seen, so synchronize() did
# nothing and the agent fell a round behind); lr = 0, so after s rounds x = (W^T)^s x0
x0 = np.array([[10.0 * j + 1, -3.0 * j] for j in range(size)])


def line():
    lin = torch.nn.Linear(2, 1, bias=False, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(x0[rank]).view(1, 2))
    return lin


for wrapper in (bf.DistributedAdaptThenCombineOptimizer, bf.DistributedAdaptWithCombineOptimizer):
    lin = line()
    opt = wrapper(torch.optim.SGD(lin.parameters(), lr=0.0), lin)
    for s in range(1, 5):
        lin.zero_grad()
        loss = lin(torch.ones(3, 2, dtype=torch.float64)).sum()
        if rank == 2 and s == 2:
            opt.synchronize()
            continue
        loss.backward()
        opt.step()
        np.testing.assert_allclose(lin.weight.detach().numpy().ravel(), (np.linalg.matrix_power(W.T, s) @ x0)[rank],
                                   rtol=1e-12, atol=1e-12, err_msg=f"{wrapper.__name__}, step {s}")
    opt.remove_hooks()

# ATC with the gradients cleared between the loss and backward(): the skipping agent still
# holds the previous step's gradients; synchronize() communicates without stepping with them
# again (it did: a step the agent never took); lr = 0.1, d loss / d w = [3, 3] on every agent
lin = line()
opt = bf.DistributedAdaptThenCombineOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), lin)
want = x0.copy()
for s in range(1, 5):
    loss = lin(torch.ones(3, 2, dtype=torch.float64)).sum()
    skipping = s == 3
    if skipping and rank == 2:
        opt.synchronize()
    else:
        opt.zero_grad()
        loss.backward()
        opt.step()
    want = W.T @ (want - 0.3 * np.array([[0.0 if skipping and r == 2 else 1.0] for r in range(size)]))
    np.testing.assert_allclose(lin.weight.detach().numpy().ravel(), want[rank], rtol=1e-12, atol=1e-12,
                               err_msg=f"ATC with stale gradients, step {s}")
opt.remove_hooks()

# WinPut, num_steps_per_communication=2, synchronize(); skip_synchronize() step() (the
# gradient-scaler pattern): synchronize() combined in every step, not in steps 2 and 4
for pattern in ("step", "synchronize"):
    lin = line()
    opt = bf.DistributedWinPutOptimizer(torch.optim.SGD(lin.parameters(), lr=0.0), lin, num_steps_per_communication=2,
                                        window_prefix=f"period.{pattern}")
    for s in range(1, 5):
        opt.zero_grad()
        lin(torch.ones(3, 2, dtype=torch.float64)).sum().backward()
        for _, h in list(opt._handles.values()):    # every put has landed before anyone combines
            bf.win_wait(h)
        opt._handles.clear()
        bf.barrier()
        if pattern == "step":
            opt.step()
        else:
            opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
        bf.barrier()
        np.testing.assert_allclose(lin.weight.detach().numpy().ravel(),
                                   (np.linalg.matrix_power(W.T, s // 2) @ x0)[rank], rtol=1e-12, atol=1e-12,
                                   err_msg=f"WinPut {pattern}, step {s}")
    opt.remove_hooks()
    opt.free_windows()

# WinPut with force_barrier: one barrier per round, also for an agent that skips step()
# with synchronize() (it made none, and every later barrier paired with another step)
lin = line()
opt = bf.DistributedWinPutOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), lin, window_prefix="forced")
opt.force_barrier = True
for s in range(4):
    opt.zero_grad()
    loss = lin(torch.ones(3, 2, dtype=torch.float64)).sum()
    if rank == 2 and s == 1:
        opt.synchronize()
        continue
    loss.backward()
    if rank == 1:       # the gradient-scaler pattern: one barrier too
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
    else:
        opt.step()
assert bf.allreduce(torch.ones(1), average=False, name="forced.after").item() == size      # (still paired)
# a closure that raises on one agent inside step(), which made the round's barrier: its
# synchronize() makes none (also right after a round it skipped with synchronize());
# one agent's synchronize() after only zero_grad() makes none
for s in range(4):
    def closure():
        opt.zero_grad()
        out = lin(torch.ones(3, 2, dtype=torch.float64)).sum()
        if rank == 3 and s in (1, 3):
            raise FloatingPointError("non-finite loss")
        out.backward()
        return out
    if rank == 3 and s == 2:    # (skipped with synchronize(); the closure of the next round raises)
        lin(torch.ones(3, 2, dtype=torch.float64))
        opt.synchronize()
        continue
    try:
        opt.step(closure)
    except FloatingPointError:
        opt.synchronize()
opt.zero_grad()
if rank == 0:
    opt.synchronize()   # (before saving a checkpoint, say)
assert bf.allreduce(torch.ones(1), average=False, name="forced.after2").item() == size
opt.remove_hooks()
opt.free_windows()

# gradient allreduce: an agent whose backward raised before any gradient (or partway)
# goes on with synchronize() and steps with the others' average: the models stay the same
torch.manual_seed(3)
model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
bf.broadcast_parameters(model.state_dict(), 0)
opt = bf.DistributedGradientAllreduceOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
for s in range(4):
    opt.zero_grad()
    out = model(torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * rank + s)))
    if rank == 2 and s in (1, 2):
        hidden = model[1](model[0](torch.ones(1, 5, dtype=torch.float64)))
        if s == 1:      # before any parameter's gradient
            out.register_hook(lambda g: (_ for _ in ()).throw(FloatingPointError("non-finite")))
            failing = out.pow(2).mean()
        else:           # partway: the last layer's gradients are in, the first layer's are not
            hidden.register_hook(lambda g: (_ for _ in ()).throw(FloatingPointError("non-finite")))
            failing = out.pow(2).mean() + model[2](hidden).sum()
        try:
            failing.backward()
        except FloatingPointError:
            opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
            continue
        raise AssertionError("the hook did not raise")
    out.pow(2).mean().backward()
    opt.step()
rows = bf.allgather(torch.cat([p.detach().reshape(1, -1) for p in model.parameters()], 1), name="gar.models")
assert all(torch.equal(rows[0], rows[r]) for r in range(size)), "the models differ after a skipped batch"
opt.remove_hooks()
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

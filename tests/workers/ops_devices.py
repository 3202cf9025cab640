"""Operations, parameter helpers and optimizer wrappers on device tensors
(tests/test_devices.py; _devices.py says which device). Every result is a tensor on
the input's device equal to the numpy reference from the mixing matrix (or, for the
optimizers, to the same training of a host copy of the model); in-place forms write
the device tensor itself; inputs are left untouched."""
import copy

import numpy as np
import torch

import bluefog_lite as bf
import topology as topo
from _devices import REAL, SLOW, SlowCopy, model_to_device, on_device, to_device, to_host
from _reference import uniform_mixing

bf.init()
rank, size = bf.rank(), bf.size()
G = topo.ExponentialGraph(size)
assert bf.set_topology(G)
M = uniform_mixing(G)       # one neighbor_allreduce: x -> M @ x


def data(r, shape=(5, 3), dtype=np.float32):
    return np.random.default_rng(100 + r).normal(size=shape).astype(dtype)


def dev(r, shape=(5, 3), dtype=np.float32):
    return to_device(torch.from_numpy(data(r, shape, dtype)))


def mixed(seed, shape=(5, 3), dtype=np.float32):
    """This agent's reference neighbor average of every agent's data(i + seed)."""
    return sum(M[rank, i] * data(i + seed, shape, dtype).astype(np.float64) for i in range(size))


def check(what, y, want, tol=1e-5):
    assert isinstance(y, torch.Tensor) and on_device(y), f"{what}: result on {y.device} ({type(y).__name__})"
    got = to_host(y).numpy()
    assert got.shape == np.shape(want), f"{what}: shape {got.shape} != {np.shape(want)}"
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=what)


# -- neighbor_allreduce: small blocking (the caller's quick path), untouched input -----------
x = dev(rank)
before = to_host(x).clone()
check("small", bf.neighbor_allreduce(x, name="nar.small"), mixed(0))
assert torch.equal(to_host(x), before), "the input changed"

# -- several in flight (fused small ones and a 4 MB one), synchronized in reverse order -------
shapes = [(1 << 20,), (7,), (3, 4), (1000,), (2, 2)]
handles = [bf.neighbor_allreduce_nonblocking(dev(rank + 10 * k, s), name=f"nar.{k}")
           for k, s in enumerate(shapes)]
for k in reversed(range(len(shapes))):
    check(f"in flight {shapes[k]}", bf.synchronize(handles[k]), mixed(10 * k, shapes[k]))

# -- the input may change as soon as the call returns: its host copy is taken -----------------
x = dev(rank, (1000,))
h = bf.neighbor_allreduce_nonblocking(x, name="nar.changed")
with torch.no_grad():
    x.add_(100.0)
check("input changed after the call", bf.synchronize(h), mixed(0, (1000,)))

# -- a nonblocking call does not wait for the GPU: it returns while the work queued before it
# still runs, and the operation sends what that work wrote --------------------------------------
if REAL:
    z = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(200_000_000)      # ~0.1 s of GPU time before z gets its values
    z.fill_(rank + 1.0)
    h = bf.neighbor_allreduce_nonblocking(z, name="nar.gpu.busy")
    busy = not torch.cuda.current_stream().query()
    check("GPU busy at the call", bf.synchronize(h), np.full(1 << 20, M[rank] @ (np.arange(size) + 1.0)))
    assert busy, "the nonblocking call waited for the GPU work queued before it"

# -- work queued on a side stream before the call is what is sent (the call copies on the
# calling thread's current stream), and the result is there for the work after it ------------
if REAL:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        z = torch.zeros(1 << 22, device="cuda")
        torch.cuda._sleep(100_000_000)      # the GPU is busy a while before z gets its values
        z.fill_(rank + 1.0)
        y = bf.allreduce(z, name="side.stream") + 0.0
    torch.cuda.current_stream().wait_stream(side)
    check("side stream", y, np.full(1 << 22, (size + 1) / 2))

# -- dynamic one-peer Exp-2, explicit weights --------------------------------------------------
gens = [topo.GetDynamicOnePeerSendRecvRanks(topo.ExponentialTwoGraph(size), r) for r in range(size)]
for step in range(3):
    send, recv = [next(g) for g in gens][rank]
    y = bf.neighbor_allreduce(dev(rank), self_weight=0.5, src_weights={r: 0.5 for r in recv},
                              dst_weights=send, name="nar.dynamic")
    check(f"dynamic step {step}", y, 0.5 * data(rank) + sum(0.5 * data(r) for r in recv))

# -- an integer device tensor scaled by its sender: the range check reads the device tensor (the
# host copy may not have landed yet: with the slow stand-in it holds garbage until then) ---------
ring = dict(self_weight=0.5, src_weights={(rank - 1) % size: 0.25}, enable_topo_check=False)
for value, weight, name in ((100, 2.0, "nar.int.wraps"), (10, 2.0, "nar.int.fits")):
    xi = to_device(torch.full((4,), value, dtype=torch.int8))
    try:
        y = bf.neighbor_allreduce(xi, dst_weights={(rank + 1) % size: weight}, name=name, **ring)
        check(name, y, np.full(4, 0.5 * value + 0.25 * weight * value))
    except ValueError as exc:
        assert value == 100 and "would wrap around" in str(exc), (name, exc)

# -- a transposed (non-contiguous) device tensor, one that requires grad, float64 -------------
xt = dev(rank, (3, 5)).t()
assert not xt.is_contiguous()
check("transposed", bf.neighbor_allreduce(xt, name="nar.t"), sum(M[rank, i] * data(i, (3, 5)).T
                                                                 for i in range(size)))
p = dev(rank).requires_grad_()
check("requires_grad", bf.neighbor_allreduce(p, name="nar.grad"), mixed(0))
check("float64", bf.neighbor_allreduce(dev(rank, dtype=np.float64), name="nar.f64"), mixed(0, dtype=np.float64),
      1e-12)

# -- collectives: out of place, in place (the device tensor itself is written) -----------------
everyone = np.mean([data(r).astype(np.float64) for r in range(size)], axis=0)
check("allreduce", bf.allreduce(dev(rank)), everyone)
ints = to_device(torch.arange(6, dtype=torch.int64) * (rank + 1))
check("allreduce int sum", bf.allreduce(ints, average=False), np.arange(6) * sum(range(1, size + 1)), 0)
x = dev(rank)
ptr = x.data_ptr()
out = bf.allreduce_(x)
check("allreduce_ (the tensor)", x, everyone)
assert out is x and out.data_ptr() == ptr, "allreduce_ must return the tensor it wrote"
x = dev(rank)
assert bf.synchronize(bf.allreduce_nonblocking_(x, is_hierarchical_local=True)) is x
check("local allreduce_ (one host: every agent)", x, everyone)
check("local allreduce", bf.allreduce(dev(rank), is_hierarchical_local=True), everyone)
check("broadcast", bf.broadcast(dev(rank), 1), data(1))
x = dev(rank)
assert bf.broadcast_(x, 2 % size) is x
check("broadcast_ (the tensor)", x, data(2 % size))
check("allgather", bf.allgather(dev(rank, (rank + 1, 2))), np.concatenate([data(r, (r + 1, 2))
                                                                           for r in range(size)]))
check("neighbor_allgather", bf.neighbor_allgather(dev(rank, (2, 3))),
      np.concatenate([data(r, (2, 3)) for r in bf.in_neighbor_ranks()]))
if size % 2 == 0:
    check("pair_gossip", bf.pair_gossip(dev(rank), rank ^ 1), 0.5 * data(rank) + 0.5 * data(rank ^ 1))
check("hierarchical (one machine: the mean)", bf.hierarchical_neighbor_allreduce(dev(rank)), everyone)

# -- windows of a device tensor: the same calls as on a host tensor give the same results -----
def window_calls(t, w):
    """Window calls on t (window w), every result and the tensor after each, on the host."""
    out = []
    ins = bf.in_neighbor_ranks()
    bf.win_create(t, w)
    bf.win_put(t, w)
    bf.barrier()
    out += [to_host(bf.win_update(w)), to_host(t)]       # default weights; t itself written
    bf.barrier()        # (between phases: a neighbor's next write must not land before this read)
    bf.win_accumulate(t, w, self_weight=0.5, dst_weights={d: 0.25 for d in bf.out_neighbor_ranks()})
    out.append(to_host(t))                                 # t scaled by 0.5
    bf.barrier()
    out.append(to_host(bf.win_update_then_collect(w)))
    with torch.no_grad():
        t.add_(1.0)          # a change win_get must expose: every agent publishes, then reads
    bf.win_get(w)
    bf.barrier()
    bf.win_get(w)
    bf.barrier()
    out += [to_host(bf.win_update(w, clone=True)), to_host(t)]     # clone leaves t alone
    bf.barrier()
    bf.win_wait(bf.win_put_nonblocking(t, w, self_weight=0.5))
    out.append(to_host(t))
    bf.barrier()
    out.append(to_host(bf.win_update(w, self_weight=0.5, neighbor_weights={r: 0.5 / len(ins) for r in ins})))
    bf.barrier()
    bf.win_free(w)
    return out


on_host = window_calls(torch.from_numpy(data(rank)), "host.w")
win_tensor = dev(rank)
on_dev = window_calls(win_tensor, "dev.w")
assert on_device(win_tensor)
check("win_update (the mixing matrix)", to_device(on_dev[0]), mixed(0))
for k, (h, d) in enumerate(zip(on_host, on_dev)):
    np.testing.assert_allclose(d.numpy(), h.numpy(), rtol=1e-6, atol=1e-6, err_msg=f"window step {k}")

# -- parameter helpers on a model on the device ---------------------------------------------
def linear(seed):
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


model = model_to_device(linear(rank))
bf.broadcast_parameters(model.state_dict(), root_rank=0)
for (name, t), root in zip(model.state_dict().items(), linear(0).state_dict().values()):
    check(f"broadcast_parameters {name}", t, root.numpy(), 0)
with torch.no_grad():
    for t in model.parameters():
        t.add_(rank)
mean_before = [to_host(t).clone() + (size - 1) / 2 - rank for t in model.parameters()]
bf.allreduce_parameters(model.state_dict())
for t, w in zip(model.parameters(), mean_before):
    check("allreduce_parameters", t, w.numpy())


# -- optimizer wrappers: a device model trains exactly as its host copy does ------------------
def mlp():
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)).double()


def mse(m, inputs, targets):
    return torch.nn.functional.mse_loss(m(inputs), targets)


def train(make_wrapper, base, steps=4, net=mlp, loss=mse):
    torch.manual_seed(7)
    host_model = net()
    dev_model = model_to_device(copy.deepcopy(host_model))
    g = np.random.default_rng(rank)
    A, b = torch.from_numpy(g.normal(size=(16, 4))), torch.from_numpy(g.normal(size=(16, 1)))
    runs = []
    for prefix, m, (inputs, targets) in (("host.", host_model, (A, b)),
                                         ("dev.", dev_model, (to_device(A), to_device(b)))):
        runs.append((m, make_wrapper(base(m.parameters()), m, prefix), inputs, targets))
    for _ in range(steps):
        for m, opt, inputs, targets in runs:
            opt.zero_grad()
            loss(m, inputs, targets).backward()
            opt.step()
    for (n, hp), dp in zip(host_model.named_parameters(), dev_model.parameters()):
        check(f"{make_wrapper.__name__} {n}", dp, hp.detach().numpy(), 1e-9)
    for _, opt, _, _ in runs:
        opt.remove_hooks()
    return runs


def awc(opt, m, prefix):
    return bf.DistributedAdaptWithCombineOptimizer(opt, m, name_prefix=prefix)


def atc(opt, m, prefix):
    return bf.DistributedAdaptThenCombineOptimizer(opt, m, name_prefix=prefix)


def gradient_allreduce(opt, m, prefix):
    return bf.DistributedGradientAllreduceOptimizer(opt, m, name_prefix=prefix)


for wrap in (awc, atc, gradient_allreduce):
    train(wrap, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5))
runs = train(awc, lambda ps: torch.optim.Adam(ps, lr=0.01))


class Heads(torch.nn.Module):
    """Gradient allreduce where agents lack gradients: head "odd" is used by the odd
    agents only, "zero" by agent 0 only and times 0 (an all-zero average that one agent
    had: every agent keeps it and steps it with weight decay), "none" by no agent (its
    gradient stays None everywhere)."""

    def __init__(self):
        super().__init__()
        self.body, self.odd, self.zero, self.none = (torch.nn.Linear(4, 4), torch.nn.Linear(4, 1),
                                                     torch.nn.Linear(4, 1), torch.nn.Linear(4, 1))

    def forward(self, x):
        h = torch.tanh(self.body(x))
        out = self.odd(h) if rank % 2 else h.sum(1, keepdim=True)
        return out + 0 * self.zero(h) if rank == 0 else out


train(gradient_allreduce, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, weight_decay=0.1),
      net=lambda: Heads().double())


class ComplexNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 2, dtype=torch.complex128))

    def forward(self, x):
        return (x.to(torch.complex128) @ self.w).abs().sum(1, keepdim=True)


train(atc, lambda ps: torch.optim.Adam(ps, lr=0.05), net=ComplexNet)   # (steps on real parts, as torch)
train(atc, lambda ps: torch.optim.Adagrad(ps, lr=0.1),      # (sparse gradients of the embedding)
      net=lambda: torch.nn.Sequential(torch.nn.Embedding(8, 4, sparse=True), torch.nn.Linear(4, 1)).double(),
      loss=lambda m, inputs, targets: mse(m, (inputs[:, 0].abs() * 3).long() % 8, targets))
# the win_put wrapper on a device model: asynchronous (what has arrived is combined), so
# no twin to compare with; the parameters stay on the device and the agents get closer
torch.manual_seed(rank)
wp_model = model_to_device(torch.nn.Linear(4, 1).double())
wp_opt = bf.DistributedWinPutOptimizer(torch.optim.SGD(wp_model.parameters(), lr=0.0), wp_model, window_prefix="wp")


def spread():
    flat = torch.cat([to_host(p).reshape(-1) for p in wp_model.parameters()])
    every = to_host(bf.allgather(to_device(flat[None])))
    return float((every - every.mean(0)).abs().max())


before = spread()
for _ in range(5):
    wp_opt.zero_grad()
    wp_model(to_device(torch.ones(2, 4, dtype=torch.float64))).sum().backward()
    wp_opt.step()
    bf.barrier()
assert all(on_device(p) for p in wp_model.parameters())
assert spread() < 0.7 * before, (before, spread())     # lr 0: only the averaging moves them
wp_opt.free_windows()
wp_opt.remove_hooks()

if REAL:   # (torch's load_state_dict moves the state to the parameters' device: the stand-in has none)
    dev_opt = runs[1][1]

    def every_agents_state():
        flat = torch.cat([s["exp_avg"].reshape(-1) for s in dev_opt.optimizer.state.values()])
        return to_host(bf.allgather(flat[None]))
    assert not torch.equal(every_agents_state()[0], every_agents_state()[1]), "the agents trained alike"
    bf.broadcast_optimizer_state(dev_opt, root_rank=0)
    for state in dev_opt.optimizer.state.values():
        assert on_device(state["exp_avg"]), "broadcast_optimizer_state moved the state off the device"
    states = every_agents_state()
    assert all(torch.equal(states[0], states[r]) for r in range(size)), "broadcast_optimizer_state"

if SLOW:
    print(f"SLOW COPIES {SlowCopy.made}", flush=True)
print(f"DEVICE {'cuda' if REAL else 'stand-in'}")
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

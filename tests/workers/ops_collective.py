"""allreduce / broadcast / allgather (+ in-place forms), parameter helpers, barrier,
against numpy references."""
import numpy as np
import torch

import bluefog_lite as bf

bf.init()
rank, size = bf.rank(), bf.size()


def data(r, shape=(4, 3), dtype=np.float64):
    return np.random.default_rng(7 + r).normal(size=shape).astype(dtype)


everyone = np.stack([data(r) for r in range(size)])

for dtype, tol in ((np.float64, 1e-12), (np.float32, 1e-5)):
    x = torch.from_numpy(data(rank, dtype=dtype))
    before = x.clone()
    np.testing.assert_allclose(bf.allreduce(x, name=f"ar.{dtype.__name__}").numpy(),
                               everyone.mean(0).astype(dtype), rtol=tol, atol=tol)
    np.testing.assert_allclose(bf.allreduce(x, average=False, name="ar.sum").numpy(),
                               everyone.sum(0).astype(dtype), rtol=tol, atol=tol)
    assert torch.equal(x, before)
    assert bf.allreduce_(x, name="ar.inplace") is x       # the tensor itself, as Bluefog returns it
    np.testing.assert_allclose(x.numpy(), everyone.mean(0).astype(dtype), rtol=tol, atol=tol)
    assert bf.synchronize(bf.allreduce_nonblocking_(x, name="ar.inplace.nb")) is x

xi = torch.arange(5, dtype=torch.int32) * (rank + 1)
assert bf.allreduce(xi, average=False, name="ar.int").tolist() == [k * size * (size + 1) // 2 for k in range(5)]

# The average of narrow integers near the top of their range: the sum does not fit
# the dtype, the average does (numpy computes it in int64).
for dt, top in ((torch.uint8, 250), (torch.int8, -120), (torch.int16, 32000), (torch.int32, 2**31 - 9)):
    inward = -1 if top > 0 else 1         # every value stays inside the dtype's range
    vals = np.array([[top + inward * k for k in (r, 2 * r, (r * 3) % 5)] for r in range(size)], dtype=np.int64)
    xn = torch.from_numpy(vals[rank]).to(dt)
    for fn in (bf.allreduce, bf.allreduce_):
        got = fn(xn.clone(), name=f"ar.narrow.{dt}.{fn.__name__}")
        assert got.dtype == dt, got.dtype
        assert got.tolist() == np.floor_divide(vals.sum(0), size).tolist(), (dt, got.tolist())

machines = bf.allgather(torch.tensor([bf.machine_rank()]), name="ar.machines").tolist()
MACHINE = [r for r in range(size) if machines[r] == bf.machine_rank()]     # this agent's machine
# float16 / bfloat16: summed in float32 (MPI cannot add them), rounded once. Rank 0's
# big value plus a 1 from every other agent: each 1 alone is below half the
# spacing at big, so adding in the 16-bit dtype would leave big unchanged.
for dt, big, tol in ((torch.float16, 2048.0, 2.0 ** -10), (torch.bfloat16, 256.0, 2.0 ** -7)):
    one = torch.full((3,), big if rank == 0 else 1.0, dtype=dt)
    exact = torch.tensor([big + size - 1] * 3, dtype=torch.float32)    # exact in float32
    got = bf.allreduce(one, average=False, name=f"ar.half.sum.{dt}")
    assert got.dtype == dt and torch.equal(got, exact.to(dt)), (dt, got, exact)
    assert size == 1 or not torch.equal(got, one if rank == 0 else torch.full((3,), big, dtype=dt))
    q = np.stack([torch.from_numpy(data(r)).to(dt).double().numpy() for r in range(size)])   # the inputs as given
    xh = torch.from_numpy(data(rank)).to(dt)
    before = xh.clone()
    got = bf.allreduce(xh, name=f"ar.half.mean.{dt}")
    assert got.dtype == dt and torch.equal(xh, before)
    np.testing.assert_allclose(got.double().numpy(), q.mean(0), rtol=tol, atol=tol * 1e-2)
    bf.allreduce_(xh, average=False, name=f"ar.half.inplace.{dt}")
    np.testing.assert_allclose(xh.double().numpy(), q.sum(0), rtol=tol, atol=tol * 1e-2)
    xl = torch.from_numpy(data(rank)).to(dt)
    local = bf.allreduce(xl, is_hierarchical_local=True, name=f"ar.half.local.{dt}")
    np.testing.assert_allclose(local.double().numpy(), q[MACHINE].mean(0), rtol=4 * tol, atol=tol)
    # a tensor with the negative bit (z.conj().imag of a complex32 z): torch ignores the bit when it
    # casts the float32 sum into it, which wrote the negated result
    xn = torch._neg_view(-torch.from_numpy(data(rank)).to(dt))
    assert xn.is_neg()
    bf.allreduce_(xn, average=False, name=f"ar.half.neg.{dt}")
    np.testing.assert_allclose(xn.double().numpy(), q.sum(0), rtol=tol, atol=tol * 1e-2)

# a one-element bfloat16 view whose stride is not 1 (m[:, 0] of a (1, 2) matrix): torch calls it
# contiguous, and its bytes could not be taken (numpy has no bfloat16): the op raised on this
# agent and the others waited for it
def one_strided(value):
    return torch.full((1, 2), float(value), dtype=torch.bfloat16)[:, 0]
assert one_strided(rank).stride() == (2,) and one_strided(rank).is_contiguous()
got = bf.allgather(one_strided(rank + 1), name="bf16.strided.gather")
assert got.tolist() == [float(r + 1) for r in range(size)], got
target = one_strided(rank + 1)
assert bf.broadcast_(target, 0, name="bf16.strided.bcast") is target and target.tolist() == [1.0], target
ins = bf.in_neighbor_ranks()
got = bf.neighbor_allreduce(one_strided(rank + 1), name="bf16.strided.nar")
want = (rank + 1 + sum(r + 1 for r in ins)) / (len(ins) + 1)
assert got.dtype == torch.bfloat16 and abs(got.item() - want) <= 2.0 ** -7 * want, (got, want)
got = bf.neighbor_allgather(one_strided(rank + 1), name="bf16.strided.nag")
assert sorted(got.tolist()) == sorted(float(r + 1) for r in ins), (got, ins)

# complex: summed by MPI (C_FLOAT_COMPLEX / C_DOUBLE_COMPLEX), averaged like floats
for dt, tol in ((np.complex128, 1e-12), (np.complex64, 1e-5)):
    def cz(r):
        return (data(r) + 1j * data(r + size)).astype(dt)
    allz = np.stack([cz(r) for r in range(size)])
    z = torch.from_numpy(cz(rank))
    np.testing.assert_allclose(bf.allreduce(z, name=f"ar.cplx.{dt.__name__}").numpy(), allz.mean(0),
                               rtol=tol, atol=tol)
    np.testing.assert_allclose(bf.allreduce(z, average=False, name="ar.cplx.sum").numpy(), allz.sum(0),
                               rtol=tol, atol=tol)
    np.testing.assert_allclose(bf.allreduce(z, is_hierarchical_local=True, name="ar.cplx.local").numpy(),
                               allz[MACHINE].mean(0), rtol=tol, atol=tol)
    bf.allreduce_(z, name="ar.cplx.inplace")
    np.testing.assert_allclose(z.numpy(), allz.mean(0), rtol=tol, atol=tol)

# non-contiguous in-place
xt = torch.from_numpy(data(rank, (3, 4))).t()
bf.allreduce_(xt, name="ar.nc")
np.testing.assert_allclose(xt.numpy(), np.stack([data(r, (3, 4)) for r in range(size)]).mean(0).T, rtol=1e-12)

# in place into lazily conjugated / negated views: the result goes through the view
zc = torch.from_numpy(data(rank, (3,)) + 1j * data(rank + 50, (3,)))
view = zc.conj()
bf.allreduce_(view, name="ar.conj_view")
allzc = np.stack([data(r, (3,)) + 1j * data(r + 50, (3,)) for r in range(size)])
np.testing.assert_allclose(view.resolve_conj().numpy(), np.conj(allzc).mean(0), rtol=1e-12)
np.testing.assert_allclose(zc.numpy(), allzc.mean(0), rtol=1e-12)
zi = torch.from_numpy(1j * data(rank, (3,)))
neg = zi.conj().imag                                  # -data(rank), a negated view
bf.broadcast_(neg, size - 1, name="bc.neg_view")
np.testing.assert_array_equal(zi.imag.numpy(), data(size - 1, (3,)))

for root in range(size):
    x = torch.from_numpy(data(rank))
    y = bf.broadcast(x, root, name=f"bc.{root}")
    np.testing.assert_array_equal(y.numpy(), data(root))
    np.testing.assert_array_equal(x.numpy(), data(rank))
    assert bf.broadcast_(x, root, name="bc_") is x
    np.testing.assert_array_equal(x.numpy(), data(root))

# In-place forms return the tensor itself: a Parameter stays a Parameter (a leaf that
# requires grad, so that it can be trained on), as in Bluefog.
w = torch.nn.Parameter(torch.from_numpy(data(rank)))
w = bf.broadcast_(w, 0, name="bc_.param")
assert isinstance(w, torch.nn.Parameter) and w.requires_grad and w.is_leaf
np.testing.assert_array_equal(w.detach().numpy(), data(0))
(w * w).sum().backward()
np.testing.assert_allclose(w.grad.numpy(), 2 * data(0))
assert bf.synchronize(bf.allreduce_nonblocking_(w, name="ar_.param")) is w

# an in-place form's write counts in the tensor's version as torch's in-place operations
# do: a graph that saved the old values refuses its backward (it used the new values)
for form, inplace in (("broadcast_", lambda t: bf.broadcast_(t, 0, name="bc_.saved")),
                      ("allreduce_", lambda t: bf.allreduce_(t, average=False, name="ar_.saved")),
                      ("broadcast_nonblocking_", lambda t: bf.synchronize(bf.broadcast_nonblocking_(
                          t, 0, name="bc_.saved.nb"))),
                      ("allreduce_nonblocking_", lambda t: bf.synchronize(bf.allreduce_nonblocking_(
                          t, name="ar_.saved.nb"))),
                      ("allreduce_ on the machine", lambda t: bf.allreduce_(
                          t, is_hierarchical_local=True, name="ar_.saved.local"))):
    w = torch.nn.Parameter(torch.from_numpy(data(rank)))
    loss = (w * w).sum()        # saves w
    inplace(w)
    try:
        loss.backward()
        raise AssertionError(f"{form}: a backward used the values it wrote")
    except RuntimeError as exc:
        assert "modified by an inplace operation" in str(exc), exc
# a call refused (its name in flight) or with bad input changed nothing: no write counted
h = bf.allreduce_nonblocking_(torch.from_numpy(data(rank)), name="ar_.busy")
t = torch.from_numpy(data(rank))
for refused in (lambda: bf.allreduce_(t, name="ar_.busy"), lambda: bf.broadcast_(t, size, name="bc_.bad_root")):
    try:
        refused()
        raise AssertionError("accepted")
    except ValueError:
        pass
assert t._version == 0, t._version
bf.synchronize(h)

rows = torch.full((rank + 1, 2), float(rank), dtype=torch.float32)
g = bf.allgather(rows, name="ag")
assert torch.equal(g, torch.cat([torch.full((r + 1, 2), float(r)) for r in range(size)]))

# many nonblocking collectives in flight, completed out of order
hs = [bf.allreduce_nonblocking(torch.full((8,), float(rank * k)), name=f"many.{k}") for k in range(20)]
for k in reversed(range(20)):
    assert torch.allclose(bf.synchronize(hs[k]), torch.full((8,), k * (size - 1) / 2.0))

# collectives in a different order on different agents: clear error on every agent
if rank == 0:
    h1, h2 = bf.allreduce_nonblocking(torch.ones(2), name="A"), bf.allreduce_nonblocking(torch.ones(2), name="B")
else:
    h2, h1 = bf.allreduce_nonblocking(torch.ones(2), name="B"), bf.allreduce_nonblocking(torch.ones(2), name="A")
errors = 0
for h in (h1, h2):
    try:
        bf.synchronize(h)
    except RuntimeError as e:
        assert "different order" in str(e), str(e)
        errors += 1
assert errors == 2, "order mismatch must fail both collectives"

# shape mismatch in allreduce: every agent raises
try:
    bf.allreduce(torch.ones(3 if rank else 4), name="ar.bad")
    raise AssertionError("shape mismatch not detected")
except ValueError as e:
    assert "rank 0: float32[4]" in str(e), str(e)

# parameters and optimizer state: rank 0's values (its parameters gathered before the
# broadcast; its Adam state after one step with gradient 1, in closed form), then the
# average of values that differ by rank
model = torch.nn.Linear(3, 2)
torch.manual_seed(rank)
with torch.no_grad():
    for p in model.parameters():
        p.normal_()
opt = torch.optim.Adam(model.parameters(), lr=0.1 * (rank + 1))
((rank + 1) * model(torch.ones(1, 3)).sum()).backward()      # every gradient entry is rank + 1
opt.step()
flat = lambda: torch.cat([p.detach().reshape(-1) for p in model.parameters()])
root_params = bf.allgather(flat().view(1, -1), name="check.params")[0]
bf.broadcast_parameters(model.state_dict(), root_rank=0)
assert torch.equal(flat(), root_params), f"rank {rank}: parameters are not rank 0's"
bf.broadcast_optimizer_state(opt, root_rank=0)
assert opt.param_groups[0]["lr"] == 0.1
beta1, beta2 = opt.param_groups[0]["betas"]
for p in model.parameters():
    st = opt.state[p]
    assert float(st["step"]) == 1, st["step"]
    assert torch.allclose(st["exp_avg"], torch.full_like(p, 1 - beta1), rtol=1e-6), st["exp_avg"]
    assert torch.allclose(st["exp_avg_sq"], torch.full_like(p, 1 - beta2), rtol=1e-6), st["exp_avg_sq"]
with torch.no_grad():
    for p in model.parameters():
        p.add_(rank)
bf.allreduce_parameters(dict(model.named_parameters()))
np.testing.assert_allclose(flat().numpy(), root_params.numpy() + (size - 1) / 2, rtol=1e-6, atol=1e-6)

# tied weights: a state_dict lists the shared tensor under both names; it is averaged once
tied = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
tied[1].weight = tied[0].weight
with torch.no_grad():
    tied[0].weight.copy_(torch.arange(15.0).view(5, 3) * (rank + 1))
sd = tied.state_dict()
assert sd["0.weight"].data_ptr() == sd["1.weight"].data_ptr()
bf.allreduce_parameters(sd)
np.testing.assert_allclose(tied[0].weight.detach().numpy(),
                           np.arange(15.0).reshape(5, 3) * np.mean(np.arange(1, size + 1)), rtol=1e-6)

bf.barrier()
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

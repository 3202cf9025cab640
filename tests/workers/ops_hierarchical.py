"""hierarchical_neighbor_allreduce and local allreduce with emulated machines
(BLUEFOG_RANKS_PER_MACHINE), against a numpy reference over machine averages."""
import os
import time

import numpy as np
import torch

import bluefog_lite as bf
import topology as topo
from bluefog_lite._runtime import state

bf.init()
rank, size = bf.rank(), bf.size()
per = int(os.environ["BLUEFOG_RANKS_PER_MACHINE"])
assert bf.local_size() == per and bf.local_rank() == rank % per
assert bf.machine_size() == size // per and bf.machine_rank() == rank // per
assert bf.is_homogeneous()
M, m = bf.machine_size(), bf.machine_rank()


def data(r):
    return np.random.default_rng(3 + r).normal(size=(6,))


machine_mean = [np.mean([data(mm * per + l) for l in range(per)], axis=0) for mm in range(M)]

# local allreduce: the average over this machine
y = bf.allreduce(torch.from_numpy(data(rank)), is_hierarchical_local=True, name="local")
np.testing.assert_allclose(y.numpy(), machine_mean[m], rtol=1e-12)

# in place, with the machine's first agent last: its peers' inputs are all in when its
# call starts, so the call can finish in the pass that queues its own input for them
# (small: packets made at the end of the pass) or while MPI still sends it from the
# tensor's memory (large: above the inline limit, 64 KiB); the peers must get the
# input, not the result written into the same tensor
stream = state().engine.stream
for i, n in enumerate((6, 6, 6, 20000, 20000, 20000)):
    name = f"local.inplace.{i}"
    xs = [np.random.default_rng(50 + r).normal(size=n) for r in range(size)]
    if rank % per == 0:
        peers = [(r, (name, "local")) for r in state().local_ranks if r != rank]
        deadline = time.monotonic() + 30
        while not all(stream.inbox.get(k) for k in peers):
            assert time.monotonic() < deadline, f"rank {rank}: the machine's inputs for {name} never came"
            time.sleep(0.005)
    x = torch.from_numpy(xs[rank].copy())
    assert bf.allreduce_(x, is_hierarchical_local=True, name=name) is x
    want = np.mean([xs[m * per + l] for l in range(per)], axis=0)
    np.testing.assert_allclose(x.numpy(), want, rtol=1e-12, err_msg=f"rank {rank}, {name}")

# 16-bit floats: the machine sum is added in float32 and rounded once (as allreduce
# does). Each machine's first agent holds big, the others 1: each 1 alone is below
# half the spacing at big, so adding in the 16-bit dtype would leave big unchanged
# (with 2 agents per machine one rounding either way: the same result).
for dt, big in ((torch.float16, 2048.0), (torch.bfloat16, 256.0)):
    one = torch.full((3,), big if rank % per == 0 else 1.0, dtype=dt)
    exact = torch.full((3,), big + per - 1, dtype=torch.float32).to(dt)
    assert per <= 2 or exact.tolist() != [big] * 3
    got = bf.allreduce(one, average=False, is_hierarchical_local=True, name=f"local.half.{dt}")
    assert got.dtype == dt and torch.equal(got, exact), (dt, got, exact)
    got = bf.allreduce(one, is_hierarchical_local=True, name=f"local.half.mean.{dt}")
    mean = torch.full((3,), (big + per - 1) / per, dtype=torch.float32).to(dt)
    assert got.dtype == dt and torch.equal(got, mean), (dt, got, mean)
    # every machine holds the same sum, so any convex mix of machine sums is that sum
    got = bf.hierarchical_neighbor_allreduce(one, name=f"hna.half.{dt}")
    assert got.dtype == dt and torch.equal(got, (exact.float() / per).to(dt)), (dt, got)

# integers: the machine-local sum wraps around in the tensor's dtype and the average
# floors the exact int64 sum's quotient, as allreduce does (numpy's integer sums
# wrap the same way). 2**53 + 1 and its neighbors are not floats: a sum added in
# float64 would be off by one.
mine = [m * per + l for l in range(per)]     # the ranks of this machine
for dt, npdt, wrap, fine in (
        (torch.int32, np.int32, lambda r: [2**31 - 1 - r, -2**31 + r, 7 * r - 3], lambda r: [2**30 + r, -r]),
        (torch.int64, np.int64, lambda r: [2**62 + r, -2**62 - 3 * r, 5 - r], lambda r: [2**53 + 1 + r, -2**53 - 3 * r]),
        (torch.uint8, np.uint8, lambda r: [250 - r, 129 + r, r], lambda r: [255 - r, r])):
    got = bf.allreduce(torch.tensor(wrap(rank), dtype=dt), average=False, is_hierarchical_local=True,
                       name=f"local.int.{dt}")
    want = np.array([wrap(r) for r in mine], dtype=npdt).sum(axis=0, dtype=npdt)
    assert got.dtype == dt and got.tolist() == want.tolist(), (dt, got, want)
    got = bf.allreduce(torch.tensor(fine(rank), dtype=dt), is_hierarchical_local=True, name=f"local.intmean.{dt}")
    want = [sum(col) // per for col in zip(*(fine(r) for r in mine))]     # exact, Python ints
    assert got.dtype == dt and got.tolist() == want, (dt, got, want)

# a machine topology of the wrong size is named as one (every agent raises)
try:
    bf.set_machine_topology(topo.ExponentialGraph(M + 1))
    raise AssertionError("a machine topology with a node too many was accepted")
except ValueError as e:
    assert f"machine topology must have nodes 0..{M - 1} (one per machine), got {M + 1} nodes" in str(e), e

# static machine topology (Exp-2 over machines, uniform weights)
W = topo.mixing_matrix(topo.ExponentialGraph(M))
A = (W > 0).astype(float)
U = A / A.sum(axis=0, keepdims=True)
y = bf.hierarchical_neighbor_allreduce(torch.from_numpy(data(rank)), name="hna")
np.testing.assert_allclose(y.numpy(), sum(U[i, m] * machine_mean[i] for i in range(M)), rtol=1e-12)

# complex tensors: the imaginary part is averaged like the real part
zdata = lambda r: data(r) + 1j * data(r + 100)
zmean = [np.mean([zdata(mm * per + l) for l in range(per)], axis=0) for mm in range(M)]
for dt in (torch.complex128, torch.complex64):
    y = bf.hierarchical_neighbor_allreduce(torch.from_numpy(zdata(rank)).to(dt), name=f"hna.{dt}")
    assert y.dtype == dt
    np.testing.assert_allclose(y.numpy(), sum(U[i, m] * zmean[i] for i in range(M)), rtol=1e-5)

# explicit weights, dynamic: every machine sends to machine m+1
dst = [(m + 1) % M] if M > 1 else []
src = {(m - 1) % M: 0.4} if M > 1 else {}
y = bf.hierarchical_neighbor_allreduce(torch.from_numpy(data(rank)), self_weight=0.6,
                                       src_machine_weights=src, dst_machine_weights=dst, name="hna.dyn")
ref = 0.6 * machine_mean[m] + sum(w * machine_mean[s] for s, w in src.items())
np.testing.assert_allclose(y.numpy(), ref, rtol=1e-12)
# the same under Bluefog's argument names and order (tensor, self_weight,
# neighbor_machine_weights, send_neighbor_machines, enable_topo_check, name)
y = bf.hierarchical_neighbor_allreduce(torch.from_numpy(data(rank)), 0.6, src, dst, True, "hna.dyn")
np.testing.assert_allclose(y.numpy(), ref, rtol=1e-12)
h = bf.hierarchical_neighbor_allreduce_nonblocking(torch.from_numpy(data(rank)), self_weight=0.6,
                                                   neighbor_machine_weights=src, send_neighbor_machines=dst)
np.testing.assert_allclose(bf.synchronize(h).numpy(), ref, rtol=1e-12)
try:
    bf.hierarchical_neighbor_allreduce(torch.from_numpy(data(rank)), self_weight=0.6, src_machine_weights=src,
                                       neighbor_machine_weights=src, dst_machine_weights=dst, name="hna.both")
except TypeError as e:
    assert "give src_machine_weights or neighbor_machine_weights" in str(e), e
else:
    raise AssertionError("weights given under both names were taken")

# the last agent passes another shape: its machine cannot sum, and the machines that
# receive from it get no sum: their agents raise; the name works again afterwards
odd = torch.ones(5 if rank == size - 1 else 4, dtype=torch.float64)
hit = m == M - 1 or U[M - 1, m] > 0        # its machine, or one that receives from it
try:
    bf.hierarchical_neighbor_allreduce(odd, name="hna.odd")
except ValueError as e:
    assert hit and "same shape and dtype" in str(e), e
    assert m == M - 1 or f"rank {(M - 1) * per + rank % per} has no machine sum" in str(e), e
else:
    assert not hit, "a shape mismatch on a neighbor machine went unnoticed"
y = bf.hierarchical_neighbor_allreduce(torch.from_numpy(data(rank)), name="hna.odd")
np.testing.assert_allclose(y.numpy(), sum(U[i, m] * machine_mean[i] for i in range(M)), rtol=1e-12)

# the last machine's agents pass another dtype that machine sums do not show (every
# integer sum goes as float64): the agents receiving a sum of the other dtype raise
receives_other = [U[i, m] > 0 for i in range(M) if (i == M - 1) != (m == M - 1)]
for mine_dt, last_dt in ((torch.int64, torch.int32), (torch.float64, torch.int64), (torch.int64, torch.int8)):
    dt = last_dt if m == M - 1 else mine_dt
    try:
        bf.hierarchical_neighbor_allreduce(torch.full((3,), 100, dtype=dt), name="hna.other_dtype")
    except ValueError as e:
        assert any(receives_other) and "same shape and dtype" in str(e), e
        other = mine_dt if m == M - 1 else last_dt
        assert f"passed a tensor of dtype {str(other).split('.')[1]} but this agent has" in str(e), e
    else:
        assert not any(receives_other), f"{mine_dt} and {last_dt} on different machines went unnoticed"

# uint64 values above 2**63 (an int64 machine sum would wrap them negative)
big = 2**63 + 2**20
got = bf.hierarchical_neighbor_allreduce(torch.tensor([big, 7], dtype=torch.uint64), name="hna.uint64")
assert got.dtype == torch.uint64 and [int(v) for v in got.tolist()] == [big, 7], got.tolist()

# the last agent's arguments are rejected (a bool tensor; a src machine out of range):
# it raises its own error, its machine peers and the agents of the machines receiving
# from it raise naming the cause instead of waiting; the name works again afterwards
last = size - 1
for case, bad, words in (
        ("hna.bad_dtype", dict(tensor=torch.ones(4, dtype=torch.bool)), "cannot average bool tensors"),
        ("hna.bad_weights", dict(self_weight=0.5, src_machine_weights={M + 3: 0.5}),
         f"machine rank in src_machine_weights {M + 3} is out of range")):
    args = dict(tensor=torch.ones(4, dtype=torch.float64))
    args.update(bad if rank == last else {})
    try:
        bf.hierarchical_neighbor_allreduce(args.pop("tensor"), name=case, **args)
    except (TypeError, ValueError) as e:
        assert hit and words in str(e), (case, e)
        assert rank == last or "because of bad input" in str(e), (case, e)
    else:
        assert not hit, f"{case}: rank {last}'s bad arguments went unnoticed"
    y = bf.hierarchical_neighbor_allreduce(torch.from_numpy(data(rank)), name=case)
    np.testing.assert_allclose(y.numpy(), sum(U[i, m] * machine_mean[i] for i in range(M)), rtol=1e-12)

# the same for a machine-local allreduce: only the last agent's machine is involved
try:
    bf.allreduce(torch.ones(4, dtype=torch.bool if rank == last else torch.float64),
                 is_hierarchical_local=True, name="local.bad")
except (TypeError, ValueError) as e:
    assert m == M - 1 and "bool" in str(e), e
else:
    assert m != M - 1, "the bad local allreduce went unnoticed"
y = bf.allreduce(torch.from_numpy(data(rank)), is_hierarchical_local=True, name="local.bad")
np.testing.assert_allclose(y.numpy(), machine_mean[m], rtol=1e-12)

# all local ranks get bitwise the same result
g = bf.allgather(y.view(1, -1), name="same")
for r in range(size):
    if r // per == m:
        assert torch.equal(g[r], y)

bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

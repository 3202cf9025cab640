"""Fused groups of neighbor_allreduce (ops of one plan admitted together run as one
task): every result against numpy, with agents grouping the same ops differently,
mixed shapes and dtypes, integers, dynamic scaled sends, and one member whose
shape disagrees (only that member fails, only where the mismatch is seen)."""
import time

import numpy as np
import torch

import bluefog_lite as bf
import topology as topo
from bluefog_lite._runtime import state

bf.init(topology_fn=topo.ExponentialTwoGraph)
rank, size = bf.rank(), bf.size()
stats = state().engine.stream.stats
W = topo.mixing_matrix(topo.ExponentialTwoGraph(size))
U = (W > 0) / (W > 0).sum(axis=0, keepdims=True)      # uniform receiving weights
SHAPES = [(7,), (3, 4), (2, 3, 2), (), (0,), (1,), (64,), (5, 1)]
DTYPES = [np.float32, np.float64]


def data(r, burst, k, shape, dtype):
    x = np.asarray(np.random.default_rng([r, burst, k]).normal(size=shape) * 10)
    return x.astype(dtype)


def pause(k):
    """Odd ranks submit with pauses, so their groups differ from the even ranks'."""
    if rank % 2 == 1 and k % 3 == 2:
        time.sleep(0.0005)


# -- static topology: bursts of mixed shapes and dtypes ---------------------------------
for burst in range(12):
    specs = [(SHAPES[k % len(SHAPES)], DTYPES[(k // 3) % 2]) for k in range(40)]
    handles = []
    for k, (shape, dtype) in enumerate(specs):
        handles.append(bf.neighbor_allreduce_nonblocking(torch.from_numpy(data(rank, burst, k, shape, dtype)),
                                                         name=f"s.{k}"))
        pause(k)
    for k, ((shape, dtype), h) in enumerate(zip(specs, handles)):
        y = bf.synchronize(h)
        ref = sum(U[i, rank] * data(i, burst, k, shape, dtype).astype(np.float64) for i in range(size))
        assert y.shape == shape and y.dtype == torch.from_numpy(np.zeros(0, dtype)).dtype, (k, y.shape, y.dtype)
        np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-4)

# -- integers: summed in float64 and rounded, as unfused --------------------------------
for burst in range(4):
    xs = [torch.from_numpy(data(rank, burst, k, (6,), np.float64).round().astype(np.int32)) for k in range(20)]
    handles = [bf.neighbor_allreduce_nonblocking(x, name=f"i.{k}") for k, x in enumerate(xs)]
    for k, h in enumerate(handles):
        ref = sum(U[i, rank] * data(i, burst, k, (6,), np.float64).round() for i in range(size))
        y = bf.synchronize(h)
        assert y.dtype == torch.int32
        np.testing.assert_array_equal(y.numpy(), np.round(ref).astype(np.int32))

# -- dynamic one-peer Exp-2 with scaled sends (dst weight 0.5), no topology check ------------
for step in range(6):
    shift = 2 ** (step % max(1, (size - 1).bit_length()))
    dst, src = (rank + shift) % size, (rank - shift) % size
    handles = [bf.neighbor_allreduce_nonblocking(
        torch.from_numpy(data(rank, 100 + step, k, (9,), np.float32)), self_weight=0.5,
        src_weights={src: 1.0}, dst_weights={dst: 0.5}, enable_topo_check=False, name=f"d.{k}")
        for k in range(24)]
    for k, h in enumerate(handles):
        ref = 0.5 * data(rank, 100 + step, k, (9,), np.float32) + 0.5 * data(src, 100 + step, k, (9,), np.float32)
        np.testing.assert_allclose(bf.synchronize(h).numpy(), ref, rtol=1e-5, atol=1e-5)

# -- one member disagrees: rank 1 sends a 4-vector where the others send 3 ------------------
bad_k = 5
shape_of = lambda r, k: (4,) if (r == 1 and k == bad_k) else (3,)   # noqa: E731
handles = [bf.neighbor_allreduce_nonblocking(torch.from_numpy(data(rank, 200, k, shape_of(rank, k), np.float32)),
                                             name=f"m.{k}") for k in range(16)]
sees_mismatch = rank == 1 or 1 in bf.in_neighbor_ranks()
for k, h in enumerate(handles):
    if k == bad_k and sees_mismatch:
        try:
            bf.synchronize(h)
        except ValueError as exc:
            assert "rank 1" in str(exc) or rank == 1, exc
            assert f"m.{bad_k}" in str(exc), exc
        else:
            raise AssertionError(f"rank {rank}: the mismatched member m.{bad_k} did not fail")
        continue
    y = bf.synchronize(h)
    ref = sum(U[i, rank] * data(i, 200, k, (3,), np.float32) for i in range(size))
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-4)

# -- afterwards everything works as before -----------------------------------------------
y = bf.neighbor_allreduce(torch.full((3,), float(rank)), name="after")
np.testing.assert_allclose(y.numpy(), np.full(3, sum(U[i, rank] * i for i in range(size))), rtol=1e-6)

counts = bf.allgather(torch.tensor([[stats["fused_ops"], stats["fused_joined_views"],
                                     stats["fused_joined_copies"]]], dtype=torch.int64)).sum(0).tolist()
if rank == 0:
    print(f"fused ops {counts[0]}, neighbor parts taken as views {counts[1]}, gathered {counts[2]}", flush=True)
    assert counts[0] > 0, "no operations were fused"
    assert counts[1] > 0 and counts[2] > 0, "both ways of joining a neighbor's parts must have run"
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

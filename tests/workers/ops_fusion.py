"""Many small concurrent neighbor_allreduce ops: correct results, and (with fusion on)
far fewer MPI messages than operations; mixed with large tensors that bypass fusion."""
import sys

import numpy as np
import torch

import bluefog_lite as bf
import topology as topo
from bluefog_lite._runtime import state

bf.init()
rank, size = bf.rank(), bf.size()
fusion = sys.argv[1:] != ["nofusion"]
W = topo.mixing_matrix(topo.ExponentialGraph(size))
U = (W > 0) / (W > 0).sum(axis=0, keepdims=True)


def data(r, k, n):
    return np.random.default_rng(r * 1000 + k).normal(size=n).astype(np.float32)


sizes = [4096 // 4] * 60 + [3 * 1024 * 1024 // 4] * 2 + [10, 1, 0]   # 4 KB x 60, 3 MB x 2, tiny
stats = state().engine.stream.stats
bf.barrier()
before = dict(stats)
handles = [bf.neighbor_allreduce_nonblocking(torch.from_numpy(data(rank, k, n)), name=f"f.{k}")
           for k, n in enumerate(sizes)]
results = [bf.synchronize(h) for h in handles]
for k, (n, y) in enumerate(zip(sizes, results)):
    ref = sum(U[i, rank] * data(i, k, n) for i in range(size))
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-6)
packets = stats["packets"] - before.get("packets", 0)
sends = len(sizes) * len(bf.out_neighbor_ranks())
print(f"rank {rank}: {len(sizes)} ops to {len(bf.out_neighbor_ranks())} neighbors -> {packets} packets, "
      f"{stats['data_messages'] - before.get('data_messages', 0)} separate data messages", flush=True)
if fusion:
    assert packets <= sends // 4, f"fusion did not pack small ops: {packets} packets for {sends} sends"
else:
    assert packets >= sends - 2 * len(bf.out_neighbor_ranks()), f"fusion off but {packets} packets"
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

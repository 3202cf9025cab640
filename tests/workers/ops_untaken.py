"""Data that no operation takes is reported at shutdown: dynamic neighbor_allreduce
with enable_topo_check=False, every rank r sending to r+1, but rank 1 receiving
from nobody. The results are what each agent's own weights say; rank 1's
shutdown warns about rank 0's tensor under that name (and no other agent warns)."""
import numpy as np
import torch

import bluefog_lite as bf

bf.init()
rank, size = bf.rank(), bf.size()
x = torch.arange(4, dtype=torch.float64) + 10 * rank
nxt, prev = (rank + 1) % size, (rank - 1) % size
if rank == 1:
    y = bf.neighbor_allreduce(x, self_weight=1.0, src_weights={}, dst_weights={nxt: 1.0},
                              enable_topo_check=False, name="stray")
    np.testing.assert_array_equal(y.numpy(), x.numpy())
else:
    y = bf.neighbor_allreduce(x, self_weight=0.5, src_weights={prev: 0.5}, dst_weights={nxt: 1.0},
                              enable_topo_check=False, name="stray")
    np.testing.assert_allclose(y.numpy(), 0.5 * x.numpy() + 0.5 * (np.arange(4) + 10 * prev))
bf.barrier()     # rank 0's tensor for rank 1 was sent before rank 0 got here
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

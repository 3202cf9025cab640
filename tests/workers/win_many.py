"""As many windows as MPICH allows at once work; one more is refused by name on every
agent (MPICH itself would crash a little further on: it runs out of communicator
ids); after win_free they can be created again. A put on the last window still
reaches its target."""
import sys

import numpy as np
import torch

import bluefog_lite as bf
from bluefog_lite import windows

bf.init()
rank, size = bf.rank(), bf.size()
most = windows.most_windows()
assert most == 2000, most     # the pip MPICH this suite installs
tensors = [torch.full((2,), float(rank)) for _ in range(most + 1)]
for i in range(most):
    bf.win_create(tensors[i], f"w{i}")
try:
    bf.win_create(tensors[most], "one.more")
    raise AssertionError("a window past MPICH's limit was created")
except ValueError as e:
    assert f"{most} windows exist, the most this MPI allows at once" in str(e), e
    assert "win_free some first" in str(e), e
last = f"w{most - 1}"
bf.win_put(tensors[most - 1], last)
bf.barrier()
ins = bf.in_neighbor_ranks()
got = bf.win_update(last, self_weight=0.0, neighbor_weights={s: 1.0 for s in ins})
np.testing.assert_allclose(got.numpy(), np.full(2, float(sum(ins))))
bf.win_free()
assert bf.win_create(tensors[most], "one.more")
bf.win_free()
sys.stdout.write(f"AGENT OK {rank}\n")
bf.shutdown()

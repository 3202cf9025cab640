"""Asynchronous push-sum with win_accumulate and the associated weight p.

Each agent repeatedly sends a share of (x, p) to its out-neighbors and collects
what arrived, at its own pace (rank-dependent random sleeps, no barrier inside
the loop), for a fixed wall-clock period. Mass is conserved, so after a final
collect x/p is the exact average of the initial vectors on every agent.
argv[1]: "ring" (RingGraph(n, connect_style=2), directed) or "exp" (ExponentialGraph(n))."""
import sys
import time

import numpy as np
import torch

import bluefog_lite as bf
import topology as topo

bf.init()
rank, size = bf.rank(), bf.size()
G = topo.RingGraph(size, connect_style=2) if sys.argv[1] == "ring" else topo.ExponentialGraph(size)
assert bf.set_topology(G)
OUT = bf.out_neighbor_ranks()
RUN_S = 2.0


def initial(r):
    return np.random.default_rng(50 + r).normal(size=10) * 10


average = sum(initial(r) for r in range(size)) / size
bf.turn_on_win_ops_with_associated_p()
x = torch.from_numpy(initial(rank))
bf.win_create(x, "pushsum", zero_init=True)
share = 1.0 / (len(OUT) + 1)
rng = np.random.default_rng(rank)
deadline = float(bf.broadcast(torch.tensor([time.monotonic() + RUN_S], dtype=torch.float64), 0)[0])
iterations = 0
while time.monotonic() < deadline:
    time.sleep(rng.uniform(0, 1e-3 * (1 + rank % 3)))      # agents run at different speeds
    bf.win_accumulate(x, "pushsum", self_weight=share, dst_weights={d: share for d in OUT},
                      require_mutex=True)
    bf.win_update_then_collect("pushsum")
    iterations += 1
bf.barrier()
bf.win_update_then_collect("pushsum")          # what arrived after this agent's last collect
p = bf.win_associated_p("pushsum")

counts = bf.allgather(torch.tensor([iterations]))
total_x = bf.allreduce(x, average=False, name="mass.x")
total_p = bf.allreduce(torch.tensor([p], dtype=torch.float64), average=False, name="mass.p")
np.testing.assert_allclose(total_x.numpy(), average * size, rtol=0, atol=1e-10)
np.testing.assert_allclose(total_p.numpy(), [size], rtol=0, atol=1e-12)
np.testing.assert_allclose(x.numpy() / p, average, rtol=0, atol=1e-10)
assert len(set(counts.tolist())) > 1, f"agents ran in lockstep ({counts.tolist()}); expected asynchrony"
if rank == 0:
    print(f"push-sum on {sys.argv[1]}: iterations per agent {counts.tolist()}", flush=True)
bf.barrier()
bf.win_free()
bf.turn_off_win_ops_with_associated_p()
sys.stdout.write(f"AGENT OK {rank}\n")
bf.shutdown()

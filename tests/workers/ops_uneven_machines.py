"""3 agents emulating machines of 2 (BLUEFOG_RANKS_PER_MACHINE=2): machine 0 has 2
agents, machine 1 one. The layout queries say so; hierarchical_neighbor_allreduce
refuses on every agent, naming the agents per machine and the setting; the
machine-local allreduce and the flat operations still work."""
import torch

import bluefog_lite as bf

bf.init()
rank = bf.rank()
assert bf.size() == 3 and not bf.is_homogeneous()
assert (bf.machine_rank(), bf.local_rank(), bf.local_size(), bf.machine_size()) == \
    [(0, 0, 2, 2), (0, 1, 2, 2), (1, 0, 1, 2)][rank]
try:
    bf.hierarchical_neighbor_allreduce(torch.ones(2))
except ValueError as e:
    assert str(e) == ("hierarchical_neighbor_allreduce needs the same number of agents on every machine; agents "
                      "per machine: machine 0: 2, machine 1: 1 (BLUEFOG_RANKS_PER_MACHINE=2 with 3 agents)"), e
else:
    raise AssertionError("uneven machines accepted")
local = bf.allreduce(torch.tensor([float(rank)]), is_hierarchical_local=True, name="local")
assert local.item() == [0.5, 0.5, 2.0][rank], local
assert bf.allreduce(torch.tensor([float(rank)]), name="all").item() == 1.0
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

"""A neighbor call refused before it could tell whom it receives from (dynamic mode
whose source weights are missing; or whom it sends to, 1b) leaves its senders' data for that call queued: the
later calls of the name used to take it as their own, one round late, silently
(all agents making the mistake, and one agent making it while the others run
static mode). Now every later call of that name raises on the agents involved, and
another name works. Run with BLUEFOG_RANKS_PER_MACHINE=2 (2 machines of 2)."""
import sys

import numpy as np
import torch

import bluefog_lite as bf

bf.init()
r, n = bf.rank(), bf.size()
M, mr = bf.machine_size(), bf.machine_rank()


def fails(call, *args, **kwargs):
    try:
        got = call(*args, **kwargs)
    except ValueError as e:
        return str(e)
    raise AssertionError(f"rank {r}: {kwargs.get('name')!r} returned {got.tolist()} instead of failing")


def later_calls_refused(name):
    """Correct calls of name after its refused one raise on every agent (never a stale value)."""
    bf.barrier()
    for step in range(1, 3):
        said = fails(bf.neighbor_allreduce, x + 10 * step, self_weight=0.5, src_weights={(r - 1) % n: 0.5},
                     dst_weights=[(r + 1) % n], enable_topo_check=False, name=name)
        assert f"an earlier NEIGHBOR_ALLREDUCE '{name}' of this agent was refused" in said, said
        assert "use another name" in said, said
        bf.barrier()


# 1. every agent: dst_weights without self_weight/src_weights (no topology check)
x = torch.full((3,), float(r), dtype=torch.float64)
assert "needs self_weight and src_weights too" in fails(bf.neighbor_allreduce, x, dst_weights=[(r + 1) % n],
                                                        enable_topo_check=False, name="b")
later_calls_refused("b")
got = bf.neighbor_allreduce(x + 30, self_weight=0.5, src_weights={(r - 1) % n: 0.5}, dst_weights=[(r + 1) % n],
                            enable_topo_check=False, name="b2")
np.testing.assert_allclose(got.numpy(), np.full(3, 0.5 * (r + 30) + 0.5 * ((r - 1) % n + 30)))

# 1b. every agent: dst_weights naming itself (readable sources, no topology check). Each
# agent dropped one arrival from its sender for the failed call, which sent nothing (it
# failed the same way): later calls of the name took the next call's data, one call late,
# silently, then waited for ever. Now they raise on every agent.
assert "is this agent itself" in fails(bf.neighbor_allreduce, x, self_weight=0.5, src_weights={(r - 1) % n: 0.5},
                                       dst_weights=[r], enable_topo_check=False, name="s")
later_calls_refused("s")

# 2. one agent: dst_machine_weights without the rest, the others in static mode
kw = dict(dst_machine_weights=[(mr + 1) % M]) if r == 0 else {}
fails(bf.hierarchical_neighbor_allreduce, x, name="h", **kw)
bf.barrier()
for step in range(1, 3):
    fails(bf.hierarchical_neighbor_allreduce, x + 10 * step, name="h")     # never a stale value
    bf.barrier()
machine_avg = [np.mean([q + 40 for q in range(m * n // M, (m + 1) * n // M)]) for m in range(M)]
got = bf.hierarchical_neighbor_allreduce(x + 40, name="h2")
np.testing.assert_allclose(got.numpy(), np.full(3, np.mean(machine_avg)))
bf.barrier()
sys.stdout.write(f"AGENT OK {r}\n")
bf.shutdown()

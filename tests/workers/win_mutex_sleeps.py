"""An agent waiting for a window mutex another agent holds sleeps between its retries:
rank 0 holds every agent's mutex for 1 s while the others win_put with require_mutex
(blocking: run by the caller) and win_accumulate_nonblocking + win_wait (run by the
communication thread). The engine's loop cycles are counted: a sleeping wait makes
about one per retry (1 ms backoff); the spinning one made ~100 000 per second
(each retry counted as progress: yield window, then sleeps of a few tens of µs),
a quarter of a core per waiting agent. The data are checked too."""
import time

import torch

import bluefog_lite as bf
from bluefog_lite._runtime import state

bf.init()
rank, size = bf.rank(), bf.size()
engine = state().engine
cycles = [0]
loop_cycle = engine._cycle


def counted(status):
    cycles[0] += 1
    return loop_cycle(status)


engine._cycle = counted
bf.win_create(torch.zeros(100), "w", zero_init=True)
HOLD_S = 1.0
for how in ("blocking", "nonblocking"):
    bf.barrier()
    if rank == 0:
        with bf.win_mutex("w", ranks=list(range(size))):
            bf.barrier()
            time.sleep(HOLD_S)
    else:
        bf.barrier()
        before, t0 = cycles[0], time.monotonic()
        if how == "blocking":
            bf.win_put(torch.ones(100), "w", require_mutex=True)
        else:
            bf.win_wait(bf.win_accumulate_nonblocking(torch.ones(100), "w", require_mutex=True))
        waited = time.monotonic() - t0
        assert waited > 0.5 * HOLD_S, f"{how}: did not wait for the mutex ({waited:.3f} s)"
        made = cycles[0] - before
        assert made < 10000 * waited, f"{how}: {made} loop cycles in {waited:.2f} s of waiting: it spins"
    bf.barrier()
# each agent's buffer of in-neighbor s: the put's ones plus the accumulate's ones; nothing from rank 0
for s in bf.in_neighbor_ranks():
    got = bf.win_update("w", self_weight=0.0, neighbor_weights={s: 1.0}, clone=True)
    assert torch.equal(got, torch.full((100,), 0.0 if s == 0 else 2.0)), (s, got[:3])
bf.barrier()
bf.win_free()
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

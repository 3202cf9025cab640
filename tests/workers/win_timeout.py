"""A mutex held too long: the waiting agent gets the stall warning (naming the
window, the rank and the holder) and, with BLUEFOG_OP_TIMEOUT_S, an OpTimeout
instead of hanging; the window stays usable. Run with BLUEFOG_STALL_WARNING_S=1,
BLUEFOG_OP_TIMEOUT_S=3 on 2 agents."""
import sys
import time

import torch

import bluefog_lite as bf

bf.init()
rank = bf.rank()
bf.win_create(torch.zeros(4), "held")
bf.barrier()
if rank == 0:
    with bf.win_mutex("held", for_self=True):
        bf.barrier()        # rank 1 tries once rank 0 holds it
        time.sleep(4.5)
else:
    bf.barrier()
    t0 = time.monotonic()
    try:
        with bf.win_mutex("held", ranks=[0]):
            raise AssertionError("got a mutex that rank 0 holds")
    except TimeoutError as e:
        assert "mutex of window 'held' on rank 0 (held by rank 0)" in str(e), e
        assert 2.5 < time.monotonic() - t0 < 4.5, time.monotonic() - t0
    time.sleep(max(0.0, 4.7 - (time.monotonic() - t0)))
    with bf.win_mutex("held", ranks=[0]):      # free again: taken at once
        bf.win_put(torch.ones(4), "held", require_mutex=True)
bf.barrier()
bf.win_free()
sys.stdout.write(f"AGENT OK {rank}\n")
bf.shutdown()

"""shutdown() with an operation that never completes (rank 0 waits for rank 1, which
never joins): the communication thread goes on sleeping between its looks while
shutdown waits for it (BLUEFOG_STALL_WARNING_S), instead of spinning a core (it did:
6 s of CPU in a 6 s shutdown). Counted in the thread's own CPU clock. Its warning
names the operation not finished, not one that finished unsynchronized."""
import sys
import time

import torch

import bluefog_lite as bf
from bluefog_lite._runtime import state

bf.init()
r = bf.rank()
if r == 0:
    thread = state().engine._thread
    done = bf.allreduce_nonblocking(torch.ones(1), name="done.unsynchronized")   # done, not in flight
    h = bf.neighbor_allreduce_nonblocking(torch.ones(5), self_weight=0.5, src_weights={1: 0.5}, dst_weights=[],
                                          enable_topo_check=False, name="lonely")
    clock = time.pthread_getcpuclockid(thread.ident)
    cpu0, t0 = time.clock_gettime(clock), time.monotonic()
    bf.shutdown()
    cpu, wall = time.clock_gettime(clock) - cpu0, time.monotonic() - t0
    assert thread.is_alive() and wall > 1.5, (thread.is_alive(), wall)     # it gave up on 'lonely'
    assert cpu < 0.3 * wall, f"the communication thread used {cpu:.2f} s of CPU in a {wall:.2f} s shutdown"
else:
    bf.synchronize(bf.allreduce_nonblocking(torch.ones(1), name="done.unsynchronized"))
    time.sleep(4.0)
    bf.shutdown()
sys.stdout.write(f"AGENT OK {r}\n")

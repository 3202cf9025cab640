"""Ctrl-C caught around a blocking call: rank 0's blocking neighbor_allreduce is
interrupted (SIGINT to its main thread) while it waits for the others. The blocking
call held the only handle of its operation; before, the operation finished later
but its name stayed "in flight" for good: the next call of that name was refused
("synchronize it before reusing the name") with no handle left to synchronize.
Now the abandoned operation frees its name when it is done. (Run with
BLUEFOG_CALLER_PROGRESS=1, the main thread runs the communication loop while it
waits, on the quick path, and the signal lands in its sleep; with 0 it waits on a
lock.)"""
import signal
import threading
import time

import torch

import bluefog_lite as bf
import topology

bf.init()
rank, size = bf.rank(), bf.size()
W = topology.mixing_matrix(bf.load_topology())
x = torch.full((4,), float(rank), dtype=torch.float64)
want = torch.full((4,), float(sum(W[k, rank] * k for k in range(size))), dtype=torch.float64)
if rank == 0:
    main = threading.main_thread().ident
    threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
    try:
        bf.neighbor_allreduce(x, name="x")
        raise AssertionError("not interrupted: the test tested nothing")
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
else:
    time.sleep(1.0)
    torch.testing.assert_close(bf.neighbor_allreduce(x, name="x"), want, rtol=1e-12, atol=1e-12)
bf.barrier()        # (the others' first round reached rank 0 before this)
torch.testing.assert_close(bf.neighbor_allreduce(x, name="x"), want, rtol=1e-12, atol=1e-12)
assert bf.set_topology(topology.RingGraph(size)), "set_topology refused: an operation still counts as in flight"
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

"""Ctrl-C caught around synchronize: rank 0's SIGINT is delivered to its communication
thread while the main thread waits for an operation, so Python raises the
KeyboardInterrupt in the main thread once its wait returns, i.e. just after it took
the operation's lock. Before, the lock stayed taken: the operation counted as in
flight for good (set_topology refused, shutdown waited a minute) and a second
synchronize of its handle never returned. Now the operation is done: synchronizing
it again returns its result, set_topology is accepted, and shutdown is prompt."""
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
    comm = next(t for t in threading.enumerate() if t.name == "bluefog-communication")
    threading.Timer(0.1, lambda: signal.pthread_kill(comm.ident, signal.SIGINT)).start()
    h = bf.neighbor_allreduce_nonblocking(x, name="x")
    try:
        got = bf.synchronize(h)     # (its first wait of 0.5 s ends with the others' data)
    except KeyboardInterrupt:
        got = bf.synchronize(h)
        print("INTERRUPTED", flush=True)
else:
    time.sleep(0.25)
    got = bf.neighbor_allreduce(x, name="x")
torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
bf.barrier()
assert bf.set_topology(topology.RingGraph(size)), "set_topology refused: an operation still counts as in flight"
start = time.monotonic()
bf.shutdown()
assert time.monotonic() - start < 10, f"shutdown took {time.monotonic() - start:.1f} s"
print(f"AGENT OK {rank}", flush=True)

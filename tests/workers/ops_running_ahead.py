"""A neighbor that runs ahead does not make an agent hold receive buffers for
operations it has not started: while rank 0 waits in one large op, rank 1 sends
the data of five more; rank 0 takes none of it into memory until it starts them,
and every result still matches the mixing matrix."""
import time

import torch
from mpi4py import MPI

import bluefog_lite as bf
from bluefog_lite._runtime import state

bf.init()
go = MPI.COMM_WORLD.Dup()    # rank 0 tells rank 1 when to start "first"
r = bf.rank()
assert bf.size() == 2
n = 1 << 18                  # 1 MB of float32: sent as its own message, not inline
later = [f"ahead.{i}" for i in range(5)]
value = lambda rank, i: float(100 * rank + i)  # noqa: E731
stream = state().engine.stream
if r == 1:
    handles = [bf.neighbor_allreduce_nonblocking(torch.full((n,), value(r, i)), name=nm)
               for i, nm in enumerate(later)]
    go.recv(source=0)        # rank 0 waits in "first" meanwhile
    first = bf.neighbor_allreduce_nonblocking(torch.full((n,), value(r, 9)), name="first")
else:
    first = bf.neighbor_allreduce_nonblocking(torch.full((n,), value(r, 9)), name="first")
    deadline = time.monotonic() + 30    # rank 1's five descriptors arrive while "first" is active
    while sum((1, nm) in stream.inbox for nm in later) < len(later):
        assert time.monotonic() < deadline, "rank 1's five descriptors never came"
        time.sleep(0.01)
    time.sleep(0.1)          # a wrongly posted receive would show by now
    held = [large.keys for large in stream.unposted]
    assert sorted(k for keys in held for k in keys) == [(1, nm) for nm in later], \
        f"data of operations rank 0 has not started was taken in: still held {held}"
    assert not stream.pending_recvs, "receives posted for operations rank 0 has not started"
    assert not any(stream.pool._free.values()), "buffers taken for operations not started"
    go.send(None, dest=1)
    handles = [bf.neighbor_allreduce_nonblocking(torch.full((n,), value(r, i)), name=nm)
               for i, nm in enumerate(later)]
got = bf.synchronize(first)
assert torch.equal(got, torch.full((n,), 0.5 * (value(0, 9) + value(1, 9)))), got[:4]
for i, h in enumerate(handles):
    got = bf.synchronize(h)
    assert torch.equal(got, torch.full((n,), 0.5 * (value(0, i) + value(1, i)))), (i, got[:4])
go.Free()
print(f"AGENT OK {r}", flush=True)
bf.shutdown()

"""Ctrl-C caught around bluefog_lite calls (argv[1] picks the case).

synchronize: rank 0's SIGINT is delivered to its communication thread while the
    main thread waits for an operation, so Python raises the KeyboardInterrupt in
    the main thread once its wait returns, i.e. just after it took the operation's
    lock. Before, the lock stayed taken: the operation counted as in flight for good
    (set_topology refused, shutdown waited a minute) and a second synchronize of its
    handle never returned. Now the operation is done: synchronizing it again returns
    its result, set_topology is accepted, and shutdown is prompt.
window_small, window_large: rank 0's blocking neighbor_allreduce (4 KB, 512 KB)
    is interrupted while it runs on the quick path, after its sends, before its
    inputs came (the exception raised where a signal handler's would: in a yield of
    the quick path's look loop, _quick._yield). Before, the call never became an
    operation: the inputs came later, stayed in the inbox and fed the name's next
    call (round-1 values averaged with round-2 x), whose own inputs were never
    taken. Now the call becomes an operation nobody waits for (stats
    "quick_interrupted") that takes them, and the next call is exact.
blocking: rank 0's blocking neighbor_allreduce is interrupted (SIGINT to its main
    thread) while it waits for the others. The blocking call held the only handle of
    its operation; before, the operation finished later but its name stayed "in
    flight" for good: the next call of that name was refused ("synchronize it before
    reusing the name") with no handle left to synchronize. Now the abandoned
    operation frees its name when it is done. (With BLUEFOG_CALLER_PROGRESS=1 the
    main thread runs the communication loop while it waits, on the quick path, and
    the signal lands in its sleep; with 0 it waits on a lock.)"""
import os
import signal
import sys
import threading
import time

import torch

import bluefog_lite as bf
import topology

case = sys.argv[1]
bf.init()
rank, size = bf.rank(), bf.size()
W = topology.mixing_matrix(bf.load_topology())
x = torch.full((4,), float(rank), dtype=torch.float64)
want = torch.full((4,), float(sum(W[k, rank] * k for k in range(size))), dtype=torch.float64)
if case == "synchronize":
    sent = os.path.join(sys.argv[2], "signal_sent")      # (a folder of the test's)
    if rank == 0:
        comm = next(t for t in threading.enumerate() if t.name == "bluefog-communication")

        def interrupt():
            signal.pthread_kill(comm.ident, signal.SIGINT)
            open(sent, "w").close()
        threading.Timer(0.1, interrupt).start()
        h = bf.neighbor_allreduce_nonblocking(x, name="x")
        try:
            got = bf.synchronize(h)     # (its first wait of 0.5 s ends with the others' data)
        except KeyboardInterrupt:
            # raised once the wait returned with the operation done (the case this tests), not
            # inside the wait loop of an operation still waiting for its data
            print("INTERRUPTED", "DONE" if bf.poll(h) else "WAITING", flush=True)
            got = bf.synchronize(h)
    else:
        while not os.path.exists(sent):     # the others' data comes after the signal
            time.sleep(0.005)
        got = bf.neighbor_allreduce(x, name="x")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    bf.barrier()
elif case.startswith("window_"):
    from bluefog_lite import _quick
    from bluefog_lite._runtime import state
    n = 512 if case == "window_small" else 1 << 16      # float64: 4 KB on the small path, 512 KB on the large

    def round_of(r, k):
        return torch.arange(n, dtype=torch.float64) * (1.0 if r == 1 else 0.5) + (1000.0 if r == 1 else -77.0) * k
    stats = state().engine.stream.stats
    if rank == 0:
        yield_ = _quick._yield

        def interrupting_yield():
            _quick._yield = yield_
            raise KeyboardInterrupt
        _quick._yield = interrupting_yield
        try:
            bf.neighbor_allreduce(round_of(1, rank), name="x")
            raise AssertionError("not interrupted: the test tested nothing")
        except KeyboardInterrupt:
            pass
        assert stats["quick_interrupted"] == 1, f"the call was not interrupted on the quick path: {dict(stats)}"
        print("INTERRUPTED", flush=True)
    else:
        time.sleep(0.3)      # (rank 0 looks for their inputs meanwhile)
        got = bf.neighbor_allreduce(round_of(1, rank), name="x")
        torch.testing.assert_close(got, sum(W[k, rank] * round_of(1, k) for k in range(size)), rtol=1e-12, atol=1e-9)
    bf.barrier()
    deadline = time.monotonic() + 30     # the abandoned operation frees its name once it took its inputs
    while "x" in state().engine._names:
        assert time.monotonic() < deadline, "the interrupted call's operation never completed"
        time.sleep(0.01)
    got = bf.neighbor_allreduce(round_of(2, rank), name="x")    # (round 1's inputs gave another average)
    torch.testing.assert_close(got, sum(W[k, rank] * round_of(2, k) for k in range(size)), rtol=1e-12, atol=1e-9)
    bf.barrier()
else:
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
start = time.monotonic()
bf.shutdown()
assert time.monotonic() - start < 10, f"shutdown took {time.monotonic() - start:.1f} s"
print(f"AGENT OK {rank}", flush=True)

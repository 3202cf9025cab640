"""What a training script's process does around bluefog_lite (2 agents), by mode:

- nested: a signal handler makes a bf call while the interrupted thread is inside
  a blocking call that it runs (it holds the communication loop): the handler's call
  must raise a RuntimeError that says so (it hung for good);
- nested_lock: the same while the interrupted thread holds the engine's lock (in
  submit or synchronize; the communication thread waited for it, the handler for
  the communication thread: a hang);
- nested_shutdown: a SIGTERM handler calls bf.shutdown() then sys.exit(0) while
  rank 0's own shutdown waits for rank 1: the nested shutdown returns at once and the
  one cut short finishes at exit (it crashed freeing a communicator twice);
- finalize: MPI.Finalize() called while initialized shuts bluefog_lite down first
  (its communication thread called a finalized MPI: segmentation fault); bf.init()
  after it raises a clear error (MPICH's own message and exit 1);
- fork: a child forked after init() is not an agent: its bf calls raise, its
  shutdown() does nothing, it has the user's excepthooks (its exit ran shutdown and
  told the others the agent had left), and its timeline_stop() leaves the parent's
  timeline file alone (it ended it in the middle).
"""
import os
import signal
import sys
import threading
import time

import torch
from mpi4py import MPI

import bluefog_lite as bf

mode = sys.argv[1]
bf.init()
r = bf.rank()
if r == 1:      # (output order between the agents does not matter)
    time.sleep(0.1)


def signalled(period_s):
    """SIGUSR1 to this process every period_s from a thread, whose handler makes a
    call without peers (it completes at once unless the loop or its lock is held)
    and records "returned" or the RuntimeError's text in the list returned, with the
    function that stops the signals."""
    seen = []

    def handler(signum, frame):
        try:      # (a handler may interrupt a handler: a name of its own each time)
            bf.neighbor_allreduce(torch.ones(3), self_weight=1.0, src_weights={}, dst_weights=[],
                                  enable_topo_check=False, name=f"in_handler.{len(seen)}.{time.monotonic_ns()}")
            seen.append("returned")
        except RuntimeError as exc:
            seen.append(str(exc))
    handler(None, None)       # (imports what the call needs: not in the middle of an import later)
    assert seen.pop() == "returned"
    signal.signal(signal.SIGUSR1, handler)
    done = threading.Event()

    def ring():
        while not done.wait(period_s):
            os.kill(os.getpid(), signal.SIGUSR1)
    ringer = threading.Thread(target=ring)
    ringer.start()

    def stop():
        done.set()
        ringer.join()
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    return seen, stop


if mode == "nested":
    x = torch.full((1000,), float(r))
    if r == 0:
        seen, stop = signalled(0.01)
    for i in range(1500):      # blocking calls, most of them run by this thread
        y = bf.neighbor_allreduce(x, name="nb")
        assert torch.allclose(y, torch.full((1000,), 0.5)), y
    if r == 0:
        stop()
        nested = [text for text in seen if text != "returned"]
        assert nested, f"no signal came during a call: {seen[:3]}"
        assert all("inside another bluefog_lite call" in text for text in nested), nested[0]
    bf.barrier()
elif mode == "nested_lock":
    seen, stop = signalled(0.0005)
    x = torch.full((10,), float(r))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2.0:      # nonblocking calls without peers, many at once
        handles = [bf.neighbor_allreduce_nonblocking(x, self_weight=1.0, src_weights={}, dst_weights=[],
                                                     enable_topo_check=False, name=f"m{k}") for k in range(20)]
        for h in handles:
            assert torch.equal(bf.synchronize(h), x)
    stop()
    nested = [text for text in seen if text != "returned"]
    assert all("inside another bluefog_lite call" in text for text in nested), nested[:1]
    assert "returned" in seen, seen[:3]
    bf.barrier()
elif mode == "nested_shutdown":
    def handler(signum, frame):
        bf.shutdown()       # returns at once: the main thread's shutdown is running
        sys.stdout.write(f"AGENT OK {r}\n")
        sys.stdout.flush()
        sys.exit(0)
    signal.signal(signal.SIGTERM, handler)
    bf.neighbor_allreduce(torch.ones(10) * r)
    if r == 0:
        threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    else:
        time.sleep(3)       # rank 0's shutdown waits for this agent meanwhile
        sys.stdout.write(f"AGENT OK {r}\n")
    bf.shutdown()
    sys.exit(0)
elif mode == "finalize":
    y = bf.neighbor_allreduce(torch.full((1000,), float(r)), name="before")
    h = bf.neighbor_allreduce_nonblocking(torch.ones(10), name="in_flight")
    MPI.Finalize()
    assert MPI.Is_finalized()
    try:
        bf.rank()
        raise AssertionError("bluefog_lite still initialized after MPI.Finalize()")
    except bf.BluefogError as exc:
        assert "shut down" in str(exc), exc
    try:
        bf.init()
        raise AssertionError("init after MPI.Finalize() returned")
    except bf.BluefogError as exc:
        assert "MPI was finalized" in str(exc), exc
    sys.stdout.write(f"AGENT OK {r}\n")
    sys.exit(0)
elif mode == "fork":
    import json
    import tempfile
    prefix = os.path.join(tempfile.mkdtemp(), "tl_")
    bf.timeline_start(prefix)
    x = torch.full((100,), float(r))
    bf.neighbor_allreduce(x, name="a")
    hooks = (sys.excepthook, threading.excepthook)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            bf.allreduce(x)
            code = 3
        except bf.BluefogError as exc:
            code = 0 if "forked" in str(exc) else 4
        bf.shutdown()       # nothing: the agent is the parent
        bf.timeline_stop()      # nothing: the file is the parent's
        try:
            bf.timeline_start(prefix + "child_")
            code = 6
        except bf.BluefogError:
            pass
        if (sys.excepthook, threading.excepthook) != bf._runtime._state.hooks_before:
            code = 5
        os._exit(code)      # (plain mpi4py's finalize at a forked child's exit breaks the job by itself)
    for _ in range(20):
        z = bf.allreduce(x, name="after_fork")
        assert torch.allclose(z, torch.full((100,), 0.5)), z
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"child exit code {os.waitstatus_to_exitcode(status)}"
    assert (sys.excepthook, threading.excepthook) == hooks
    bf.timeline_stop()
    with open(f"{prefix}{r}.json") as f:
        events = json.load(f)
    assert [e["name"] for e in events].count("bluefog_end") == 1
    assert sum(e["name"] == "ENQUEUE_ALLREDUCE" for e in events) == 40     # (a B and an E per call)
    bf.barrier()
bf.shutdown()
sys.stdout.write(f"AGENT OK {r}\n")

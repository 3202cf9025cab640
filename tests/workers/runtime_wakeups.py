"""How the communication thread wakes (2 agents; argv[1] picks the case). The MPI
pokes, the safety net when a wake-up is lost, are set to 1 s, so a lost wake-up
shows as an operation taking ~1 s instead of milliseconds.

missed_look: rank 1's thread is held up 50 ms just before it raises its sleep
    flag (as by the GIL); rank 0 sends meanwhile and, seeing the flag down, does
    not ring. The look before sleeping must find the data: one MPICH Improbe may
    only move a waiting message into MPI's queue and find nothing (it slept 1 s).
handback: rank 1's main thread runs a blocking call's loop itself while another
    thread's ring wakes the sleeping communication thread, which then waits for the
    caller to hand the loop back; the caller lets go with nothing left, and the
    other thread's next operation must still wake it (it waited 1 s).
announced: rank 0 holds the loop for a quick call while rank 1's large tensor is
    announced to it (its flag is down then: no ring), and lets go without taking
    it; rank 1's send waits until rank 0 posts the receive, which the thread must
    do at once (it slept until its poke, or rank 0's next call). Rank 1 keeps the
    usual pokes. A trial whose descriptor the thread took before the hold (a slow
    barrier) tests nothing; at least one of five must not be one.
many_files: the process has more than 1024 files open at init: the doorbell's
    descriptor is >= 1024, which select() refused (the job aborted)."""
import os
import resource
import sys
import threading
import time

import torch

case = sys.argv[1]
if case == "many_files":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]

import bluefog_lite as bf   # noqa: E402
from bluefog_lite import _doorbell   # noqa: E402
from bluefog_lite._runtime import state   # noqa: E402

bf.init()
r = bf.rank()
eng = state().engine
defaults = eng.idle_poke_s, eng.progress_poke_s
eng.idle_poke_s = eng.progress_poke_s = 1.0
LOST = 0.5     # s: an operation this slow waited for the poke

if case == "many_files":
    assert eng.doorbell.sock.fileno() >= 1024, eng.doorbell.sock.fileno()
    for k in range(20):
        time.sleep(0.01)        # (the thread sleeps on its bell between calls)
        y = bf.neighbor_allreduce(torch.full((3,), float(r)), name="x")
        assert torch.equal(y, torch.full((3,), 0.5)), y
        assert torch.equal(bf.synchronize(bf.neighbor_allreduce_nonblocking(torch.ones(3), name="y")),
                           torch.ones(3))
elif case == "missed_look":
    armed = [False]
    raise_flag = _doorbell.Doorbell.asleep

    def held_up(self, flag):
        if flag and armed[0] and threading.current_thread().name == "bluefog-communication":
            armed[0] = False
            time.sleep(0.05)
        raise_flag(self, flag)
    _doorbell.Doorbell.asleep = held_up
    for trial in range(3):
        bf.barrier()
        time.sleep(0.1)
        if r == 1:
            armed[0] = True
        else:
            time.sleep(0.02)    # (rank 1's thread is in its 50 ms then)
        t0 = time.monotonic()
        y = bf.synchronize(bf.neighbor_allreduce_nonblocking(torch.full((4,), float(r)), name=f"x{trial}"))
        took = time.monotonic() - t0
        assert torch.equal(y, torch.full((4,), 0.5)), y
        assert took < LOST, f"rank {r}: the operation took {took:.3f} s: the look before sleeping missed its data"
elif case == "handback":
    for trial in range(5):
        bf.barrier()
        time.sleep(0.05)
        if r == 1:
            took = {}

            def other():
                time.sleep(0.01)
                bf.synchronize(bf.neighbor_allreduce_nonblocking(torch.ones(4), name=f"A{trial}"))
                t = time.monotonic()
                bf.synchronize(bf.neighbor_allreduce_nonblocking(torch.ones(4), name=f"B{trial}"))
                took["B"] = time.monotonic() - t
            worker = threading.Thread(target=other)
            worker.start()
            bf.neighbor_allreduce(torch.ones(4), name=f"C{trial}")      # blocking: this thread runs the loop
            worker.join()
            assert took["B"] < LOST, f"operation B took {took['B']:.3f} s: the thread slept through its submit"
        else:
            time.sleep(0.05)
            for h in [bf.neighbor_allreduce_nonblocking(torch.ones(4), name=f"{n}{trial}") for n in "CAB"]:
                bf.synchronize(h)
elif case == "announced":
    big = torch.ones(1 << 17)        # 512 KB: its own message, announced by a descriptor
    # a pooled buffer of that size for rank 0 to receive into ahead of its call (_posting.py)
    assert torch.equal(bf.neighbor_allreduce(big, name="warm"), big)
    exercised = 0
    for trial in range(5):
        bf.barrier()
        if r == 0:
            deadline = time.monotonic() + 5
            while not eng.hold_if_idle("hold"):      # (the thread may still finish the barrier)
                assert time.monotonic() < deadline, "the engine never became idle"
                time.sleep(0.001)
            s = eng.stream
            key = (1, f"big{trial}")
            while not s.unposted and not s.inbox.get(key):   # rank 1's descriptor, received while holding
                assert time.monotonic() < deadline, "rank 1's descriptor never came"
                s.receive(eng._caller_status)
                time.sleep(0.001)
            exercised += bool(s.unposted)     # (else the thread took it before the hold: a slow barrier)
            eng.release_hold("hold")
            time.sleep(2 * LOST)       # no MPI calls: only the thread can post the receive
            y = bf.neighbor_allreduce(torch.zeros_like(big), self_weight=0.5, src_weights={1: 0.5},
                                      dst_weights={}, enable_topo_check=False, name=f"big{trial}")
            assert torch.equal(y, torch.full_like(big, 0.5)), y
        else:
            # (the sender's own wait for its send keeps the usual pokes: a ring back it misses
            # costs ~2 ms, not the 1 s that would hide what rank 0 does)
            eng.idle_poke_s, eng.progress_poke_s = defaults
            time.sleep(0.2)            # (rank 0 holds the loop by then, unless its barrier was slow)
            t = time.monotonic()
            bf.neighbor_allreduce(big, self_weight=1.0, src_weights={}, dst_weights={0: 1.0},
                                  enable_topo_check=False, name=f"big{trial}")
            took = time.monotonic() - t
            assert took < LOST, f"the send took {took:.3f} s: rank 0 left the announced tensor unposted"
    assert r != 0 or exercised, "rank 1's tensor never came while rank 0 held the loop: the test tested nothing"
bf.barrier()
bf.shutdown()
print(f"AGENT OK {r}", flush=True)

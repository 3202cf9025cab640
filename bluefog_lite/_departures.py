"""Agents that leave: who has shut down, and ending the job when someone waits for them.

Every agent tells every other one when it shuts down (``bf.shutdown()``, which
also runs at exit: a script that ends or calls ``sys.exit()``), then waits until
all have, as ``MPI_Finalize`` would. A departed agent never sends again, so an
operation still waiting for its data can never finish; the departed agent cannot
tell that anyone needs it. So each agent runs a small watcher thread that learns
of departures and, when one of its own operations has waited too long for data
from an agent that has left, aborts the job (through the callback given by the
runtime) instead of hanging.

The watcher asks the engine which operations wait for data from which ranks
(``Engine.waiting_for_data``, safe from another thread).
"""
import sys
import threading
import time

import numpy as np

from ._mpi import MPI

_TAG = 0xBF72          # on the runtime's private communicator (not the engine's)
GRACE_S = 3.0          # data a departed agent sent before leaving lands well within this
_TICK_S = 0.2


class Departures:
    def __init__(self, comm, engine, abort):
        """comm: the runtime's private communicator; abort(op, rank): ends the job."""
        self.comm, self.engine, self._abort = comm, engine, abort
        self.departed = {}      # rank -> time.monotonic() its notice arrived
        self._buf = np.zeros(1, np.int64)
        self._status = MPI.Status()
        self._req = comm.Irecv(self._buf, MPI.ANY_SOURCE, _TAG) if comm.size > 1 else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="bluefog-departures", daemon=True)
        if self._req is not None:
            self._thread.start()

    def _collect(self):
        while self._req.Test(self._status):
            self.departed[self._status.Get_source()] = time.monotonic()
            self._req = self.comm.Irecv(self._buf, MPI.ANY_SOURCE, _TAG)

    def _watch(self):
        suspects = set()
        while not self._stop.wait(_TICK_S):
            self._collect()
            if not self.departed:
                continue
            # Seen on two ticks in a row, in the same wait: not a glimpse of the
            # instant between the engine taking the data and resuming the operation.
            now = self._stuck()
            stuck = suspects & now
            suspects = now
            if stuck:
                op, _, rank = next(iter(stuck))
                self._abort(op, rank)

    def _stuck(self):
        """{(op, its wait, departed rank)} for operations that have waited longer than
        GRACE_S for data from an agent that has left. A copy of the engine's state
        that fails because the engine changed it meanwhile is retried at the next tick."""
        now, found = time.monotonic(), set()
        for op, wait, missing, since_wait in self.engine.waiting_for_data():
            for r in missing:
                since = self.departed.get(r)
                if since is not None and now - max(since, since_wait) > GRACE_S:
                    found.add((op, wait, r))
        return found

    def leave(self):
        """Tell every other agent that this one has left; wait until all have.
        Every notice sent is received before the communicator is freed."""
        if self._req is None:
            return
        self._stop.set()
        self._thread.join()
        self._collect()
        self._req.Cancel()
        self._req.Wait(self._status)
        if not self._status.Is_cancelled():
            self.departed[self._status.Get_source()] = time.monotonic()
        me = self.comm.rank
        peers = [r for r in range(self.comm.size) if r != me]
        notice = np.array([me], np.int64)
        inbox = np.zeros(self.comm.size, np.int64)
        sends = [self.comm.Isend(notice, r, _TAG) for r in peers]
        recvs = {r: self.comm.Irecv(inbox[r:r + 1], r, _TAG) for r in peers if r not in self.departed}
        self._wait(sends, recvs, me)

    def _wait(self, sends, recvs, me):
        start, delay, warned = time.monotonic(), 1e-3, False
        reqs = sends + list(recvs.values())
        while not MPI.Request.Testall(reqs):
            time.sleep(delay)
            delay = min(delay * 1.5, 0.02)
            if not warned and time.monotonic() - start > self.engine.stall_warning_s:
                waiting = [r for r, q in recvs.items() if not q.Test()]
                if not waiting:     # the last notices came in since Testall: nobody to name
                    continue
                warned = True
                sys.stderr.write(f"bluefog_lite WARNING (rank {me}): shutdown has waited "
                                 f"{time.monotonic() - start:.0f} s for ranks {waiting} to shut down too\n")
                sys.stderr.flush()

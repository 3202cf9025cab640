"""Agents that leave: who has shut down, and ending the job when someone waits for them.

Every agent tells every other one twice that it shuts down (``bf.shutdown()``,
which also runs at exit: a script that ends or calls ``sys.exit()``): when it
starts to (its own operations in flight have finished, or the runtime gave up
waiting for them; it will call no operation any more but shutdown's collective
win_free), and when it has left (after that), then waits until all
have left, as ``MPI_Finalize`` would. An agent that has started to shut down never
joins another operation, so an operation still waiting for its data can never
finish; that agent cannot tell that anyone needs it (it may be waiting in
shutdown's win_free for the very agents that wait for it). So each agent runs a
small watcher thread that learns of departures and, when one of its own
operations has waited too long for data from an agent that has started to shut
down, aborts the job (through the callback given by the runtime) instead of
hanging. Shutdown's own win_free (op.at_shutdown) waits for agents that have
started to shut down (they are on their way to it) and is aborted only for one
that has left without it.

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


_LEAVING, _LEFT = 1, 2     # a notice's stage: started to shut down; has left


class Departures:
    def __init__(self, comm, engine, abort):
        """comm: the runtime's private communicator; abort(op, rank): ends the job."""
        self.comm, self.engine, self._abort = comm, engine, abort
        self.leaving = {}       # rank -> time.monotonic() its first notice arrived
        self.departed = {}      # rank -> time.monotonic() its second notice arrived
        self._buf = np.zeros(1, np.int64)
        self._status = MPI.Status()
        self._req = comm.Irecv(self._buf, MPI.ANY_SOURCE, _TAG) if comm.size > 1 else None
        self._sends = []        # this agent's notices in flight
        self._keep = []         # their buffers (alive until the sends complete)
        self._final = None      # leave()'s (sends, {rank: receives}) once posted
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="bluefog-departures", daemon=True)
        if self._req is not None:
            self._thread.start()

    def _note(self, src, stage):
        """A notice from src arrived (stage _LEAVING or _LEFT; they come in that order)."""
        (self.departed if stage == _LEFT else self.leaving)[src] = time.monotonic()

    def _collect(self):
        while self._req.Test(self._status):
            self._note(self._status.Get_source(), int(self._buf[0]))
            self._req = self.comm.Irecv(self._buf, MPI.ANY_SOURCE, _TAG)

    def _notify(self, stage):
        notice = np.array([stage], np.int64)
        self._sends += [self.comm.Isend(notice, r, _TAG) for r in range(self.comm.size) if r != self.comm.rank]
        self._keep.append(notice)

    def start_leaving(self):
        """Tell every other agent that this one has started to shut down: it joins no
        operation any more but shutdown's win_free."""
        if self._req is not None and not self._sends:
            self._notify(_LEAVING)

    def _watch(self):
        suspects = set()
        while not self._stop.wait(_TICK_S):
            self._collect()
            if not self.leaving:
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
        GRACE_S for data from an agent that has started to shut down (shutdown's own
        win_free: that has left). A copy of the engine's state that fails because the
        engine changed it meanwhile is retried at the next tick."""
        now, found = time.monotonic(), set()
        for op, wait, missing, since_wait in self.engine.waiting_for_data():
            gone = self.departed if op.at_shutdown else self.leaving
            for r in missing:
                since = gone.get(r)
                if since is not None and now - max(since, since_wait) > GRACE_S:
                    found.add((op, wait, r))
        return found

    def leave(self):
        """Tell every other agent that this one has left; wait until all have.
        Every notice sent is received before the communicator is freed. Called again
        after an exception cut it short (a signal handler's sys.exit), it waits for
        the notices it posted."""
        if self._req is None:
            return
        if self._final is not None:
            self._wait(*self._final, self.comm.rank)
            return
        self.start_leaving()
        self._stop.set()
        self._thread.join()
        self._collect()
        self._req.Cancel()
        self._req.Wait(self._status)
        if not self._status.Is_cancelled():
            self._note(self._status.Get_source(), int(self._buf[0]))
        me = self.comm.rank
        self._notify(_LEFT)
        # each peer's notices still to come, in order (MPI keeps a sender's order):
        # its first (unless in) and its second
        inbox = np.zeros((self.comm.size, 2), np.int64)
        recvs = {}
        for r in range(self.comm.size):
            if r != me and r not in self.departed:
                recvs[r] = [self.comm.Irecv(inbox[r, i:i + 1], r, _TAG)
                            for i in range(1 if r in self.leaving else 2)]
        self._final = (self._sends, recvs)
        self._keep.append(inbox)
        self._wait(self._sends, recvs, me)

    def _wait(self, sends, recvs, me):
        """recvs: {rank: [its requests]}."""
        start, delay, warned = time.monotonic(), 1e-3, False
        reqs = sends + [q for qs in recvs.values() for q in qs]
        while not MPI.Request.Testall(reqs):
            time.sleep(delay)
            delay = min(delay * 1.5, 0.02)
            if not warned and time.monotonic() - start > self.engine.stall_warning_s:
                waiting = [r for r, qs in recvs.items() if not all(q.Test() for q in qs)]
                if not waiting:     # the last notices came in since Testall: nobody to name
                    continue
                warned = True
                sys.stderr.write(f"bluefog_lite WARNING (rank {me}): shutdown has waited "
                                 f"{time.monotonic() - start:.0f} s for ranks {waiting} to shut down too\n")
                sys.stderr.flush()

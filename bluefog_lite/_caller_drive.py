"""A blocking call run by its caller: the part of the Engine that lets a caller
take the loop from the sleeping communication thread.

The loop runs under the engine's *drive lock* (_engine.py). A caller of a
blocking operation that finds it free runs the loop itself until its operation
is done (_drive_until), then hands back what is left (_let_go); a small or
large blocking neighbor_allreduce on an idle agent holds the lock without
running the loop (hold_if_idle ... continue_held, used by _quick.py) and turns
into an ordinary operation only if it must. CallerDrive is part of the Engine
(its state is the engine's).
"""
import threading
import time

import torch

from . import _posting
from ._doorbell import URGENT_ONLY
from .timeline import _recorder as tl

_monotonic = time.monotonic
_get_ident = threading.get_ident


class CallerDrive:
    """The Engine's caller-run loop and the holds of _quick.py."""

    def _drive_until(self, op):
        """Run the loop on the calling thread until op is done; False (nothing done)
        if the communication thread holds the drive lock, i.e. is awake and will run
        op itself. The thread meanwhile sleeps (woken, it waits for the hand-back:
        _sleep_on_bell). Stops early, handing the loop back, if the timeline starts
        or the engine stops."""
        if not self._drive.acquire(False):
            return False
        self._driver = _get_ident()
        self.driven_by_callers += 1
        try:
            self._run_until(op)
        finally:
            self._let_go()
        return True

    def refuse_nested(self):
        """Raise if the calling thread holds the drive lock (it is inside a blocking
        call that it runs) or the engine's lock (inside submit or synchronize): this
        call comes from a signal handler that interrupted it, and nothing could run
        the loop for this one while it waits (the communication thread needs the lock)."""
        if (self._driver is not None and self._driver == _get_ident()) or self._lock._is_owned():
            raise RuntimeError(
                "bluefog_lite was called while this thread was inside another bluefog_lite call that holds "
                "the communication loop or its lock (from a signal handler that interrupted it?), so this one "
                "could never complete. In the handler, only set a flag, and act on it after the interrupted "
                "call has returned")

    def _run_until(self, op):
        """The loop, run by a caller that holds the drive lock, until op is done."""
        self.doorbell.asleep(0)      # peers need not ring while this thread runs the loop
        status = self._caller_status
        with torch.no_grad():
            idle_since = _monotonic()
            while not op.is_done() and tl.current is None and not self._stopping:
                moved, now = self._cycle(status)
                if moved:
                    idle_since = now
                elif self._sleep(now - idle_since, status, caller=True):
                    idle_since = _monotonic()

    def _let_go(self):
        """A caller releases the drive lock: if the thread sleeps, wake it for what is
        left (handing the loop back), or let it idle."""
        left = False
        self._quick_hold = False
        if self._sleeping:
            # (unposted: a neighbor's large tensor announced meanwhile, whose sender waits
            # until its receive is posted)
            left = bool(self._queue or self._expects_news() or self.stream.unposted)
            if not left:
                self.doorbell.asleep(URGENT_ONLY)     # (see _sleep)
                self._rung = False    # the next submit rings (a ring may have gone to the caller)
        self._driver = None
        self._drive.release()
        if left:
            self._handback.set()
            self._wake()

    # ---- a call its caller runs alone (_quick.py) ---------------------------
    def hold_if_idle(self, name):
        """Take the loop for a call that the caller will run without it: True, holding
        the drive lock with name in use, if the thread sleeps and nothing is queued,
        in flight or unsent; False, taking nothing, otherwise (also when name is in
        use or the engine stops: submit then says so)."""
        if not self._drive.acquire(False):
            return False
        self._driver = _get_ident()
        with self._lock:
            idle = not (self._queue or self._active or self._completing or self._discard
                        or self.stream.outboxes or self._stopping or name in self._names)
            if idle:
                self._names.add(name)
        if not idle:      # nothing changed: let go without waking the thread for what it has
            queued = bool(self._queue)
            self._driver = None
            self._drive.release()
            if queued and self._sleeping:     # it may have been rung for these meanwhile
                self._handback.set()
                self._wake()
            return False
        self.driven_by_callers += 1
        self._quick_hold = True
        self.doorbell.asleep(0)      # peers need not ring while this thread runs the loop
        return True

    def release_hold(self, name):
        """End hold_if_idle for a call that finished without becoming an operation."""
        s = self.stream
        s.test_sends()
        s.arrived.clear()     # nothing waits (the engine was idle): no one to resume
        with self._lock:
            self._names.discard(name)
        self._let_go()

    def held_take(self, keys):
        """Under hold_if_idle: the entries for every key (src, name), or None while any
        is missing (nothing taken). If they are not all in yet, first receive what has
        come, post the receives of the call's own large inputs at once (the next of
        their keys from their senders), and ring back the senders of those that are in."""
        entries = self._take_all(keys)
        if entries is not None:
            return entries
        moved = self.stream.receive(self._caller_status)
        moved = self.held_post(keys) or moved
        return self._take_all(keys) if moved else None

    def held_take_ready(self, keys):
        """Under hold_if_idle: the entries for every key if each one's first is ready
        (taken from the inbox), else None (nothing taken); receives nothing."""
        return self._take_all(keys)

    def held_post(self, keys):
        """Under hold_if_idle: post the receives of the call's own large inputs (keys:
        (src, name)) whose descriptors are in, the next of their keys from their
        senders, and ring back the senders of those that are in. True if any was
        posted or came in."""
        s = self.stream
        moved = False
        if s.unposted:
            wanted, left = set(keys), []
            for large in s.unposted:
                if wanted.issuperset(large.keys) and _posting.next_of_its_keys(s.inbox, large):
                    s.post(large)
                    moved = True
                else:
                    left.append(large)
            s.unposted = left
        if s.pending_recvs and s.test_recvs():
            self.ring_peers()
            moved = True
        return moved

    def held_interrupted(self, large=False):
        """Under hold_if_idle: True once the loop is needed for something else (an
        operation another thread queued, a large tensor announced or arriving; with
        ``large``, one that held_take does not take for the call)."""
        s = self.stream
        if large:
            return bool(self._queue or s.unposted)
        return bool(self._queue or s.unposted or s.pending_recvs)

    def continue_held(self, name, kind, task, data_requests=()):
        """Under hold_if_idle: make the call an operation (task as for submit; name is
        already in use; data_requests: its large sends in flight), run the loop until
        it is done, let go. Returns its handle for synchronize."""
        op = None
        try:
            op = self._held_op(name, kind, task, data_requests)
            self._run_until(op)
        except BaseException:       # (interrupted: the blocking call never gets the handle)
            if op is not None:
                self.abandon(op)
            raise
        finally:
            self._let_go()
        return op.handle

    def abandon_held(self, name, kind, task, data_requests=()):
        """Under hold_if_idle, for a call interrupted (a signal handler's exception)
        while it waits for its inputs: make it an operation as continue_held does, but
        one that nobody waits for, and let go. The loop takes its inputs and drops it
        (else they stayed in the inbox and fed the name's next call, whose own inputs
        were never taken)."""
        try:
            self.abandon(self._held_op(name, kind, task, data_requests))
        finally:
            self._let_go()

    def _held_op(self, name, kind, task, data_requests):
        """The operation a held call becomes, stepped once (see continue_held)."""
        self._quick_hold = False     # (the loop may sleep on the bell)
        with self._lock:
            op = self._new_op(name, kind)
            op.task = task(self, op)
            op.data_requests = list(data_requests)
            self._ops[op.handle] = op
        self._active.add(op)
        self._step(op, None)
        return op

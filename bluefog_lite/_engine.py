"""The communication thread: one queue, one loop that drives every MPI data operation.

Callers enqueue an operation (a generator, see _tasks.py) and get an integer handle.
The loop admits new operations, pushes their sends into the per-neighbor stream,
receives packets, resumes operations whose inputs have arrived, and sleeps when
nothing moves: ranks share cores, so it never busy-spins. A sleeping loop is woken
by its callers and by peers on the same host through its doorbell (_doorbell.py).

The loop runs under the *drive lock*. The communication thread holds it except
while it sleeps; a caller of a blocking operation that finds it free (the thread
asleep) runs the loop itself until its operation is done (_caller_drive.py),
so that a blocking call costs no hand-over to the thread and no wake-up back: on
shared cores every wake-up is paid in CPU. A blocking neighbor_allreduce on an
idle agent goes further and holds the lock without running the loop at all
(hold_if_idle, _quick.py). The timeline keeps every operation on the
communication thread (its MPI_ spans belong there).

Which queued operations run fused as one task is _fusion.py's; when the data of
a large tensor is received, _posting.py's; what a task yields to wait is in
_waits.py; the warnings and timeouts of operations that wait too long are the
stall inspector's (_stalls.py).
"""
import collections
import itertools
import math
import os
import sys
import threading
import time

import torch

from _thread import allocate_lock as _allocate_lock, get_ident as _get_ident

from . import _fusion, _posting
from ._doorbell import ANYTHING, URGENT_ONLY, Doorbell
from ._mpi import MPI, retire
from ._pool import BufferPool
from ._caller_drive import CallerDrive
from ._stalls import INSPECT_EVERY_S, StallInspector
from ._stream import StreamEndpoint
from ._waits import Recv, Requests, Sleep, Turn, Until
from .timeline import _recorder as tl


def _env_float(name, default, infinite_ok=False):
    """A number of seconds from the environment: >= 0 (inf, "never", where infinite_ok)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value >= 0 and (infinite_ok or math.isfinite(value))):
        raise ValueError(f"{name} must be a number of seconds, got {raw!r} (a number >= 0"
                         + (", or inf for never)" if infinite_ok else ")"))
    return value


def _env_int(name, default):
    """A number of bytes from the environment: an integer >= 0."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be a number of bytes (an integer >= 0), got {raw!r}")
    return value


_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _env_flag(name, default, empty):
    """A switch from the environment: 1/0 (true/false, yes/no, on/off); empty: ``empty``."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if not value:
        return empty
    if value not in _ON + _OFF:
        raise ValueError(f"{name} must be 1 or 0 (on or off), got {raw!r}")
    return value in _ON


_yield = os.sched_yield
_monotonic = time.monotonic
# Large sends of failed calls still in flight when their engine stopped: their
# receivers may never take them, and MPI may read the memory until it finalizes.
_ABANDONED = []


# Handles are unique in the process, across init/shutdown cycles: a handle kept from
# before a shutdown must not name an operation of the next run.
_HANDLES = itertools.count(1)


def _drain(iterator):
    """Run an iterator to its end at C speed (collections.deque with maxlen 0)."""
    collections.deque(iterator, maxlen=0)


class Op:
    __slots__ = ("handle", "name", "kind", "task", "wait", "waiting_since", "warned",
                 "data_requests", "result", "error", "_pending", "finished_task", "coll_seq",
                 "collective", "caller_tid", "fuse", "riders", "inline", "reserved", "deliver", "ready",
                 "completed", "at_shutdown", "done", "freed", "abandoned")

    def __init__(self, handle, name, kind, task, fuse=None):
        self.handle, self.name, self.kind, self.task = handle, name, kind, task
        self.fuse = fuse       # a _fusion.Fusable: this op may run in one task with others like it
        self.riders = ()       # the other ops of the fused group this op's task runs
        self.wait = None
        self.waiting_since = _monotonic()    # (a task that never waits still waits for its sends)
        self.warned = False
        self.data_requests = []
        self.result = self.error = None
        # held while the op runs: a bare lock is ~10x cheaper to create than an Event
        self._pending = _allocate_lock()
        self._pending.acquire()
        self.done = False      # set before _pending is released (see wait_done)
        self.finished_task = False
        self.coll_seq = None
        self.collective = False   # it will make (or made) an MPI collective call (next_collective)
        self.caller_tid = _get_ident()
        self.inline = False    # submitted unannounced: its synchronize runs the loop (or rings)
        self.reserved = True   # its name is in Engine._names until synchronized
        self.deliver = None    # result -> what synchronize returns (_devices.delivery)
        self.ready = None      # the still running copy of its device input to the host (_devices.py)
        self.completed = False     # _finish does not complete it: see complete_early, split_group
        self.at_shutdown = False   # shutdown's win_free: no op timeout; see _departures.py
        self.freed = None      # called once its handle is synchronized (see submit)
        self.abandoned = False     # its blocking call was interrupted: see synchronize_owned

    def is_done(self):
        return self.done

    def wait_done(self, timeout):
        """True once the op is done. The lock is handed back at once; done is what
        says it, so that a KeyboardInterrupt between taking the lock and handing it
        back (Ctrl-C caught around synchronize) leaves the op done, not in flight."""
        if self.done:
            return True
        if self._pending.acquire(timeout=timeout):
            self._pending.release()
            return True
        return False

    def set_done(self):
        self.done = True
        self._pending.release()


class Engine(CallerDrive, StallInspector):
    def __init__(self, comm, rank, size):
        self.comm, self.rank, self.size = comm, rank, size
        threshold = _env_int("BLUEFOG_FUSION_THRESHOLD", 8 * 1024 * 1024)
        caller_progress = _env_flag("BLUEFOG_CALLER_PROGRESS", True, empty=False)   # (read before any set-up)
        inline = min(threshold, _env_int("BLUEFOG_INLINE_LIMIT", 64 * 1024))
        self.pool = BufferPool(_env_int("BLUEFOG_BUFFER_POOL_BYTES", 256 * 1024 * 1024))
        self.stream = StreamEndpoint(comm, threshold, inline, self.pool)
        self.stall_warning_s = _env_float("BLUEFOG_STALL_WARNING_S", 60.0, infinite_ok=True)
        self.op_timeout_s = _env_float("BLUEFOG_OP_TIMEOUT_S", 0.0, infinite_ok=True)
        self.mark_cycles_env = _env_flag("BLUEFOG_TIMELINE_MARK_CYCLES", False, empty=False)
        self.mark_cycles = self.mark_cycles_env     # timeline_start(mark_cycles=...) sets it per file
        self.yield_window_s = _env_float("BLUEFOG_YIELD_WINDOW_S", 3e-4)
        self.transfer_window_s = _env_float("BLUEFOG_TRANSFER_WINDOW_S", 3e-3)
        self.wait_sleep_max_s = _env_float("BLUEFOG_WAIT_SLEEP_MAX_S", 1e-3)
        self.progress_poke_s = 0.002   # idle MPI poke; windows.py lowers it while windows exist
        self.idle_poke_s = 0.05        # the same with nothing in flight and every peer on this host
        self.wakeups = 0               # times the thread woke from its sleep (tests, benchmarks)
        # queue, names, handles (an RLock: a call from a signal handler that interrupted a
        # thread holding it is told by _is_owned, and refused: see refuse_nested)
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)  # sleeping when there is no doorbell
        self._queue = collections.deque()
        self._ops = {}                 # handle -> Op (until synchronized)
        self._names = set()            # names of ops not yet synchronized
        self._active = set()           # admitted, not finished
        self._polled = set()           # ops checked every cycle (Turn, Requests, Sleep, sends)
        self._completing = []          # finished ops, completed at the next flush
        self._discard = collections.Counter()   # (src, key) -> entries of timed-out ops still to come
        self._waiters = {}             # (src, key) -> op waiting to receive it
        self._coll_seq = 0             # next collective sequence number (comm thread)
        self._coll_next = 0            # lowest collective not yet posted
        self._coll_released = set()
        # name -> why neighbor operations of that name are refused on this agent (ops._refuse)
        self.tainted = {}
        # why MPI collectives can no longer run on this agent (one of them timed out), or None
        self.collectives_broken = None
        # seq -> "KIND 'name'" of the collectives that failed on this agent after the agents
        # agreed on them, before their MPI call (_tasks.mpi_turn)
        self.skipped_collectives = {}
        self._stopping = False
        self._stop_seen = False     # the loop has looked once since stop() began (_sleep)
        self._sleeping = False         # the loop is (about to be) asleep: ring to wake it
        self._rung = False             # a caller has rung since the loop last went to sleep
        self._drive = threading.Lock()  # held by the thread running the loop (see the module doc)
        self._driver = None            # the caller thread holding it (None: the communication thread, or none)
        self._handback = threading.Event()  # a caller let go of the loop and left work in it
        self._quick_hold = False       # the loop is held for a call of _quick.py (its caller never sleeps on the bell)
        self._last_inspect = time.monotonic()
        self.driven_by_callers = 0     # blocking operations whose caller ran the loop
        self.doorbell = Doorbell(comm)
        # blocking calls may run on their caller (needs a bell: the thread must sleep on it)
        self.caller_progress = caller_progress and self.doorbell.sock is not None
        self._caller_status = MPI.Status()   # for the thread holding the drive lock, if not the loop's
        self._thread = threading.Thread(target=self._run, name="bluefog-communication", daemon=True)
        self._thread.start()

    # ---- caller side -----------------------------------------------------
    def submit(self, name, kind, task, fuse=None, inline=False, reserve=True, deliver=None, ready=None,
               freed=None):
        """Enqueue generator ``task`` (created as task(engine, op)) and return its handle.
        ``fuse``: a _fusion.Fusable, if the op may run fused with others of the same key.
        ``inline``: the caller synchronizes at once (a blocking call), so the sleeping
        loop is not rung now: synchronize runs the loop on the caller if it can.
        ``reserve``: the op's messages are keyed by its name, so no other reserving
        op may use the name until it is synchronized (window ops use MPI windows,
        not named messages, and do not reserve).
        ``deliver``: run by synchronize on the result, on the synchronizing thread
        (a device tensor's result goes back to its device: _devices.py).
        ``ready``: the event of the copy of its device input to the host, still
        running; the task waits for it before it reads the input (_devices.copied).
        ``freed``: called without arguments once the handle is synchronized (on the
        synchronizing thread, without the engine's lock; windows.py frees the op's name)."""
        inline = inline and self.caller_progress and tl.current is None
        self.refuse_nested()
        with self._lock:
            if self._stopping:
                raise RuntimeError("bluefog_lite is shutting down; no new operations are accepted")
            if reserve and name in self._names:
                raise ValueError(f"an operation named {name!r} is already in flight on this agent "
                                 "(not yet synchronized); synchronize it before reusing the name")
            op = self._new_op(name, kind, fuse)
            op.inline = inline
            op.reserved = reserve
            op.deliver = deliver
            op.ready = ready
            op.freed = freed
            op.task = task(self, op)
            if reserve:
                self._names.add(name)
            self._ops[op.handle] = op
            if tl.current is not None:
                tl.begin_here(name, "ENQUEUE_" + kind)
            self._queue.append(op)
        if not inline:
            self._ring_if_asleep()
        return op.handle

    def _new_op(self, name, kind, fuse=None):
        """An Op with the next handle (under the lock), its task still to be set."""
        return Op(next(_HANDLES), name, kind, None, fuse)

    def _ring_if_asleep(self):
        if self._sleeping and not self._rung:   # one ring per sleep, not one per operation
            self._rung = True
            self._handback.set()    # (woken while a caller ran the loop, it waits for a hand-back)
            self._wake()

    def _wake(self):
        """Wake the loop from its sleep (see _sleep)."""
        if self.doorbell.sock is not None:
            self.doorbell.wake_self()
        else:
            with self._cv:
                self._cv.notify()

    def _lookup(self, handle):
        if handle.__class__ is not int:
            raise TypeError(f"handle must be the int that a *_nonblocking call returned, got {handle!r}")
        op = self._ops.get(handle)
        if op is None:
            raise ValueError(f"handle {handle!r} is unknown or was already synchronized")
        if not op.done:
            self.refuse_nested()
        return op

    def poll(self, handle):
        op = self._lookup(handle)
        if op.is_done():
            return True
        if self._blocked is not None:       # (a loop of polls sees the warning synchronize would)
            self.blocked_check(op, timeout=False)
        return False

    def synchronize_owned(self, handle):
        """synchronize for a blocking call, the only holder of handle: if it is
        interrupted (a KeyboardInterrupt from a signal handler, caught by the program),
        the operation is abandoned: its result dropped and its name freed once it is
        done (else the name stayed "in flight" for good, with no handle to end it)."""
        try:
            return self.synchronize(handle)
        except BaseException:
            op = self._ops.get(handle)
            if op is not None:          # (else synchronized: its own error)
                self.abandon(op)
            raise

    def abandon(self, op):
        """Nobody will synchronize op (its blocking call was interrupted): it is
        dropped, with its name, once done."""
        op.abandoned = True     # (set before done is read; _flush sets done before reading it)
        if op.done:
            self._forget(op)

    def _forget(self, op):
        """Drop a done op, its name and its handle (once, whoever comes first: its
        synchronize, or _flush/abandon for an abandoned op); False if already dropped."""
        with self._lock:
            if self._ops.pop(op.handle, None) is None:
                return False
            if op.reserved:
                self._names.discard(op.name)
        if op.freed is not None:
            op.freed()
        return True

    def synchronize(self, handle):
        op = self._lookup(handle)
        if op.inline:
            op.inline = False
            if not op.is_done() and not self._drive_until(op):
                self._ring_if_asleep()      # the loop is running: it sees the op (or is rung)
        while not op.wait_done(0.5):
            if not self._thread.is_alive():
                raise RuntimeError("the bluefog_lite communication thread has died")
            self.blocked_check(op)
        if not self._forget(op):      # another thread synchronized it meanwhile
            raise ValueError(f"handle {handle!r} is unknown or was already synchronized")
        if op.error is not None:
            raise op.error
        return op.result if op.deliver is None else op.deliver(op.result)

    def has_pending(self):
        with self._lock:
            return any(not op.is_done() for op in self._ops.values())

    def stop(self):
        """Let in-flight operations finish (bounded by the stall warning time), then stop."""
        with self._lock:
            self._stopping = True
        self._wake()
        self._thread.join(min(max(self.stall_warning_s, 1.0), threading.TIMEOUT_MAX))
        _ABANDONED.extend(self.stream.failed_sends)
        if self._thread.is_alive():
            with self._lock:     # (done but never synchronized is not in flight)
                unfinished = sorted({op.name for op in self._ops.values() if not op.is_done()})
            sending = self._split_groups_sending()
            sys.stderr.write(f"bluefog_lite WARNING (rank {self.rank}): shutdown with operations "
                             f"still in flight: {unfinished}"
                             + (f" (and the sends of the split fused group {sending})" if sending else "") + "\n")
            return
        try:
            self.report_untaken(self._caller_status)
        except Exception as exc:    # a diagnostic must not break shutdown
            sys.stderr.write(f"bluefog_lite WARNING (rank {self.rank}): could not check for untaken "
                             f"data at shutdown: {exc!r}\n")
        self.doorbell.close()
        retire(self.comm)

    def drop_memory(self):
        """After stop(), once the thread has ended: let go of the buffer pool, data
        received and results never synchronized (the stopped engine is kept for
        calls that race with shutdown, until the next init())."""
        if self._thread.is_alive():
            return
        self.pool.clear()
        self.stream.inbox.clear()
        with self._lock:
            self._ops.clear()

    # ---- helpers used by tasks (comm thread) ------------------------------
    def send_tensor(self, op, dst, key, out):
        """Queue Outgoing out (see _stream.py) for dst under key."""
        self.stream.queue_tensor(dst, key, out, op.data_requests)

    def keep_sending(self, data_requests):
        """Large sends of a call that failed (an error in its task, a timeout, the
        quick path): MPI reads their memory until a receiver takes them, so their
        tensors are kept alive until then (a scaled copy has no other owner, and the
        caller may free its input at once). Unlike the packets in flight they do not
        hold up shutdown: a receiver may never come (_ABANDONED)."""
        self.stream.failed_sends.extend(data_requests)

    def send_object(self, dst, key, obj):
        self.stream.queue_object(dst, key, obj)

    def send_to_others(self, key, obj):
        """send_object to every other agent (a word about a collective)."""
        for r in range(self.size):
            if r != self.rank:
                self.stream.queue_object(r, key, obj)

    def next_collective(self, op, mpi_call=False):
        """op's place in the agents' sequence of collectives; mpi_call: it will make an
        MPI collective call (allreduce, broadcast, allgather, a window's allocation),
        which must pair with the same call on every agent (see collectives_broken)."""
        if mpi_call and self.collectives_broken is not None:
            raise RuntimeError(f"{op.kind} {op.name!r} cannot run: {self.collectives_broken}")
        op.collective = mpi_call
        op.coll_seq = self._coll_seq
        self._coll_seq += 1
        return op.coll_seq

    def posted_collective(self, op):
        """The op has made its MPI collective call; later collectives may go."""
        if op.coll_seq is None:
            return
        self._coll_released.add(op.coll_seq)
        op.coll_seq = None
        while self._coll_next in self._coll_released:
            self._coll_released.discard(self._coll_next)
            self._coll_next += 1

    # ---- the loop ---------------------------------------------------------
    def _run(self):
        torch.set_grad_enabled(False)   # thread-local: nothing done here is differentiated
        with self._drive:                # released only while the thread sleeps (_sleep)
            self._loop(MPI.Status())

    def _loop(self, status):
        idle_since = time.monotonic()
        while True:
            moved, now = self._cycle(status)
            if moved:
                idle_since = now
                continue
            if self._stopping and not self._active and not self._queue and not self._sends_pending():
                return
            if self._sleep(now - idle_since, status):
                idle_since = time.monotonic()

    def _cycle(self, status):
        """One pass of the loop, by whichever thread holds the drive lock: admit what
        was queued, make progress, inspect stalls every INSPECT_EVERY_S. Returns
        (whether anything moved, the time after the pass)."""
        marked = False
        if self._queue:
            if self.mark_cycles:    # before the work: the caller may stop the timeline once it is done
                tl.instant("cycle", "CYCLE_START")
                marked = True
            moved = self._admit()
        else:
            moved = False
        if self._progress(status):
            moved = True
        if self.mark_cycles and moved and not marked:
            tl.instant("cycle", "CYCLE_START")
        now = time.monotonic()
        if now - self._last_inspect > INSPECT_EVERY_S:
            self._inspect_stalls(now)
            self._flush()
            self._last_inspect = now
        return moved, now

    def _expects_news(self):
        """True while something in flight needs news from peers: active operations,
        sends and receives. An idle agent asks to be rung only for large tensors'
        descriptors (_doorbell.py): other data of operations it has not started can
        wait in MPI until they start; its callers wake it directly."""
        return bool(self._active or self._completing or self._sends_pending())

    def _sleep(self, waited, status, caller=False):
        """Wait for the next poll; True if the last look before sleeping found work.

        While operations are active, first yield the CPU for a short window
        (replies take ~0.1-0.3 ms, and a sleep costs a cold wake-up: with 2 agents
        on 2 cores, 4 KB ops took 0.8 ms sleeping at once, 0.25 ms yielding first).
        Then, if progress needs MPI calls (receives or collectives in flight, or
        peers on other hosts, which cannot ring): sleep a quarter of the time
        waited so far (detection adds <= 25%), at most wait_sleep_max_s. Otherwise
        sleep until rung (a peer sent something or took what this agent sent, a
        caller enqueued), with a slow MPI poke (progress_poke_s) as a safety net;
        an agent with nothing in flight whose peers can all ring it pokes far less
        often (idle_poke_s): the 2 ms poke cost an idle agent ~3% of a core.
        The sleep flag goes up before the last look for work, so that a peer
        either sees it and rings or has left what the look finds.

        The communication thread lets go of the drive lock while it sleeps; a caller
        running the loop (``caller``) keeps it, and restores the thread's sleeping
        state when it wakes."""
        backoff_ends = self._backoff_ends()
        if backoff_ends is None and waited < self.yield_window_s and (self._active or self.stream.pending_recvs):
            _yield()     # stay on the CPU a moment: a sleep costs a cold wake-up
            return False
        bell = self.doorbell
        news = self._expects_news()
        if backoff_ends is not None:
            timeout = min(self.wait_sleep_max_s, max(0.0, backoff_ends - _monotonic()))
        elif self._needs_polling():
            timeout = min(self.wait_sleep_max_s, max(5e-5, waited / 4))
        elif news or self.stream.unposted or not bell.covers_all:
            timeout = self.progress_poke_s
        else:
            timeout = self.idle_poke_s   # idle, and every peer can ring: the poke is only a safety net
        thread_asleep = self._sleeping    # True only for a caller while the thread sleeps
        self._rung = False
        self._sleeping = True     # set before looking at the queue: a submit after the look rings
        bell.asleep(ANYTHING if news else URGENT_ONLY)
        try:
            # (two probes: a peer that found the flag down skipped its ring, and one
            # MPICH probe may miss what it sent, see StreamEndpoint.receive)
            if self._queue or self._progress(status, 2):
                return True
            if self._stopping and not self._stop_seen:
                # once, so that stop()'s wake is not slept through; after that the loop
                # sleeps as usual while operations still in flight finish (or not)
                self._stop_seen = True
                return True
            if caller:
                bell.wait(timeout)
                return False
            self._drive.release()
            if bell.sock is None:
                try:
                    with self._cv:
                        if not self._queue and not (self._stopping and not self._stop_seen):
                            self._cv.wait(timeout)
                finally:
                    self._drive.acquire()
                return False
            self._sleep_on_bell(timeout)
            return False
        finally:
            bell.asleep(0)
            self._sleeping = thread_asleep

    def _sleep_on_bell(self, timeout):
        """The communication thread's sleep; returns holding the drive lock. Woken
        while a caller runs the loop, it leaves the bell to that caller (the ring may
        be for it, about to sleep on it) and waits for the caller to hand the loop
        back (or for timeout, then looks again): taking the lock whenever the caller
        lets go would take the caller's next operation from it.

        A caller holding the loop for a call of _quick.py never sleeps on the bell, so
        the ring is not its: a neighbor's descriptor for the caller's next call, come
        between two calls (an idle agent is rung for those), which that call receives.
        Left in the socket, it kept this thread looking every 2 ms through a loop of
        blocking calls until it took the loop in a gap between two of them (and the
        next call went the general way); it is drained instead. A caller holding the
        loop makes the progress a poke would and hands the loop back when it leaves
        anything in flight or announced (_let_go), so while it holds the loop, the
        thread sleeps on the bell as long as an idle one: rings that come once the
        caller has let go wake it. (A descriptor that rang it and that the caller's
        call did not receive, taking inputs that were in already, waits for that
        sleep, the idle poke, if the caller makes no call meanwhile.)"""
        bell, drive = self.doorbell, self._drive
        rung = bell.wait(timeout, drain=False)
        self.wakeups += 1
        while not drive.acquire(False):
            if rung and self._quick_hold:
                bell.drain()
                rung = False
            if rung:     # (the caller's rings meanwhile wait in the socket)
                self._handback.wait(min(timeout, self.progress_poke_s))
                self._handback.clear()
                rung = bell.wait(0, drain=False)
            else:
                rung = bell.wait(self.idle_poke_s if bell.covers_all else timeout, drain=False)
                self.wakeups += 1
        bell.drain()

    def _backoff_ends(self):
        """When the active operations wait only for backoffs (Sleep: a window mutex
        another agent holds, a window op's turn) or for their collective's turn, with
        nothing being received and every peer able to ring: the end of the first
        backoff, which the loop can sleep until. None otherwise. (Each backoff that
        ended and began again counted as progress: the loop spun through its yield
        window and short sleeps every retry, a quarter of a core per waiting agent.)"""
        if not self._active or self.stream.pending_recvs or not self.doorbell.covers_all:
            return None
        first = None
        for op in self._active:
            if op.finished_task:
                return None
            w = op.wait
            if w.__class__ is Sleep:
                if first is None or w.until < first:
                    first = w.until
            elif w.__class__ is not Turn:
                return None
        return first

    def _needs_polling(self):
        """True while progress depends on MPI calls that no ring announces: data
        being received, collectives and timed waits, peers the bell cannot reach.
        Sends are not among them: the receiver rings back when it has taken them."""
        s = self.stream
        if s.pending_recvs:
            return True
        if not self.doorbell.covers_all:
            return bool(self._active) or bool(s.sent_packets)
        for op in self._polled:
            if not op.finished_task and not isinstance(op.wait, Turn):
                return True
        return False

    def _sends_pending(self):
        return bool(self.stream.sent_packets or self.stream.pending_recvs)

    def _admit(self):
        q, s = self._queue, self.stream
        if q and q[-1].fuse is not None and s.fusion_threshold and self._thread.ident == _get_ident():
            _fusion.settle(q)
        with self._lock:
            new, self._queue = list(self._queue), collections.deque()
        if tl.current is not None:
            for op in new:
                tl.begin(op.name, "MPI_" + op.kind)
        if len(new) > 1:
            new = _fusion.group(self, new, s.fusion_threshold, s.inline_limit, s.stats)
        for op in new:
            self._active.add(op)
            self._step(op, None)
        self._flush()
        return True

    def _flush(self):
        """Send what the tasks queued, ring the peers that were sent something, and
        complete the operations that finished (their inputs are in packets now)."""
        s = self.stream
        sent = s.flush_all()
        if s.to_ring:
            self.ring_peers()
        if self._completing:
            done, self._completing = self._completing, []
            recording = tl.current is not None
            for op in done:
                if recording:
                    tl.end(op.name, None, "MPI_" + op.kind)    # (a window may share the name)
                    # before set_done(): the caller may resubmit the name as soon as it wakes
                    tl.end(op.name, op.caller_tid, "ENQUEUE_" + op.kind)
                op.set_done()
                if op.abandoned:
                    self._forget(op)
        return sent

    def ring_peers(self):
        """Ring the peers that were sent something (or whose data came in) since the last ring."""
        s = self.stream
        ring, urgent = self.doorbell.ring, s.urgent
        for r in s.to_ring:
            ring(r, r in urgent)
        s.to_ring.clear()
        urgent.clear()

    def _progress(self, status, looks=1):
        s = self.stream
        moved = s.receive(status, looks)
        if s.pending_recvs and s.test_recvs():
            moved = True
        if s.sent_packets:
            s.test_sends()
        if s.failed_sends:
            s.failed_sends = [(r, t) for r, t in s.failed_sends if not r.Test()]
        if s.arrived:
            # only operations that something arrived for are looked at
            arrived, s.arrived = s.arrived, []
            woken = {}     # each op once (a fused group waits for many keys), in order
            discard, waiters = self._discard, self._waiters
            for key in arrived:
                if discard and key in discard:
                    self._drop_stale(key)
                    if key in discard:     # a stale one is still on its way: nothing to take yet
                        continue
                op = waiters.get(key)
                if op is not None:
                    woken[op] = None
            for op in woken:
                if op.wait.__class__ is Recv and self._resume_if_received(op):
                    moved = True
        if self._polled:
            for op in list(self._polled):
                if self._advance(op):
                    moved = True
        if s.unposted and _posting.post_receives(s, self._waiters, self._discard):
            moved = True
        if (s.outboxes or s.to_ring or self._completing) and self._flush():
            moved = True
        return moved

    def _take_all(self, keys):
        """The entries for every (src, key), or None while any is missing."""
        inbox = self.stream.inbox
        queues = []
        for k in keys:      # inlined StreamEndpoint.has/take: a fused group waits for many keys
            q = inbox.get(k)
            if not q or not q[0].ready:
                return None
            queues.append(q)
        entries = [q.popleft() for q in queues]
        for k, q in zip(keys, queues):
            if not q:
                inbox.pop(k, None)
        return entries

    def _resume_if_received(self, op):
        value = self._take_all(op.wait.keys)
        if value is None:
            return False
        _drain(map(self._waiters.pop, op.wait.keys, itertools.repeat(None)))
        op.wait = None      # no longer waiting: _finish has no waiters to forget
        self._step(op, value)
        return True

    def _advance(self, op):
        """Resume a polled op (Turn, Requests, Sleep) if ready; finish an op whose
        sends are done."""
        if op.finished_task:
            if op.data_requests:     # (the ones still pending: their receivers, for Departures)
                op.data_requests = [sent for sent in op.data_requests if not sent[0].Test()]
                if op.data_requests:
                    return False
            self._finish(op)
            return True
        w = op.wait
        if isinstance(w, Turn):
            if self._coll_next != w.seq:
                return False
        elif isinstance(w, Requests):
            if not MPI.Request.Testall(w.reqs):
                return False
        elif isinstance(w, Sleep):
            if time.monotonic() < w.until:
                return False
        elif isinstance(w, Until):
            if not w.ready():
                return False
        self._polled.discard(op)
        self._step(op, None)
        return True

    def _step(self, op, value):
        """Run op's task until it waits for something that is not there yet."""
        while True:
            try:
                w = op.task.send(value)
            except StopIteration as stop:
                op.result = stop.value
                op.finished_task = True
                op.wait = None      # (a Recv met at once in this loop would stay: the op was split later)
                op.waiting_since = _monotonic()    # now for its sends, if any are left
                if not self._advance(op):
                    self._polled.add(op)    # its large sends are still in flight
                return
            except BaseException as exc:  # delivered to the caller by synchronize()
                op.error = exc
                self._finish(op)
                return
            op.wait = w
            op.waiting_since = _monotonic()
            op.warned = False
            if w.__class__ is not Recv:
                self._polled.add(op)
                return
            value = self._take_all(w.keys)
            if value is None:
                self._waiters.update(zip(w.keys, itertools.repeat(op)))
                return

    def _finish(self, op):
        op.finished_task = True
        if op.error is not None and op.data_requests:
            self.keep_sending(op.data_requests)
        op.data_requests = []
        if op.coll_seq is not None:
            self.posted_collective(op)
        self._active.discard(op)
        self._polled.discard(op)
        if op.wait.__class__ is Recv:     # finished while waiting (an error, a timeout)
            for k in op.wait.keys:
                if self._waiters.get(k) is op:
                    del self._waiters[k]
        # Completed only after the next flush: until then small inputs are queued
        # by reference (copied into the packet at flush), and a woken caller may
        # change its input at once.
        if not op.completed:
            self._completing.append(op)
        for rider in op.riders:
            if rider.completed:
                continue
            if rider.result is None and rider.error is None:
                rider.error = op.error     # the group failed before this member's result
            rider.finished_task = True
            self._completing.append(rider)

    def _split_groups_sending(self):
        """The member names of split fused groups whose runner still sends (a snapshot
        from another thread while the loop runs: empty if it changed meanwhile)."""
        try:
            return sorted({m.name for op in list(self._active) if op.completed for m in op.riders})
        except RuntimeError:      # (the set changed during the copy)
            return []

    def complete_early(self, op):
        """Complete op (result or error set), a member of a split fused group whose
        task goes on for the other members (_neighbor_tasks._one_by_one)."""
        op.completed = op.finished_task = True
        self._completing.append(op)

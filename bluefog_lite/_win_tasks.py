"""What window operations do on the communication thread: MPI RMA on one
``Win.Allocate`` window per bluefog window, in one passive-target epoch.

Memory of one agent's window (byte offsets, ``k`` = its in-degree in the topology
the window was created with)::

    0                 mutex word (int64: 0 free, else holder rank + 1)
    8 .. 8+8k         versions[i]: puts/accumulates in-neighbor i made since the last read
    8+8k ..           p[0] (own push-sum weight), p[1+i] (weight that came with buffer i),
                      then the exposed p (p[0] when the exposed copy was taken), float64
    data              the *exposed copy* of the agent's window tensor (read by win_get)
    data + (1+i)*slot buffer i: what in-neighbor ``in_ranks[i]`` wrote

Why this shape (see ../shared/LIMITS.md point 3): ``Win.Allocate`` memory is shared memory
between agents of one host, and with ``Lock_all(MODE_NOCHECK)`` taken once at
creation a put, an accumulate, a flush and the atomics of the mutex need no MPI
call from the target at all. Off-host, the target's communication thread drives
progress with its idle poke (lowered to 1 ms while windows span hosts). No call here waits on
another agent for long, except ``Win.Allocate``/``Win.Free`` which are collective
and negotiated first.
"""
import sys
import threading
import time
import weakref

import numpy as np
import torch

from ._arguments import _fits_scaled
from ._stalls import OpTimeout
from ._waits import Requests, Sleep
from ._mpi import MPI
from ._stream import copy_into, plain
from ._neighbor_tasks import scaled
from ._tasks import _phase, exchange_headers, failed_everywhere, mpi_turn, skipped_collective, weighted_sum

MPI_TYPES = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int8: MPI.INT8_T,
             torch.int16: MPI.INT16_T, torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T,
             torch.uint8: MPI.UINT8_T, torch.complex64: MPI.C_FLOAT_COMPLEX,
             torch.complex128: MPI.C_DOUBLE_COMPLEX}
# MPI cannot add 16-bit floats (MPI_Accumulate): windows of float16 and bfloat16
# tensors keep their buffers and exposed copy in float32 (twice the memory; sums
# of many accumulates keep their precision), converted on the way in and out.
STORED_AS = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
DTYPES = set(MPI_TYPES) | set(STORED_AS)
_ALIGN = 64
_ONE = np.ones(1, np.int64)
_ZERO = np.zeros(1, np.int64)
_FETCHED = np.zeros(1, np.int64)   # result of the counter updates below (not read)


def _atomic(win, value, rank, disp, op):
    """Atomically update one int64 counter. Fetch_and_op, not Accumulate: the pip
    MPICH keeps ~128 B per int64 Accumulate to another agent, never freed."""
    win.Fetch_and_op([value, MPI.INT64_T], [_FETCHED, MPI.INT64_T], rank, disp, op)


def _aligned(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Layout:
    """Byte offsets inside the window memory of an agent with in-degree k."""
    __slots__ = ("k", "slot", "data", "size")

    def __init__(self, k, nbytes):
        self.k = k
        self.slot = _aligned(nbytes)
        self.data = _aligned(8 + 8 * k + 8 * (k + 2))
        self.size = self.data + (k + 1) * self.slot

    @staticmethod
    def version(i):
        return 8 + 8 * i

    def p(self, i):
        """Offset of p[i]: i = 0 own weight, 1 + j the weight of buffer j."""
        return 8 + 8 * self.k + 8 * i

    def exposed_p(self):
        """Offset of the p that goes with the exposed copy (what win_get reads)."""
        return self.p(self.k + 1)

    def buf(self, i):
        return self.data + (i + 1) * self.slot


class Window:
    """One window as both threads see it. Fixed at creation: the tensor, its
    shape/dtype, the topology (neighbors, default weights, everyone's in-degree)."""

    def __init__(self, name, tensor, topology, rank, size, device_tensor=None):
        self.name, self.tensor, self.rank = name, tensor, rank
        # a window of a tensor on an accelerator: tensor is a host copy of it, replaced
        # by a fresh copy (taken at the call) by each win_get and win_update
        self.device_tensor = device_tensor
        self.dtype, self.shape = tensor.dtype, tuple(tensor.shape)
        self.stored = STORED_AS.get(tensor.dtype, tensor.dtype)    # the buffers' dtype
        self.nbytes = tensor.numel() * self.stored.itemsize
        self.mpi_type = MPI_TYPES[self.stored]
        G = topology.graph
        ins = {r: sorted(s for s in G.predecessors(r) if s != r) for r in range(size)}
        self.in_ranks, self.out_ranks = list(topology.in_ranks), list(topology.out_ranks)
        self.in_index = {r: i for i, r in enumerate(self.in_ranks)}
        self.self_weight, self.src_weights = topology.self_weight, dict(topology.src_weights)
        self.layouts = [Layout(len(ins[r]), self.nbytes) for r in range(size)]
        self.slot_at = {dst: ins[dst].index(rank) for dst in self.out_ranks}
        self.layout = self.layouts[rank]
        self.win = None
        self.held = {}          # rank -> hold count of its mutex (communication thread only)
        self.handles = {}       # k -> handle of this window's unsynchronized op named name#k (caller side)
        self.free_numbers = []  # heap of the numbers k given back, below the largest given (windows._submit)
        # held while a caller names and enqueues an op (re-entrant: see Engine._lock)
        self.submitting = threading.RLock()
        self.mutex_blocks = 0   # win_mutex with-blocks of this agent now inside (caller side)
        self.tickets = 0        # next ticket (taken under the engine's queue lock): program order
        self.serving = 0        # lowest ticket not yet finished (communication thread)
        self._finished = set()
        self.memory = threading.Lock()     # held while the MPI memory is freed (get_win_version reads it)
        self.versions = self.p = self.exposed = self.exposed_p = None
        self.buffers = []

    def take_ticket(self):
        t, self.tickets = self.tickets, self.tickets + 1
        return t

    def finish(self, ticket):
        self._finished.add(ticket)
        while self.serving in self._finished:
            self._finished.discard(self.serving)
            self.serving += 1

    def attach(self, win):
        self.win = win
        lay = self.layout
        mem = np.frombuffer(win.tomemory(), dtype=np.uint8)
        self.versions = mem[8:8 + 8 * lay.k].view(np.int64)
        self.p = mem[lay.p(0):lay.p(lay.k + 1)].view(np.float64)
        self.exposed_p = mem[lay.exposed_p():lay.exposed_p() + 8].view(np.float64)
        np_dtype = torch.empty(0, dtype=self.stored).numpy().dtype

        def view(off):
            return torch.from_numpy(mem[off:off + self.nbytes].view(np_dtype)).view(self.shape)
        self.exposed = view(lay.data)
        self.buffers = [view(lay.buf(i)) for i in range(lay.k)]

    def detach(self):
        """Drop every view of the MPI memory before it is freed."""
        self.versions = self.p = self.exposed = self.exposed_p = None
        self.buffers = []
        self.win = None


def in_order(win, ticket, task):
    """Run generator ``task`` after every earlier op of this window has finished, so
    that e.g. a nonblocking put and a following accumulate land in program order."""
    try:
        while win.serving != ticket:
            yield Sleep(5e-5, f"earlier operations of this agent on window {win.name!r}")
        if win.win is None:     # (another thread's win_free ran first)
            raise ValueError(f"window {win.name!r} was freed (win_free) before this operation on it ran")
        return (yield from task)
    finally:
        win.finish(ticket)


# ---- small RMA helpers (all on the communication thread) ---------------------------

def _wait_local(req, what):
    if not req.Test():
        yield Requests([req], what)


def _reset_versions(win, indices):
    """Zero my version counters with MPI atomics (remote increments are atomics too);
    returns a function that adds the counts taken back (the data was not used)."""
    taken = np.zeros(len(indices), np.int64)
    for j, i in enumerate(indices):
        win.win.Fetch_and_op([_ZERO, MPI.INT64_T], [taken[j:j + 1], MPI.INT64_T], win.rank, Layout.version(i),
                             MPI.REPLACE)
    if indices:
        win.win.Flush(win.rank)

    def give_back():
        for j, i in enumerate(indices):
            _atomic(win.win, taken[j:j + 1], win.rank, Layout.version(i), MPI.SUM)
        if indices:
            win.win.Flush(win.rank)
    return give_back


def _publish(win):
    """Refresh the exposed copy that neighbors' win_get reads, and the p that goes
    with it (a put's self_weight scales p and the tensor, not the exposed copy)."""
    if win.nbytes:
        t = win.tensor.detach()
        win.exposed.copy_(t.resolve_neg() if t.is_neg() else t)    # (a cast ignores the neg bit: see copy_into)
    win.exposed_p[0] = win.p[0]
    win.win.Sync()      # local stores visible to RMA readers (separate memory model)


# ---- the distributed mutex ----------------------------------------------------------

def _cas(win, target, compare, value):
    origin = np.array([value], np.int64)
    expect = np.array([compare], np.int64)
    result = np.zeros(1, np.int64)
    win.win.Compare_and_swap([origin, MPI.INT64_T], [expect, MPI.INT64_T], [result, MPI.INT64_T],
                             target, 0)
    win.win.Flush(target)
    return int(result[0])


def acquire(eng, win, ranks):
    """Take the mutex word of ``win`` at each rank, in ascending order (so that agents
    taking several never deadlock). Compare-and-swap, then a sleeping exponential
    backoff while someone else holds it; re-entrant per agent. On failure (timeout,
    the op closed) the mutexes taken so far are given back."""
    taken = []
    try:
        for r in sorted(ranks):
            if not win.held.get(r):
                yield from _take(eng, win, r)
            win.held[r] = win.held.get(r, 0) + 1
            taken.append(r)
    except BaseException:
        release(win, taken)
        raise


def _take(eng, win, r):
    me = win.rank
    start, delay, warned = time.monotonic(), 2e-5, False
    while True:
        holder = _cas(win, r, 0, me + 1)
        if holder == 0:
            return
        waited = time.monotonic() - start
        what = f"the mutex of window {win.name!r} on rank {r} (held by rank {holder - 1})"
        if not warned and waited > eng.stall_warning_s:
            warned = True
            sys.stderr.write(f"bluefog_lite WARNING (rank {me}): waited {waited:.1f} s for {what}\n")
            sys.stderr.flush()
        if eng.op_timeout_s > 0 and waited > eng.op_timeout_s:
            raise OpTimeout(f"rank {me} timed out after {waited:.1f} s waiting for {what} "
                            f"(BLUEFOG_OP_TIMEOUT_S={eng.op_timeout_s:g})")
        yield Sleep(delay, what)
        delay = min(delay * 2, 1e-3)


def release(win, ranks):
    for r in sorted(ranks, reverse=True):
        win.held[r] -= 1
        if win.held[r] == 0:
            del win.held[r]
            _atomic(win.win, _ZERO, r, 0, MPI.REPLACE)
            win.win.Flush(r)


def _locked(eng, op, win, ranks, require):
    """Acquire when required; returns the ranks to release."""
    if not require or not ranks:
        return []
    with _phase(op.name, "ACQUIRE_MUTEX"):
        yield from acquire(eng, win, ranks)
    return list(ranks)


def mutex_acquire(eng, op, win, ranks):
    with _phase(op.name, "ACQUIRE_MUTEX"):
        yield from acquire(eng, win, ranks)
    return True


def mutex_release(eng, op, win, ranks):
    release(win, ranks)
    return True
    yield  # unreachable: makes this a generator, the form of every task


# ---- collective: create, free ---------------------------------------------------------

def _raise_problems(op, views, own_failure=None):
    """views[r][0]: None or (error type name, message) of agent r's bad input, or of a
    step that failed there before the agents agreed (own_failure: this agent's)."""
    problems = [(r, v[0]) for r, v in enumerate(views) if v[0] is not None]
    if not problems:
        return
    kinds = {kind for _, (kind, _) in problems}
    listing = [(r, msg) for r, (_, msg) in problems]
    if kinds <= {"TypeError", "ValueError"}:
        raise failed_everywhere(op.kind.lower(), listing, TypeError if problems[0][1][0] == "TypeError"
                                else ValueError) from own_failure
    raise failed_everywhere(op.kind.lower(), listing, RuntimeError, "a failure on some of them") from own_failure


def failed_doing(exc, doing):
    return type(exc).__name__, f"{type(exc).__name__} while {doing}: {exc}"


_dropped = []      # MPI windows of a win_create that failed after the allocation (see create)
_hosts_spanned = weakref.WeakKeyDictionary()    # engine -> do its agents span several hosts?


def _spans_hosts(eng):
    """Collective the first time (every agent creates its first window together)."""
    if eng not in _hosts_spanned:
        local = eng.comm.Split_type(MPI.COMM_TYPE_SHARED)
        _hosts_spanned[eng] = local.Get_size() < eng.size
        local.Free()
    return _hosts_spanned[eng]


def create(eng, op, win, problem, meta, zero_init, cause=None):
    """problem: None or (error type name, message) found by this agent's checks
    (cause: the exception behind it, if one was raised: the error is raised from it).
    Returns whether the agents span several hosts (then targets need progress pokes).
    Whatever can fail here without MPI failing runs before the agents agree (the
    copy that fills the buffers: a failure is negotiated like bad input), or is
    told to the others at the closing reduction: then every agent drops the new
    window and raises (an agent that raised alone left the others in that call)."""
    own, failure = None, cause
    if problem is None and not zero_init and win.nbytes:
        try:
            own = plain(win.tensor).to(win.stored)   # buffers start as copies of it (as in Bluefog)
        except Exception as exc:        # (MemoryError)
            failure, problem = exc, failed_doing(exc, "copying the tensor into the buffers")
    views = yield from exchange_headers(eng, op, (problem, meta), mpi_call=True)
    _raise_problems(op, views, failure)
    if len({v[1] for v in views}) != 1:
        listing = ", ".join(f"rank {r}: {v[1][0]!r} {v[1][1]}{list(v[1][2])}" for r, v in enumerate(views))
        raise ValueError(f"win_create: agents passed different windows ({listing}); every agent must "
                         "create the window with the same name and a tensor of the same shape and dtype")
    yield from mpi_turn(eng, op)
    locked = False
    with _phase(op.name, "ALLOCATE_OUTPUT"):
        try:
            with eng.blocking_call(op, f"MPI_Win_allocate of window {win.name!r}, a collective call that "
                                                 "every agent makes"):
                multi_host = _spans_hosts(eng)
                mpi_win = MPI.Win.Allocate(win.layout.size, 1, comm=eng.comm)
        except BaseException as exc:    # (MPI failed here: the others may wait in that call)
            skipped_collective(eng, op, exc)
            raise
        try:
            win.attach(mpi_win)
            mpi_win.Lock_all(MPI.MODE_NOCHECK)
            locked = True
            win.versions[:] = 0
            win.p[:] = 0.0      # the buffers' p, as in Bluefog (also without zero_init)
            win.p[0] = 1.0
            np.frombuffer(mpi_win.tomemory(), dtype=np.uint8)[:8] = 0     # the mutex word
            _publish(win)
            for b in win.buffers:
                if own is None:
                    b.zero_()
                else:
                    b.copy_(own)
        except Exception as exc:
            failure = exc
    with _phase(op.name, "COMMUNICATE"):
        # nobody puts into a window before every agent has filled its buffers; one
        # that could not says so here (one flag per agent)
        failed = np.zeros(eng.size, np.int32)
        failed[eng.rank] = failure is not None
        req = eng.comm.Iallreduce(MPI.IN_PLACE, failed, op=MPI.MAX)
        eng.posted_collective(op)
        yield Requests([req], "MPI_Iallreduce closing win_create")
    if failed.any():
        # Every agent drops the window. Its MPI memory is not freed: MPI_Win_free is a
        # blocking collective, which an agent that timed out in the reduction above
        # would never join. (Rare: what is left to fail here after the allocation is
        # MPI itself; the copy that could run out of memory comes before the agreement.)
        win.detach()
        if locked:
            mpi_win.Unlock_all()
        _dropped.append(mpi_win)
        bad = [(r, failed_doing(failure, "filling the window's memory")[1] if r == eng.rank else
                "it failed filling the window's memory") for r in np.flatnonzero(failed).tolist()]
        raise failed_everywhere(op.kind.lower(), bad, RuntimeError, "a failure on some of them (the window was "
                                "dropped; its MPI memory stays allocated until the job ends)") from failure
    return multi_host


def free(eng, op, wins, names, problem):
    views = yield from exchange_headers(eng, op, (problem, names), mpi_call=True)
    _raise_problems(op, views)
    if len({tuple(v[1]) for v in views}) != 1:
        listing = ", ".join(f"rank {r}: {list(v[1])}" for r, v in enumerate(views))
        raise ValueError(f"win_free: agents asked to free different windows ({listing}); "
                         "every agent must free the same windows")
    # operations of another thread that started before this free finish first (later
    # ones find the window gone: in_order)
    started = [(w, w.tickets) for w in wins]
    while any(w.serving < t for w, t in started):
        yield Sleep(5e-5, "this agent's operations on the windows being freed")
    yield from mpi_turn(eng, op)
    with _phase(op.name, "COMMUNICATE"):
        for w in wins:
            with w.memory:
                mpi_win = w.win
                w.detach()
                mpi_win.Unlock_all()
                with eng.blocking_call(op, f"MPI_Win_free of window {w.name!r}, a collective call that every "
                                          "agent makes"):
                    mpi_win.Free()      # every agent has passed the negotiation
    eng.posted_collective(op)
    return True


# ---- put / accumulate / get / update ------------------------------------------------------

def put(eng, op, win, user_tensor, x, dst_weights, self_weight, require_mutex, accumulate, with_p):
    """Write (or add) dst_weights[d] * x into my buffer at each d; then scale my tensor
    (and p) by self_weight. Versions are bumped only after the data has landed. A host
    x is the user's tensor, read now (a strided one copied now): what the window's
    earlier ops left in it, as their self_weight scaled it."""
    targets = sorted(dst_weights)
    locked = yield from _locked(eng, op, win, targets, require_mutex)
    try:
        if user_tensor is not None:
            x = plain(x)
        # (before anything is sent; only integer windows can wrap around)
        _fits_scaled(x, [*dst_weights.values(), self_weight], f"{op.kind.lower()} into window {win.name!r}")
        with _phase(op.name, "COMMUNICATE"):
            p_self, keep = float(win.p[0]), []
            if win.nbytes and x.dtype != win.stored:
                x = x.to(win.stored)        # a float16/bfloat16 window (STORED_AS)
            # every copy allocated before the first transfer: a failure after one would leave
            # the data on some targets, their versions not bumped and the sender's weights
            # not applied (push-sum mass created)
            scaled_by = _scaled_copies(x, [dst_weights[d] for d in targets]) if win.nbytes else None
            sent = []
            try:
                for dst in targets:
                    w, lay, i = dst_weights[dst], win.layouts[dst], win.slot_at[dst]
                    if win.nbytes:
                        src = scaled_by(w).numpy()
                        keep.append(src)        # alive until the flush below
                        if accumulate:
                            req = win.win.Raccumulate([src, win.mpi_type], dst, target=lay.buf(i), op=MPI.SUM)
                        else:
                            req = win.win.Rput([src, win.mpi_type], dst, target=lay.buf(i))
                        sent.append(dst)
                        yield from _wait_local(req, f"MPI_Rput to rank {dst}")
                    if with_p:
                        pv = np.array([p_self * w])
                        keep.append(pv)
                        if accumulate:
                            win.win.Accumulate([pv, MPI.DOUBLE], dst, target=lay.p(1 + i), op=MPI.SUM)
                        else:
                            win.win.Put([pv, MPI.DOUBLE], dst, target=lay.p(1 + i))
            except BaseException as exc:
                if sent:
                    exc.add_note(f"{op.kind.lower()} into window {win.name!r} had sent to ranks {sent} when it "
                                 f"failed (their versions not bumped; self_weight not applied); "
                                 f"ranks {targets[len(sent):]} got nothing")
                raise
            if targets:
                win.win.Flush_all()
                for dst in targets:
                    _atomic(win.win, _ONE, dst, Layout.version(win.slot_at[dst]), MPI.SUM)
                win.win.Flush_all()
    finally:
        release(win, locked)
    if self_weight is not None:
        if user_tensor is not None:     # (None: a device tensor, scaled by its caller)
            scale_in_place(user_tensor.detach(), self_weight)
        if with_p:
            win.p[0] *= self_weight
    return True


def _scaled_copies(x, weights):
    """A function w -> w * x for the weights given, all memory allocated now: x itself
    for 1.0; for a floating-point x one scratch tensor, rewritten when w changes (each
    transfer completes before the next one reads it); an integer x a rounded copy
    per distinct weight, as in scaled."""
    others = {w for w in weights if w != 1.0}
    if not others:
        return lambda w: x
    if not (x.is_floating_point() or x.is_complex()):
        copies = {w: scaled(x, w) for w in others}
        return lambda w: x if w == 1.0 else copies[w]
    scratch, last = torch.empty_like(x), [None]

    def by(w):
        if w == 1.0:
            return x
        if w != last[0]:
            torch.mul(x, w, out=scratch)
            last[0] = w
        return scratch
    return by


def scale_in_place(t, w):
    """t *= w (an integer tensor rounded, as the weighted sums are)."""
    if t.is_floating_point() or t.is_complex():
        t.mul_(w)
    else:
        t.copy_(scaled(t, w))


def get(eng, op, win, src_weights, require_mutex, with_p, current=None):
    """Fetch src_weights[s] * (exposed copy of s) into my buffer for each s. With
    require_mutex, my own exposed copy is refreshed under my mutex (a neighbor's
    win_get holding it reads the copy whole; not inside a win_mutex block that holds
    other agents' mutexes), the sources' read under theirs. current: see Window."""
    if current is not None:
        win.tensor = current
    # (not while this agent holds other mutexes of the window, in a win_mutex block: an
    # agent waiting in its own block for one of those may hold this agent's mutex)
    alone = not (set(win.held) - {win.rank})
    mine = yield from _locked(eng, op, win, [win.rank], require_mutex and alone)
    try:
        _publish(win)
    finally:
        release(win, mine)
    locked = yield from _locked(eng, op, win, sorted(src_weights), require_mutex)
    try:
        with _phase(op.name, "COMMUNICATE"):
            # An integer window's copies scaled by a weight are fetched into scratch tensors and
            # all checked before any buffer is written (scaled in a buffer, they would wrap
            # around; one out of range leaves every buffer, p and version as they were)
            scratch = not (win.dtype.is_floating_point or win.dtype.is_complex) and \
                any(w != 1.0 for w in src_weights.values())
            fetched = {}
            for src, w in sorted(src_weights.items()):
                lay, i = win.layouts[src], win.in_index[src]
                into = torch.empty_like(win.buffers[i]) if scratch else win.buffers[i]
                if win.nbytes:
                    req = win.win.Rget([into.numpy(), win.mpi_type], src, target=lay.data)
                    yield from _wait_local(req, f"MPI_Rget from rank {src}")
                pv = None
                if with_p:
                    pv = np.zeros(1)
                    win.win.Get([pv, MPI.DOUBLE], src, target=lay.exposed_p())
                    win.win.Flush(src)
                fetched[src] = (into, pv)
                if into is not win.buffers[i]:
                    _fits_scaled(into, [w], f"win_get of window {win.name!r} from rank {src}",
                                 "win_get scales what it fetches in the window's dtype): fetch with weight 1 and "
                                 "weigh it in win_update instead, or use a wider dtype")
            for src, w in sorted(src_weights.items()):
                i = win.in_index[src]
                into, pv = fetched[src]
                if into is not win.buffers[i]:
                    win.buffers[i].copy_(into if w == 1.0 else scaled(into, w))
                elif w != 1.0 and win.nbytes:
                    scale_in_place(into, w)
                if pv is not None:
                    win.p[1 + i] = pv[0] * w
            _reset_versions(win, [win.in_index[s] for s in sorted(src_weights)])
    finally:
        release(win, locked)
    return True


def update(eng, op, win, self_weight, nbr_weights, reset, clone, require_mutex, with_p, current=None):
    """self <- self_weight * self + sum_j w_j * buffer_j (and the same for p).
    current: see Window."""
    if current is not None:
        win.tensor = current
    locked = yield from _locked(eng, op, win, [win.rank], require_mutex)
    try:
        with _phase(op.name, "WIN_SYNC_COMPUTE_AVERAGE"):
            used = [(win.in_index[r], w) for r, w in sorted(nbr_weights.items())]
            x = win.tensor.detach()
            out = torch.empty_like(x) if clone else x
            acc = x.to(win.stored) if win.stored != win.dtype else None    # (summed in float32, rounded once)
            # Reset the counters before reading: a put that lands meanwhile is counted
            # again next time rather than lost (and given back if the sum fails).
            give_back = _reset_versions(win, [i for i, _ in used])
            win.win.Sync()
            terms = [(win.buffers[i], w) for i, w in used]
            try:
                if acc is not None:
                    copy_into(out, weighted_sum(acc, acc, self_weight, terms))
                else:
                    weighted_sum(out, x, self_weight, terms)
            except ValueError as exc:     # (an integer window's sum out of its range)
                give_back()
                collect = self_weight == 1.0 and reset and all(w == 1.0 for w in nbr_weights.values())
                raise ValueError(f"win_update{'_then_collect' if collect else ''} of window {win.name!r}: {exc}"
                                 + ("; what the neighbors put or accumulated is kept (use a wider dtype)"
                                    if collect else "")) from None
            except BaseException:
                give_back()
                raise
            if with_p:
                new_p = self_weight * win.p[0] + sum(w * win.p[1 + i] for i, w in used)
                if not clone:
                    win.p[0] = new_p
            if reset:
                for i, _ in used:
                    win.buffers[i].zero_()
                    if with_p:
                        win.p[1 + i] = 0.0
            if not clone:
                _publish(win)
    finally:
        release(win, locked)
    return out if clone else win.tensor

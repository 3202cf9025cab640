"""The quick path of a blocking neighbor_allreduce.

A blocking call made while the communication thread sleeps with nothing in
flight and the timeline is off needs little of the loop, so the caller runs it
alone. A call of the general path costs ~150 µs of CPU on this host (an
operation object, its generator, admission, the outbox, the inbox's waiters,
completion); this path skips them. The packets are the ones the loop builds
(_stream.py), so neighbors on either path understand each other.

- A small tensor: the caller sends one packet to each out-neighbor, looks for
  the in-neighbors' packets between yields of the CPU, and averages with numpy
  (torch operations on 4 KB cost several times their arithmetic). A packet that
  is exactly the expected one (the caller's own header, from an in-neighbor it
  still waits for) is read in place, without an inbox entry
  (StreamEndpoint.receive_small); inputs that came before the call are taken
  from the inbox; anything else goes the general way. About half the CPU of the
  general path.
- A large tensor, up to 2 MiB: the caller sends each out-neighbor a descriptor
  and the data (from the tensor's memory), posts the receive of each
  in-neighbor's data as soon as its descriptor is in (one that is exactly the
  expected one is read without an inbox entry: _received), averages, and waits
  for its own sends. Between looks it yields the CPU for up to the transfer window
  (BLUEFOG_TRANSFER_WINDOW_S, 3 ms) instead of the 0.3 ms yield window: MPI
  moves a large message only while both agents call into it, and an agent asleep
  in the middle of a transfer stalls its peers (1 MB at 4 agents: a minimal
  exchange that sleeps after 0.3 ms took 2.3 ms, one that yields 3 ms 0.9 ms,
  raw mpi4py 1.0 ms). Larger tensors outlast the window and go the general way
  (at 4-8 MB the quick path measured slower).

If the inputs have not all arrived within the window, or something else needs
the loop meanwhile (an operation another thread queued, a large tensor announced
that is not this call's), the call becomes an ordinary operation waiting for its
inputs (and for its large sends), and the caller runs the loop for it
(Engine.continue_held): sleeping, the stall inspector and timeouts are the loop's.
A call interrupted meanwhile (a signal handler's exception) becomes such an
operation too, one that nobody waits for (Engine.abandon_held): the loop takes its
inputs, which would otherwise feed the name's next call.
"""
import os
import time

import numpy as np
import torch

from . import _neighbor_tasks
from ._mpi import MPI
from ._stream import STREAM_TAG, Entry, _as_tensor, dtype_name
from ._tasks import weighted_sum
from .timeline import _recorder as tl

_yield = os.sched_yield
_monotonic = time.monotonic
_ANY_SOURCE = MPI.ANY_SOURCE
_from_address = (getattr(MPI, "buffer", None) or MPI.memory).fromaddress    # (mpi4py 4 renamed memory to buffer)
_status = MPI.Status()    # for the caller holding the loop (one at a time)


class _Call:
    """The kind and name of a quick call, for the messages of _neighbor_tasks.average_of."""
    __slots__ = ("name",)
    kind = "NEIGHBOR_ALLREDUCE"

    def __init__(self, name):
        self.name = name


_FLOATS = {torch.float32, torch.float64}
_LONGEST_SPIN_S = 0.1     # even with a long BLUEFOG_YIELD_WINDOW_S: the loop inspects stalls
_LARGEST_QUICK = 2 << 20  # bytes; larger transfers outlast the transfer window (see the docstring)


def neighbor_allreduce(eng, name, x, self_weight, src_weights, send_plan, recv_from):
    """The average (a new tensor), or None when the quick path cannot take the call:
    the caller then runs the general path."""
    s = eng.stream
    nbytes = x.nbytes
    if tl.current is not None or x.dtype not in _FLOATS or not eng.caller_progress or not nbytes:
        return None
    if nbytes > s.inline_limit:
        if nbytes > _LARGEST_QUICK:
            return None
        return _large(eng, name, x, nbytes, self_weight, src_weights, send_plan, recv_from)
    if not eng.hold_if_idle(name):
        return None
    held = True
    try:
        xa = x.numpy()
        meta = (dtype_name(x.dtype), xa.shape)
        head = s.small_head(name, meta, xa.nbytes)
        # every packet made before any is sent: a call cut short between two sends
        # would leave the name's rounds out of step (the next call takes this one's input)
        plain = None
        packets = []
        tried = []
        try:
            out = torch.empty_like(x)
            for dst, scale in send_plan:
                if scale is None:
                    if plain is None:
                        plain = s.small_packet(name, meta, xa)
                    packets.append((dst, plain))
                else:
                    with np.errstate(all="ignore"):     # (see _average)
                        packets.append((dst, s.small_packet(name, meta, xa * scale)))
            ring = eng.doorbell.ring
            for dst, packet in packets:
                tried.append(dst)
                s.send_packet(dst, packet)
                ring(dst)
        except Exception as exc:
            _neighbor_tasks.failed_plan(eng, exc, name, send_plan, recv_from, tried)
            raise
        window = min(eng.yield_window_s, _LONGEST_SPIN_S)
        try:
            arrays = _arrays(eng, name, meta, head, xa, recv_from, window)
            # all in, but not all as expected: the checks say which
            entries = None if arrays is not None else eng.held_take([(src, name) for src in recv_from])
        except BaseException:
            held = False    # abandon_held lets go
            _abandon(eng, name, _rest(name, x, out, self_weight, src_weights, recv_from))
            raise
        if arrays is not None:
            s.stats["quick"] += 1
            return _average(out, xa, self_weight, [src_weights.get(src, 0.0) for src in recv_from], arrays)
        if entries is not None:
            s.stats["quick"] += 1
            return _neighbor_tasks.average_of(_Call(name), x, out, self_weight, src_weights, entries)
        s.stats["quick_continued"] += 1
        held = False    # continue_held lets go
        handle = eng.continue_held(name, _Call.kind, _rest(name, x, out, self_weight, src_weights, recv_from))
    finally:
        if held:
            eng.release_hold(name)
    return eng.synchronize_owned(handle)


def _arrays(eng, name, meta, head, xa, recv_from, window):
    """The in-neighbors' tensors of a small call (dtype and shape meta, packet header
    head) as numpy arrays in recv_from's order, read straight from their packets;
    or None, with every packet filed in the inbox, when one is not as expected or
    the call gives up (see _inputs)."""
    s = eng.stream
    inbox = s.inbox
    taken = {}     # src -> its Entry, queued before the call (a neighbor ahead)
    for src in recv_from:
        q = inbox.get((src, name))
        if q:
            e = q[0]
            if e.array is None or e.meta != meta or e.sent_by is not None:
                return None
            taken[src] = e
    if taken:
        s.stats["quick_ahead"] += 1
    for src in taken:
        q = inbox[(src, name)]
        q.popleft()
        if not q:
            del inbox[(src, name)]
    wanted = set(recv_from).difference(taken)
    found = []
    if wanted:
        size = s.small_size(head, xa.nbytes)
        receive = s.receive_small
        since = _monotonic()
        try:
            while receive(_status, name, head, size, wanted, found):
                if not wanted:
                    break
                if _monotonic() - since > window or eng.held_interrupted():
                    break
                _yield()
        except BaseException:     # (an interrupt: the operation the call becomes takes them)
            _file_back(s, name, found, taken)
            raise
        if wanted:
            _file_back(s, name, found, taken)
            return None
    got = {src: e.array for src, e in taken.items()}
    start = len(head)
    for src, packet in found:
        got[src] = np.ndarray(xa.shape, xa.dtype, packet, start)
    return [got[src] for src in recv_from]


def _file_back(s, name, found, taken):
    """Undo _arrays: found's packets and the entries it took back in the inbox, first
    under their keys."""
    s.put_back(found, name)
    for src, e in taken.items():
        s.inbox[(src, name)].appendleft(e)


def _rest(name, x, out, self_weight, src_weights, recv_from):
    """The task of the operation a call becomes once its sends are made (Engine.continue_held)."""
    keys = [(src, name) for src in recv_from]
    return lambda e, op: _neighbor_tasks.neighbor_allreduce_rest(e, op, x, out, self_weight, src_weights, keys)


def _abandon(eng, name, task, data_requests=()):
    """A call interrupted (a signal handler's exception) after its sends, before it
    took its inputs, becomes an operation nobody waits for (Engine.abandon_held): the
    loop takes its inputs in the background, as for an interrupted operation, instead
    of leaving them to the name's next call."""
    eng.stream.stats["quick_interrupted"] += 1
    eng.abandon_held(name, _Call.kind, task, data_requests)


def _average(out, xa, self_weight, weights, arrays):
    """out = self_weight * x + the weighted arrays, in numpy (a small tensor's torch
    operations cost several times more than their arithmetic). Each term is scaled
    before it is added, so a convex combination of finite values stays finite (summing
    first, then scaling, overflowed near the dtype's largest value: 2e38 twice in
    float32 gave inf; it saved ~1 us). Overflow, underflow and invalid values give
    inf, 0 and nan quietly, as torch's arithmetic on the general path does, whatever
    the user's numpy error state (np.seterr(all="raise"), or warnings turned into
    errors, raised out of the call)."""
    acc = out.numpy()
    with np.errstate(all="ignore"):
        np.multiply(xa, self_weight, out=acc)
        for a, w in zip(arrays, weights):
            if w != 0:
                acc += a * w
    return out


class _Sends(_Call):
    """A large call, as _neighbor_tasks.average_of and Engine.continue_held see an
    operation: its name and the requests of its data messages; while it waits for its
    inputs, the task of the operation it would become (_rest)."""
    __slots__ = ("data_requests", "waiting")

    def __init__(self, name):
        super().__init__(name)
        self.data_requests = []
        self.waiting = None


def _large(eng, name, x, nbytes, self_weight, src_weights, send_plan, recv_from):
    """The quick path of a large tensor: see the module's docstring."""
    if not eng.hold_if_idle(name):
        return None
    held = True
    call = _Sends(name)
    try:
        try:
            out, task = _large_held(eng, call, x, nbytes, self_weight, src_weights, send_plan, recv_from)
        except BaseException:   # a neighbor's other shape, an interrupt: MPI may still read the sends
            if call.waiting is None:
                eng.keep_sending(call.data_requests)
            else:           # (the operation keeps them)
                held = False    # abandon_held lets go
                _abandon(eng, name, call.waiting, call.data_requests)
            raise
        if task is None:
            eng.stream.stats["quick"] += 1
            return out
        eng.stream.stats["quick_continued"] += 1
        held = False    # continue_held lets go
        handle = eng.continue_held(name, _Call.kind, task, call.data_requests)
    finally:
        if held:
            eng.release_hold(name)
    return eng.synchronize_owned(handle)


def _large_held(eng, call, x, nbytes, self_weight, src_weights, send_plan, recv_from):
    """Send, receive and average while holding the loop: (out, None) when done, or
    (out, the task the loop finishes the call with)."""
    name, s = call.name, eng.stream
    meta = (dtype_name(x.dtype), tuple(x.shape))
    head = s.large_head(name, meta, nbytes)      # (of the descriptors sent and of those expected)
    outgoing = {}    # scale -> (tensor, its memory): x, or one scaled copy per distinct scale
    tried = []
    try:
        out = torch.empty_like(x)
        for _, scale in send_plan:
            if scale not in outgoing:
                y = x if scale is None else _neighbor_tasks.scaled(x, scale)
                outgoing[scale] = (y, _memory(y, nbytes))
        for dst, scale in send_plan:     # descriptors, then the data
            data = outgoing[scale]
            tried.append(dst)
            s.send_large(dst, head, data[1], data[0], call.data_requests)
    except Exception as exc:
        _neighbor_tasks.failed_plan(eng, exc, name, send_plan, recv_from, tried)
        raise
    eng.ring_peers()
    window = min(max(eng.yield_window_s, eng.transfer_window_s), _LONGEST_SPIN_S)
    since = _monotonic()
    call.waiting = rest = _rest(name, x, out, self_weight, src_weights, recv_from)
    got = _received(eng, name, meta, head, nbytes, recv_from, window)
    entries = None if got is not None else _inputs(eng, [(src, name) for src in recv_from],
                                                   window - (_monotonic() - since))
    call.waiting = None     # (the inputs are taken, or the call continues as an operation)
    if got is not None:
        s.stats["quick_received"] += 1
        try:
            weighted_sum(out, x, self_weight, [(t, src_weights.get(src, 0.0)) for src, t in zip(recv_from, got[0])])
        finally:
            for release in got[1]:
                release()
    elif entries is None:
        return out, rest
    else:
        _neighbor_tasks.average_of(call, x, out, self_weight, src_weights, entries)
    if _sent(eng, [r for r, _ in call.data_requests], window):
        return out, None
    return out, lambda e, op: _result(out)     # only its sends are left


def _memory(t, nbytes):
    """The nbytes of contiguous host tensor t as a buffer MPI sends from: its address
    (a numpy view, _stream.tensor_bytes, costs several times more on the cold caches
    of a loop of large calls)."""
    return _from_address(t.data_ptr(), nbytes)


def _result(out):
    """A task that is already done."""
    return out
    yield    # (a generator)


# A quick call gives up (the loop takes over) after its window, or once something
# else needs the loop (Engine.held_interrupted). It yields the CPU between looks:
# 4-8 agents share 2 cores, and the agents it waits for need them.

def _inputs(eng, keys, window):
    """The entries of a large call's keys (Engine.held_take), or None once the call
    gives up. A look between yields asks MPI only what the call waits for: while a
    descriptor is missing, whether any packet has come (or a posted receive is
    pending) before it looks through the inbox; once every receive is posted, only
    whether they have completed. In a loop of blocking calls a look runs on cold
    caches, where every Python call counts, and a 1 MB call makes 30-90 of them."""
    found = eng.held_take(keys)
    if found is not None:
        return found
    s = eng.stream
    iprobe, testall = s.comm.Iprobe, MPI.Request.Testall
    reqs = _receiving(s, keys)
    since = _monotonic()
    while True:
        _yield()
        if reqs is None:
            if iprobe(_ANY_SOURCE, STREAM_TAG) or s.pending_recvs:
                found = eng.held_take(keys)
                if found is not None:
                    return found
                reqs = _receiving(s, keys)
        elif testall(reqs):
            found = eng.held_take(keys)     # (marks them ready, rings their senders back)
            if found is not None:
                return found
            reqs = None
        if _monotonic() - since > window or eng.held_interrupted(True):
            return None


def _received(eng, name, meta, head, nbytes, recv_from, window):
    """The in-neighbors' tensors of a large call: (tensors in recv_from's order, the
    functions that give their memory back); or None, with what was received filed in
    the inbox, when an input is not the expected one or the call gives up (_inputs
    then goes on the general way, with what is left of the window). An input whose
    descriptor comes during the call is received without an inbox entry (its receive
    posted as soon as its descriptor is read); one that came before it (a neighbor
    ahead) is taken from the inbox, its receive posted as held_take posts it."""
    s = eng.stream
    inbox = s.inbox
    ahead = []     # keys of the inputs that came before the call
    for src in recv_from:
        q = inbox.get((src, name))
        if q:
            e = q[0]
            if e.__class__ is not Entry or e.meta != meta or e.sent_by is not None:
                return None     # (a fused group's member, another shape or operation: the general way says)
            ahead.append((src, name))
    wanted, found, reqs = set(recv_from).difference(src for src, _ in ahead), [], None
    testall, receive = MPI.Request.Testall, s.receive_large
    since = _monotonic()
    try:
        while True:
            if wanted:
                if not receive(_status, name, head, nbytes, wanted, found):
                    break
            if ahead:
                eng.held_post(ahead)
            if not wanted:
                if reqs is None:
                    reqs = [f[1] for f in found]
                if testall(reqs):
                    entries = eng.held_take_ready(ahead)
                    if entries is not None:
                        return _taken(eng, meta, recv_from, found, entries)
            if _monotonic() - since > window or eng.held_interrupted(True):
                break
            _yield()
    except BaseException:     # (an interrupt: MPI may still write into the posted buffers)
        s.put_back_large(found, name, meta)
        raise
    if found:
        s.stats["quick_put_back"] += 1
        s.put_back_large(found, name, meta)
    return None


def _taken(eng, meta, recv_from, found, entries):
    """_received's result once every input is in: found's buffers as tensors and the
    entries taken from the inbox (inputs that came before the call); found's senders
    rung back (they wait for their sends)."""
    s = eng.stream
    got = {src: (_as_tensor(buf, meta), release) for src, _, buf, release in found}
    for e in entries:
        got[e.src] = (e.value, e.release)
    s.to_ring.update(f[0] for f in found)
    eng.ring_peers()
    done = [got[src] for src in recv_from]
    return [d[0] for d in done], [d[1] for d in done]


def _receiving(s, keys):
    """The requests of the data still coming for keys once every key's descriptor is
    in and the receives of its data are posted; None before."""
    heads = []
    for k in keys:
        q = s.inbox.get(k)
        if not q:
            return None
        heads.append(q[0])
    posted = {e: r for r, e in s.pending_recvs}
    reqs = []
    for e in heads:
        if not e.ready:
            r = posted.get(e)
            if r is None:
                return None
            reqs.append(r)
    return reqs


def _sent(eng, reqs, window):
    """True once MPI has taken the data of every request, False if the call gives up."""
    testall = MPI.Request.Testall
    since = _monotonic()
    while not testall(reqs):
        if _monotonic() - since > window or eng.held_interrupted(True):
            return False
        _yield()
    return True

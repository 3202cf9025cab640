"""Tensors on an accelerator (CUDA, ...) in the operations of ops.py: MPI reads and
writes host memory, so such a tensor is copied to the host when the operation is
called, and its result is copied back to the tensor's device when the operation is
synchronized. Both copies are queued on the calling thread's current stream: the
copy to the host sees the work queued before the call (and none queued after it,
such as an in-place update of the tensor), and work queued after synchronize sees
the result. A nonblocking operation does not wait for its copy to the host: the
call returns once the copy is queued, and the operation starts when the copy is
done (the communication thread polls its CUDA event, with the loop's backoff), so
that the caller goes on queuing GPU work meanwhile (an optimizer's hooks during
the backward pass). A blocking call waits for the copy at once. The communication
thread never touches device memory. With the timeline on, the copies are
COPY_TO_HOST and COPY_TO_DEVICE spans on those threads, in the operation's row,
and the wait for the copy to the host is WAIT_COPY_TO_HOST: a phase of the
operation on the communication thread, or a span before ENQUEUE_ on the caller's
for a blocking call.
"""
import threading

import torch

from ._tasks import _phase
from ._waits import Until

_pending = threading.local()    # .copy: the event of this thread's last copy made with later=True


def on_device(t):
    """True for a tensor whose memory is not the host's. (is_cpu, not device.type:
    making the device object costs ~7 us on the cold caches of a loop of large calls.)"""
    return isinstance(t, torch.Tensor) and not t.is_cpu


def to_host(t, name, later=False):
    """A contiguous host copy of device tensor t (the input of operation name), made
    in one copy (conjugated or negated views resolved). From a CUDA tensor the copy
    lands in page-locked memory (torch keeps a cache of it): several times faster
    than into freshly allocated memory. later: return once the copy is queued, and
    leave its event for the operation's submission to take (take_copy); otherwise
    the copy is done when this returns."""
    pinned = t.is_cuda and torch.cuda.is_available()
    with _phase(name, "COPY_TO_HOST"):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
        if later and t.is_cuda:     # (replaces an event nobody took: its call failed in between)
            _pending.copy = _copy_later(host, t.detach())
        else:
            host.copy_(t.detach())
    return host


def _copy_later(host, t):
    """Queue the copy of device tensor t into host on t's device's current stream;
    returns an object with query() and synchronize() (a CUDA event) for the copy,
    or None when it is done already."""
    if not torch.cuda.is_available():
        host.copy_(t)
        return None
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))
    return done


def take_copy():
    """The event of this thread's last copy to the host made with later=True that is
    still running (None if none), handed over: the operation being submitted waits
    for it."""
    copy = getattr(_pending, "copy", None)
    if copy is None:
        return None
    _pending.copy = None
    return None if copy.query() else copy


def finish_copy(name):
    """Wait for this thread's copy to the host made with later=True, if any (for a
    blocking call of operation name: a WAIT_COPY_TO_HOST span on this thread)."""
    copy = take_copy()
    if copy is not None:
        with _phase(name, "WAIT_COPY_TO_HOST"):
            copy.synchronize()


def copied(*ops):
    """``yield from copied(op)`` (a fused group: ``copied(*members)``) in a task, before
    it first reads its inputs: waits, without blocking the loop, for the copies to
    the host of their device inputs that are still running (op.ready; an operation
    that negotiates first takes its place in the order of collectives before it
    waits). With none running (a host tensor) it is an empty tuple: no generator."""
    copies = [op.ready for op in ops if op.ready is not None]
    if not copies:
        return ()
    for op in ops:
        op.ready = None
    copies = [c for c in copies if not c.query()]
    return _waiting(copies, ops[0].name if len(ops) == 1 else [op.name for op in ops]) if copies else ()


def _waiting(copies, names):
    with _phase(names, "WAIT_COPY_TO_HOST"):
        yield Until(lambda: all(c.query() for c in copies), "the copy of its tensor to the host (on the GPU)")


def delivery(t, in_place, name):
    """None for a host tensor; for a device tensor, the function that takes the
    host result of operation name to t's device: written into t (in_place; returns
    t itself, as the host form does) or as a new tensor there."""
    if not on_device(t):
        return None
    # (out of place: an empty tensor like t, so as not to keep the input alive)
    target = t.detach() if in_place else t.new_empty(0)

    def deliver(host):
        with _phase(name, "COPY_TO_DEVICE"):
            if in_place:
                target.copy_(host)
                return t
            out = target.new_empty(host.shape, dtype=host.dtype)   # (on t's device)
            out.copy_(host)
        return out
    return deliver

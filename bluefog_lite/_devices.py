"""Tensors on an accelerator (CUDA, ...) in the operations of ops.py: MPI reads and
writes host memory, so such a tensor is copied to the host when the operation is
called, and its result is copied back to the tensor's device when the operation is
synchronized. The copy to the host runs on the calling thread, the copy back on
the thread that synchronizes, each on that thread's current stream: the copy to
the host waits for the work queued before the call, and work queued after
synchronize sees the result. The communication thread never touches device
memory. With the timeline on, the copies are COPY_TO_HOST and COPY_TO_DEVICE
spans on those threads, in the operation's row.
"""
import torch

from ._tasks import _phase


def on_device(t):
    """True for a tensor whose memory is not the host's."""
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


def to_host(t, name):
    """A contiguous host copy of device tensor t (the input of operation name), made
    in one copy (conjugated or negated views resolved). From a CUDA tensor the copy
    lands in page-locked memory (torch keeps a cache of it): several times faster
    than into freshly allocated memory."""
    pinned = t.is_cuda and torch.cuda.is_available()
    with _phase(name, "COPY_TO_HOST"):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
        host.copy_(t.detach())
    return host


def delivery(t, in_place, name):
    """None for a host tensor; for a device tensor, the function that takes the
    host result of operation name to t's device: written into t (in_place; returns
    t, detached, as the host form does) or as a new tensor there."""
    if not on_device(t):
        return None
    # (out of place: an empty tensor like t, so as not to keep the input alive)
    target = t.detach() if in_place else t.new_empty(0)

    def deliver(host):
        with _phase(name, "COPY_TO_DEVICE"):
            out = target if in_place else target.new_empty(host.shape, dtype=host.dtype)   # (on t's device)
            out.copy_(host)
        return out
    return deliver

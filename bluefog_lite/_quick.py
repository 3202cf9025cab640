"""The quick path of a small blocking neighbor_allreduce.

A blocking call on a small tensor, made while the communication thread sleeps
with nothing in flight and the timeline is off, needs little of the loop: the
caller sends one packet to each out-neighbor, looks for the in-neighbors'
packets between yields of the CPU, and averages with numpy. A call of the
general path costs ~150 µs of CPU on this host (an operation object, its
generator, admission, the outbox, the inbox's waiters, completion, torch
operations on 4 KB); this path skips them and takes about half of that.
The packets are the ones the loop builds (_stream.py), so neighbors on either
path understand each other.

If the inputs have not all arrived within the yield window, or something else
needs the loop meanwhile (an operation another thread queued, a large tensor
announced), the call becomes an ordinary operation waiting for its inputs, and
the caller runs the loop for it (Engine.continue_held): sleeping, the stall
inspector and timeouts are the loop's.
"""
import os
import time

import numpy as np
import torch

from . import _tasks
from ._stream import dtype_name
from .timeline import _recorder as tl

_yield = os.sched_yield
_monotonic = time.monotonic


class _Call:
    """The kind and name of a quick call, for the messages of _tasks.average_of."""
    __slots__ = ("name",)
    kind = "NEIGHBOR_ALLREDUCE"

    def __init__(self, name):
        self.name = name


_FLOATS = {torch.float32, torch.float64}
_LONGEST_SPIN_S = 0.1     # even with a long BLUEFOG_YIELD_WINDOW_S: the loop inspects stalls


def neighbor_allreduce(eng, name, x, self_weight, src_weights, send_plan, recv_from):
    """The average (a new tensor), or None when the quick path cannot take the call:
    the caller then runs the general path."""
    s = eng.stream
    if (tl.current is not None or x.dtype not in _FLOATS or not eng.caller_progress
            or not 0 < x.numel() * x.element_size() <= s.inline_limit):
        return None
    if not eng.hold_if_idle(name):
        return None
    held = True
    try:
        xa = x.numpy()
        meta = (dtype_name(x.dtype), xa.shape)
        packet = None
        ring = eng.doorbell.ring
        for dst, scale in send_plan:
            if scale is None:
                if packet is None:
                    packet = s.small_packet(name, meta, xa)
                s.send_packet(dst, packet)
            else:
                s.send_packet(dst, s.small_packet(name, meta, xa * scale))
            ring(dst)
        out = torch.empty_like(x)
        keys = [(src, name) for src in recv_from]
        entries = _gather(eng, keys)
        if entries is not None:
            s.stats["quick"] += 1
            for e in entries:
                if e.array is None or e.meta != meta:    # another shape or dtype: its message
                    return _tasks.average_of(_Call(name), x, out, self_weight, src_weights, entries)
            return _average(out, xa, self_weight, src_weights, entries)
        s.stats["quick_continued"] += 1
        held = False    # continue_held lets go
        handle = eng.continue_held(name, _Call.kind, lambda e, op: _tasks.neighbor_allreduce_rest(
            e, op, x, out, self_weight, src_weights, keys))
    finally:
        if held:
            eng.release_hold(name)
    return eng.synchronize(handle)


def _average(out, xa, self_weight, src_weights, entries):
    """out = self_weight * x + the weighted entries, in numpy (a small tensor's torch
    operations cost several times more than their arithmetic); entries released.
    Equal weights (every default topology) are summed first and scaled once."""
    acc = out.numpy()
    weights = [src_weights.get(e.src, 0.0) for e in entries]
    if entries and self_weight != 0 and all(w == self_weight for w in weights):
        np.add(xa, entries[0].array, out=acc)
        for e in entries[1:]:
            acc += e.array
        acc *= self_weight
    else:
        np.multiply(xa, self_weight, out=acc)
        for e, w in zip(entries, weights):
            if w != 0:
                acc += e.array * w
    for e in entries:
        e.release()
    return out


def _gather(eng, keys):
    """The entries for keys once all have arrived, or None if that takes longer
    than the yield window or something else needs the loop."""
    window = min(eng.yield_window_s, _LONGEST_SPIN_S)
    take = eng.held_take
    entries = take(keys)
    since = None
    while entries is None:
        now = _monotonic()
        if since is None:
            since = now
        elif now - since > window or eng.held_interrupted():
            return None
        _yield()
        entries = take(keys)
    return entries

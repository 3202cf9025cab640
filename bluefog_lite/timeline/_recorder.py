"""Hot-path event recording: raw tuples into a deque; the writer formats them later.

``current`` is None while the timeline is off, so a disabled timeline costs one
attribute read and one comparison per event site. While it is on, an event
costs one ``perf_counter_ns()`` and one ``deque.append`` of a tuple (LIMITS.md
point 5); formatting happens on the writer thread (_writer.py).
"""
import collections
import threading
import time

current = None   # the active Recorder, or None

_now_ns = time.perf_counter_ns
_ident = threading.get_ident

# event tuples: (phase, t_ns, tensor_name, activity, thread_ident)
#   phase 'B' begin, 'S' scoped begin, 'E' end, 'i' instant
#   An 'E' with an activity closes the innermost open span of that activity on
#   (tensor_name, thread); an 'E' without one closes the innermost span opened
#   with 'B'. A scoped span ('S': compute hooks, timeline_context) is closed
#   only by an 'E' naming its activity, so an anonymous end recorded by another
#   thread (the end of an ENQUEUE_ span) cannot close it by mistake.


class Recorder:
    """Collects events; a writer thread drains ``events`` (deque appends and
    poplefts are thread-safe without a lock)."""

    def __init__(self):
        self.events = collections.deque()
        self.thread_names = {}   # thread ident -> display name

    def begin(self, tensor_name, activity, tid=None):
        self.events.append(("B", _now_ns(), tensor_name, activity, tid or _ident()))

    def begin_scoped(self, tensor_name, activity, tid=None):
        self.events.append(("S", _now_ns(), tensor_name, activity, tid or _ident()))

    def end(self, tensor_name, tid=None, activity=None):
        self.events.append(("E", _now_ns(), tensor_name, activity, tid or _ident()))

    def instant(self, tensor_name, activity, tid=None):
        self.events.append(("i", _now_ns(), tensor_name, activity, tid or _ident()))

    def rows(self, ph, names, activity):
        """One event per name (a name, or a sequence of names) at one instant on the
        calling thread: a sub-phase of a fused group, FORWARD of a module's
        parameters. Returns the instant."""
        t, tid = _now_ns(), _ident()
        if names.__class__ is str:
            self.events.append((ph, t, names, activity, tid))
        else:
            self.events.extend([(ph, t, name, activity, tid) for name in names])
        return t

    def name_thread(self, name, tid=None):
        self.thread_names[tid or _ident()] = name


# The module-level functions append directly (one Python call less per event).

def begin(tensor_name, activity, tid=None):
    rec = current
    if rec is not None:
        rec.events.append(("B", _now_ns(), tensor_name, activity, tid or _ident()))


def end(tensor_name, tid=None, activity=None):
    rec = current
    if rec is not None:
        rec.events.append(("E", _now_ns(), tensor_name, activity, tid or _ident()))


def instant(tensor_name, activity, tid=None):
    rec = current
    if rec is not None:
        rec.events.append(("i", _now_ns(), tensor_name, activity, tid or _ident()))

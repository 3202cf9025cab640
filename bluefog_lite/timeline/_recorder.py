"""Hot-path event recording: raw tuples into a deque; the writer formats them later.

``current`` is None while the timeline is off, so a disabled timeline costs one
attribute read and one comparison per event site. While it is on, an event
costs one ``perf_counter_ns()`` and one ``deque.append`` of a tuple (../shared/LIMITS.md
point 5); formatting happens on the writer thread (_writer.py).
"""
import collections
import threading
import time

current = None   # the active Recorder, or None

now_ns = time.perf_counter_ns     # the clock of every event (and of the hooks, hooks.py)
_ident = threading.get_ident
_current_thread = threading.current_thread

# event tuples: (phase, t_ns, tensor_name, activity, thread_ident)
#   phase 'B' begin, 'S' scoped begin, 'E' end, 'i' instant, and 'X' a whole
#   span recorded once it has ended, whose t_ns is the pair (begin, end); 'T':
#   the thread ident is this thread's from now on (activity: its name; know_thread)
#   An 'E' with an activity closes the innermost open span of that activity on
#   (tensor_name, thread); an 'E' without one closes the innermost span opened
#   with 'B'. A scoped span ('S': timeline_context, user activities) is closed
#   only by an 'E' naming its activity, so an anonymous end recorded by another
#   thread (the end of an ENQUEUE_ span) cannot close it by mistake.


class Recorder:
    """Collects events; a writer thread drains ``events`` (deque appends and
    poplefts are thread-safe without a lock)."""

    def __init__(self):
        self.events = collections.deque()
        self.thread_names = {}   # thread ident -> display name
        self.threads = {}        # thread ident -> the threading.Thread know_thread last saw with it
        # (tensor_name, thread ident) -> the activities timeline_start_activity opened
        # there in this file and timeline_end_activity has not ended, innermost last
        # (kept here, they go with the file: closing it ends them)
        self.activities = {}

    def begin(self, tensor_name, activity, tid=None):
        self.events.append(("B", now_ns(), tensor_name, activity, tid or _ident()))

    def begin_scoped(self, tensor_name, activity, tid=None):
        self.events.append(("S", now_ns(), tensor_name, activity, tid or _ident()))

    def end(self, tensor_name, tid=None, activity=None):
        self.events.append(("E", now_ns(), tensor_name, activity, tid or _ident()))

    def instant(self, tensor_name, activity, tid=None):
        self.events.append(("i", now_ns(), tensor_name, activity, tid or _ident()))

    def instants(self, names, activity):
        """One instant per name (a name, or a sequence of names: the members of a
        fused group) at one time on the calling thread."""
        t, tid = now_ns(), _ident()
        if names.__class__ is str:
            self.events.append(("i", t, names, activity, tid))
        else:
            self.events.extend([("i", t, name, activity, tid) for name in names])

    def spans(self, names, activity, begin):
        """A span from begin to now on the calling thread, one per name (a name, or
        a sequence of names): a sub-phase, FORWARD, BACKWARD. One event instead of a
        begin and an end: half the recording and half the writer's lines. Returns now."""
        end, tid = now_ns(), _ident()
        span = (begin, end)
        if names.__class__ is str:
            self.events.append(("X", span, names, activity, tid))
        else:
            self.events.extend([("X", span, name, activity, tid) for name in names])
        return end

    def name_thread(self, name, tid=None):
        self.thread_names[tid or _ident()] = name

    def know_thread(self, tid):
        """Name the calling thread's (tid's) rows after it: a "T" event carries its
        name to the writer, which formats later (a short-lived thread may be gone by
        then, and Python gives the ident of a thread that ended to the next one: the
        writer starts new rows for tid at each "T")."""
        t = _current_thread()
        known = self.threads.get(tid)
        if known is t:
            return
        self.threads[tid] = t
        if known is None and tid in self.thread_names:     # (named at the start: main, communication)
            return
        name = self.thread_names[tid] = "main" if t is threading.main_thread() else t.name
        if known is not None:
            # the old thread's activities ended with its rows (a copy of the keys:
            # other threads add theirs meanwhile)
            for key in [k for k in list(self.activities) if k[1] == tid]:
                del self.activities[key]
        self.events.append(("T", now_ns(), None, name, tid))


# The module-level functions append directly (one Python call less per event).

def begin(tensor_name, activity, tid=None):
    rec = current
    if rec is not None:
        rec.events.append(("B", now_ns(), tensor_name, activity, tid or _ident()))


def begin_here(tensor_name, activity):
    """begin on the calling thread, keeping its name (see Recorder.know_thread)."""
    rec = current
    if rec is not None:
        tid = _ident()
        rec.know_thread(tid)
        rec.events.append(("B", now_ns(), tensor_name, activity, tid))


def end(tensor_name, tid=None, activity=None):
    rec = current
    if rec is not None:
        rec.events.append(("E", now_ns(), tensor_name, activity, tid or _ident()))


def instant(tensor_name, activity, tid=None):
    rec = current
    if rec is not None:
        rec.events.append(("i", now_ns(), tensor_name, activity, tid or _ident()))

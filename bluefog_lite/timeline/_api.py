"""User-recorded activities: timeline_start_activity / timeline_end_activity / timeline_context.

Each records on the calling thread, on the row (pid) of ``tensor_name``; when
the timeline is off they do nothing and return False.
"""
import functools
import threading

from . import _recorder
from ._writer import GENERATED_NAME


_LIBRARY_PREFIXES = ("MPI_", "ENQUEUE_")    # the library's spans: bftimeline reads them as operations


def _check(value, what):
    if not isinstance(value, str) or not value:
        raise TypeError(f"{what} must be a non-empty string, got {value!r}")


def _check_tensor_name(tensor_name):
    _check(tensor_name, "tensor_name")
    if ".noname." in tensor_name and GENERATED_NAME.fullmatch(tensor_name):
        raise ValueError(f"tensor_name {tensor_name!r} has the form '<operation>.noname.<n>', the row of one call "
                         "without a name (its row is dropped once the call is over); choose another name")


def _check_activity(activity_name):
    _check(activity_name, "activity_name")
    if activity_name.startswith(_LIBRARY_PREFIXES):
        raise ValueError(f"activity_name {activity_name!r}: names beginning with MPI_ or ENQUEUE_ are the "
                         "library's own spans (bftimeline would count yours as communication); choose another name")


def timeline_start_activity(tensor_name, activity_name):
    """Open a span named activity_name on tensor_name's row. True if recorded."""
    _check_tensor_name(tensor_name)
    _check_activity(activity_name)
    rec = _recorder.current
    if rec is None:
        return False
    tid = threading.get_ident()
    rec.know_thread(tid)
    rec.begin_scoped(tensor_name, activity_name, tid)
    rec.activities.setdefault((tensor_name, tid), []).append(activity_name)
    return True


def timeline_end_activity(tensor_name):
    """Close the innermost activity this thread opened on tensor_name's row with
    timeline_start_activity (never a span of the library's, such as an operation's
    ENQUEUE_ on that row). True if recorded; False with the timeline off or no such
    activity open in the current file."""
    _check(tensor_name, "tensor_name")
    rec = _recorder.current
    if rec is None:
        return False
    tid = threading.get_ident()
    names = rec.activities.get((tensor_name, tid))
    if not names:       # (none, or opened in a file closed since: it ended there)
        return False
    activity = names.pop()
    if not names:
        del rec.activities[(tensor_name, tid)]
    rec.end(tensor_name, tid, activity)
    return True


class timeline_context:
    """``with timeline_context(name, activity):`` records the block as one span.

    ``as`` gives True when the span is being recorded. As a decorator
    (``@timeline_context(name, activity)``, as Bluefog's contextmanager allowed)
    it records every call of the function."""
    __slots__ = ("tensor_name", "activity_name", "_open")

    def __init__(self, tensor_name, activity_name):
        _check_tensor_name(tensor_name)
        _check_activity(activity_name)
        self.tensor_name, self.activity_name = tensor_name, activity_name
        # thread ident -> the recorders of this object's blocks open on that thread,
        # innermost last (None: the timeline was off): one object may be entered again
        # inside its own block, or on several threads at once (a module-level span)
        self._open = {}

    def __enter__(self):
        tid = threading.get_ident()
        rec = _recorder.current
        self._open.setdefault(tid, []).append(rec)    # (each thread touches only its own list)
        if rec is None:
            return False
        rec.know_thread(tid)
        rec.begin_scoped(self.tensor_name, self.activity_name, tid)
        return True

    def __exit__(self, *exc):
        tid = threading.get_ident()
        stack = self._open[tid]
        rec = stack.pop()
        if not stack:
            del self._open[tid]
        if rec is not None:
            rec.end(self.tensor_name, tid, self.activity_name)
        return False

    def __call__(self, fn):
        if not callable(fn):
            raise TypeError(f"timeline_context decorates a function, got {fn!r}")
        name, activity = self.tensor_name, self.activity_name

        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            with timeline_context(name, activity):     # (one per call: calls may nest or run on threads)
                return fn(*args, **kwargs)
        return recorded

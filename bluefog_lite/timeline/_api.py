"""User-recorded activities: timeline_start_activity / timeline_end_activity / timeline_context.

Each records on the calling thread, on the row (pid) of ``tensor_name``; when
the timeline is off they do nothing and return False.
"""
import threading

from . import _recorder


def _check(value, what):
    if not isinstance(value, str) or not value:
        raise TypeError(f"{what} must be a non-empty string, got {value!r}")


def timeline_start_activity(tensor_name, activity_name):
    """Open a span named activity_name on tensor_name's row. True if recorded."""
    _check(tensor_name, "tensor_name")
    _check(activity_name, "activity_name")
    rec = _recorder.current
    if rec is None:
        return False
    rec.begin(tensor_name, activity_name)
    return True


def timeline_end_activity(tensor_name):
    """Close the innermost span open on tensor_name's row by this thread. True if recorded."""
    _check(tensor_name, "tensor_name")
    rec = _recorder.current
    if rec is None:
        return False
    rec.end(tensor_name)
    return True


class timeline_context:
    """``with timeline_context(name, activity):`` records the block as one span.

    ``as`` gives True when the span is being recorded."""
    __slots__ = ("tensor_name", "activity_name", "_rec", "_tid")

    def __init__(self, tensor_name, activity_name):
        _check(tensor_name, "tensor_name")
        _check(activity_name, "activity_name")
        self.tensor_name, self.activity_name = tensor_name, activity_name
        self._rec = None

    def __enter__(self):
        rec = self._rec = _recorder.current
        if rec is None:
            return False
        self._tid = threading.get_ident()
        rec.begin_scoped(self.tensor_name, self.activity_name, self._tid)
        return True

    def __exit__(self, *exc):
        rec, self._rec = self._rec, None
        if rec is not None:
            rec.end(self.tensor_name, self._tid, self.activity_name)
        return False

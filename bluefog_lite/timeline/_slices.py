"""One pass over an agent's events: its slices as they end, on rank 0's clock.

Unlike _reader.read_spans (which checks a whole file and keeps every span),
this streams: memory holds only the slices still open. A crashed agent's file
leaves slices open; they are reported last, ended at the file's last
timestamp and marked unfinished.
"""
import collections
import math

Slice = collections.namedtuple("Slice", "pid tid name begin end finished")
Slice.__doc__ = "One slice of a (pid, tid) row, begin/end in µs on rank 0's clock."


class SliceReader:
    """Iterate to get the Slices of an event stream; afterwards ``process_names``
    (pid -> tensor/op name), ``thread_names`` ((pid, tid) -> thread name),
    ``first``/``last`` (earliest/latest timestamp, µs), ``unfinished`` and ``ended``
    are set.

    Each "E" closes the innermost open "B" of its row (the writer's rule); an
    "E" with nothing open is ignored. offset_us is added to every timestamp."""

    def __init__(self, events, offset_us=0.0):
        self._events = events
        self.offset_us = offset_us
        self.process_names = {}
        self.thread_names = {}
        self.first = math.inf
        self.last = -math.inf
        self.unfinished = 0
        self.ended = False       # the writer's end mark (bluefog_end) was read: a clean close
        self.on_instant = None   # called as on_instant(pid, tid, ts, name) for every "i" event

    def __iter__(self):
        stacks = {}              # (pid, tid) -> [(name, begin)] of the open slices
        off = self.offset_us
        first, last = math.inf, -math.inf
        for ev in self._events:
            ph = ev.get("ph")
            if ph == "B" or ph == "E":
                ts = ev["ts"] + off
                if ts > last:
                    last = ts
                if ts < first:
                    first = ts
                key = (ev["pid"], ev["tid"])
                if ph == "B":
                    stack = stacks.get(key)
                    if stack is None:
                        stack = stacks[key] = []
                    stack.append((ev["name"], ts))
                else:
                    stack = stacks.get(key)
                    if stack:
                        name, begin = stack.pop()
                        yield Slice(key[0], key[1], name, begin, ts, True)
            elif ph == "X":
                ts = ev["ts"] + off
                end = ts + ev.get("dur", 0.0)
                first, last = min(first, ts), max(last, end)
                yield Slice(ev["pid"], ev["tid"], ev["name"], ts, end, True)
            elif ph == "M":
                self._metadata_event(ev)
            elif "ts" in ev:
                ts = ev["ts"] + off
                first, last = min(first, ts), max(last, ts)
                if ph == "i" and self.on_instant is not None:
                    self.on_instant(ev["pid"], ev["tid"], ts, ev["name"])
        self.first, self.last = first, last
        for (pid, tid), stack in stacks.items():
            while stack:         # innermost first, so that callers see children before parents
                name, begin = stack.pop()
                self.unfinished += 1
                yield Slice(pid, tid, name, begin, max(begin, last), False)

    def _metadata_event(self, ev):
        name, args = ev.get("name"), ev.get("args") or {}
        if name == "process_name":
            self.process_names[ev["pid"]] = str(args.get("name"))
        elif name == "thread_name":
            self.thread_names[(ev["pid"], ev["tid"])] = str(args.get("name"))
        elif name == "bluefog_end":
            self.ended = True

    def process_name(self, pid):
        return self.process_names.get(pid, f"pid {pid}")

    def thread_name(self, pid, tid):
        return self.thread_names.get((pid, tid), f"thread {tid}")

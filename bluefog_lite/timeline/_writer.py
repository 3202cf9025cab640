"""The background writer: drains the recorder, formats Chrome trace events, writes and flushes.

The file is a JSON array written one event per line ("[", then lines ending in
","). Only whole lines are handed to the OS, every ``FLUSH_S`` seconds, so the
file of an agent killed at any moment is a loadable, unterminated array. On a
clean stop the writer closes every span still open (an "E" at the stop time)
and terminates the array.

Perfetto drops slices that overlap partially on one (pid, tid) track, so the
writer keeps a stack of open spans per track: an end that names its activity
closes the spans opened inside it first and reopens them at the same instant,
and an end with nothing open (its begin happened before recording started) is
dropped. Timestamps never go backwards on a track.
"""
import json
import os
import sys
import threading
import time

FLUSH_S = 0.05          # wake-up period; the spec asks for a flush at least every 100 ms
METADATA_PID = 0        # pid of the agent-wide "bluefog_metadata" / "bluefog_end" events
MAIN_TID, COMM_TID = 1, 2


def _ts(t_ns):
    """Microseconds with nanosecond digits, exact (no float rounding)."""
    return f"{t_ns // 1000}.{t_ns % 1000:03d}"


class _Track:
    """One (pid, tid) row: its open spans and the last timestamp written on it."""
    __slots__ = ("tail", "stack", "last")

    def __init__(self, pid, tid):
        self.tail = f'"pid":{pid},"tid":{tid}}},\n'
        self.stack = []
        self.last = 0


class Writer:
    """Owns the output file of one timeline session and the thread that fills it."""

    def __init__(self, fd, path, recorder, metadata, thread_names):
        self.fd, self.path, self.recorder = fd, path, recorder
        self._pids = {}            # tensor name -> pid
        self._tids = {}            # thread ident -> tid
        self._tracks = {}          # (tensor name, thread ident) -> _Track
        self._quoted = {}          # activity -> JSON string literal
        self._names = dict(thread_names)   # thread ident -> name, fixed at start
        self.dropped_ends = 0
        self.failed = None         # the OSError that stopped writing, if any
        self._stop = threading.Event()
        self._thread = None
        for ident, name in thread_names.items():
            self._tid(ident, name)
        self._write(["[\n", _metadata_line("bluefog_metadata", metadata)])

    # ---- lifecycle ------------------------------------------------------------
    def start(self):
        self._thread = threading.Thread(target=self._run, name="bluefog-timeline-writer", daemon=True)
        self._thread.start()

    def close(self, t_stop_ns):
        """Drain everything, end the open spans at t_stop_ns, terminate the array, close."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        lines = []
        self._format_pending(lines)
        for track in self._tracks.values():
            t = _ts(max(t_stop_ns, track.last))
            while track.stack:
                lines.append(f'{{"name":{self._quote(track.stack.pop())},"ph":"E","ts":{t},{track.tail}')
        end = {"clean_shutdown": True, "dropped_unmatched_ends": self.dropped_ends}
        lines.append(_metadata_line("bluefog_end", end, last=True))
        self._write(lines)
        os.close(self.fd)

    def _run(self):
        while not self._stop.wait(FLUSH_S):
            lines = []
            self._format_pending(lines)
            if lines:
                self._write(lines)

    def _write(self, lines):
        if self.failed is not None:
            return
        data = "".join(lines).encode()
        try:
            while data:
                n = os.write(self.fd, data)
                data = data[n:]
        except OSError as exc:   # e.g. disk full: stop tracing, never take the job down
            self.failed = exc
            sys.stderr.write(f"bluefog_lite WARNING: timeline writing to {self.path} failed "
                             f"({exc}); the timeline is incomplete\n")

    # ---- formatting -------------------------------------------------------------
    def _quote(self, text):
        q = self._quoted.get(text)
        if q is None:
            q = self._quoted[text] = json.dumps(str(text))
        return q

    def _tid(self, ident, name=None):
        tid = self._tids.get(ident)
        if tid is None:
            tid = self._tids[ident] = len(self._tids) + 1
            if name is None:
                name = self.recorder.thread_names.get(ident) or _thread_name(ident, tid)
            self._names[ident] = name
        return tid

    def _new_track(self, name, ident, lines):
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            lines.append(f'{{"name":"process_name","ph":"M","pid":{pid},"tid":0,'
                         f'"args":{{"name":{self._quote(name)}}}}},\n')
            lines.append(f'{{"name":"process_sort_index","ph":"M","pid":{pid},"tid":0,'
                         f'"args":{{"sort_index":{pid}}}}},\n')
        tid = self._tid(ident)
        lines.append(f'{{"name":"thread_name","ph":"M","pid":{pid},"tid":{tid},'
                     f'"args":{{"name":{self._quote(self._names[ident])}}}}},\n')
        lines.append(f'{{"name":"thread_sort_index","ph":"M","pid":{pid},"tid":{tid},'
                     f'"args":{{"sort_index":{tid}}}}},\n')
        track = self._tracks[(name, ident)] = _Track(pid, tid)
        return track

    def _format_pending(self, lines):
        events = self.recorder.events
        pop = events.popleft
        tracks = self._tracks
        quote = self._quote
        for _ in range(len(events)):
            ph, t, name, activity, ident = pop()
            track = tracks.get((name, ident)) or self._new_track(name, ident, lines)
            if t < track.last:
                t = track.last
            track.last = t
            if ph == "B":
                track.stack.append(activity)
                lines.append(f'{{"name":{quote(activity)},"ph":"B","ts":{t // 1000}.{t % 1000:03d},'
                             f'{track.tail}')
            elif ph == "E":
                self._end(track, t, activity, lines)
            else:
                lines.append(f'{{"name":{quote(activity)},"ph":"i","s":"t",'
                             f'"ts":{t // 1000}.{t % 1000:03d},{track.tail}')

    def _end(self, track, t, activity, lines):
        stack = track.stack
        if activity is None or (stack and stack[-1] == activity):
            if not stack:
                self.dropped_ends += 1
                return
            lines.append(f'{{"name":{self._quote(stack.pop())},"ph":"E","ts":{_ts(t)},{track.tail}')
            return
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] == activity:
                break
        else:
            self.dropped_ends += 1
            return
        ts, inner = _ts(t), stack[i + 1:]
        for act in reversed(stack[i:]):
            lines.append(f'{{"name":{self._quote(act)},"ph":"E","ts":{ts},{track.tail}')
        for act in inner:
            lines.append(f'{{"name":{self._quote(act)},"ph":"B","ts":{ts},{track.tail}')
        del stack[i:]
        stack.extend(inner)


def _metadata_line(name, args, last=False):
    ending = "\n]\n" if last else ",\n"
    return (f'{{"name":"{name}","ph":"M","pid":{METADATA_PID},"tid":0,'
            f'"args":{json.dumps(args, sort_keys=True)}}}{ending}')


def _thread_name(ident, tid):
    if ident == threading.main_thread().ident:
        return "main"
    for thread in threading.enumerate():
        if thread.ident == ident:
            return thread.name
    return f"thread-{tid}"


def now_ns():
    return time.perf_counter_ns()

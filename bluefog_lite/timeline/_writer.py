"""The background writer: drains the recorder, formats Chrome trace events, writes and flushes.

The file is a JSON array written one event per line ("[", then lines ending in
","). Only whole lines are handed to the OS, every ``FLUSH_S`` seconds, so the
file of an agent killed at any moment is a loadable, unterminated array. A kill
can still cut a large write short, at a page boundary of the file (the kernel
copies page by page and checks for a fatal signal before each page): so every
page ends with a line's end (empty lines fill the rest of a page; JSON allows
them), and a line crosses a page boundary only if it is longer than a page. A
write that fails (a full disk) is cut back to its last whole line. On a
clean stop the writer ends every span still open at the stop time and
terminates the array.

Spans that contain no other span of their row (sub-phases, FORWARD, BACKWARD)
are recorded once they end, as one complete "X" event: one recording call and
one line instead of two. (Pairing begins and ends in the writer instead was
tried: it cost the writer 20% more CPU.) The spans that others nest in
(ENQUEUE_, MPI_, user activities) are begin/end pairs, written as they
happen, so that a killed agent's file shows what was in flight.

Perfetto drops slices that overlap partially on one (pid, tid) track, so the
writer keeps a stack of open spans per track (see _recorder.py for which span
an end closes): when that span is not the innermost, the spans opened inside
it are ended first and reopened at the same instant. An end with no matching
open span (its begin happened before recording started) is dropped.
Begins and ends never go backwards on a track. A complete span that began
before the last begin or end on its track (a BACKWARD recorded when the
gradient is ready, during which a communication of that parameter launched in
the forward pass ended) is written as adjacent pieces cut at the begins and ends
in between, each nested where it lies, so that no compute time goes missing; it
starts no earlier than the oldest of the last _MARKS of them and than the end
of the complete span before it, and what follows it on its track no earlier
than its end.
"""
import collections
import json
import os
import re
import sys
import threading

from . import _recorder

PAGE = 4096             # no line crosses a multiple of it in the file (a cut lands on a line's end)
FLUSH_S = 0.05          # wake-up period; the spec asks for a flush at least every 100 ms
METADATA_PID = 0        # pid of the agent-wide "bluefog_metadata" / "bluefog_end" events
MAIN_TID, COMM_TID = 1, 2
_SLICE = 20000          # events formatted per write while a backlog is drained (~20 ms each)
_CACHED = 4096          # entries of the writer's caches of JSON text (cleared when full)
_FINISHED_KEPT = 2048   # finished rows of unnamed calls kept for late events (COPY_TO_DEVICE): ~1024 calls
_MARKS = 8              # the last begins and ends kept per track, where a complete span beginning earlier is cut
# the form of the names ops._op_name gives calls without one (each used by one call
# only), which users may not choose (ops.check_name)
GENERATED_NAME = re.compile(r"[a-z_]+\.noname\.[0-9]+")


def _ts(t_ns):
    """Microseconds with nanosecond digits, exact (no float rounding)."""
    return f"{t_ns // 1000}.{t_ns % 1000:03d}"


class _Track:
    """One (pid, tid) row: its open spans, the last timestamp written on it and the
    last few times that a begin or end was (ascending; a complete span's end is
    not one: a complete span beginning before it starts after it, as it did)."""
    __slots__ = ("tail", "stack", "last", "marks", "xend")

    def __init__(self, pid, tid):
        self.tail = f'"pid":{pid},"tid":{tid}}},\n'
        self.stack = []
        self.last = 0
        self.marks = collections.deque(maxlen=_MARKS)
        self.xend = 0       # the end of the last complete span written on the row


class Writer:
    """Owns the output file of one timeline session and the thread that fills it."""

    def __init__(self, fd, path, recorder, metadata, thread_names):
        self.fd, self.path, self.recorder = fd, path, recorder
        self._pids = {}            # tensor name -> pid
        self._last_pid = 0
        self._finished = collections.deque()    # (name, ident) of finished rows of unnamed calls, oldest first
        self._tids = {}            # thread ident -> tid
        self._last_tid = 0
        self._tracks = {}          # (tensor name, thread ident) -> _Track
        self._retired = []         # tracks of threads that ended (their ident is another's now)
        self._quoted = {}          # text -> JSON string literal (a cache)
        self._heads_of = {}        # activity -> starts of its B, E, i, X lines (a cache)
        self._names = dict(thread_names)   # thread ident -> name, fixed at start
        self.dropped_ends = 0
        self.failed = None         # the error that stopped writing, if any
        self._offset = 0           # bytes in the file
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
        if self.failed is None:
            self._format_pending(lines)
        for track in self._retired + list(self._tracks.values()):
            t = _ts(max(t_stop_ns, track.last))
            while track.stack:
                lines.append(f"{self._head(track.stack.pop()[0], 1)}{t},{track.tail}")
        end = {"clean_shutdown": True, "dropped_unmatched_ends": self.dropped_ends}
        lines.append(_metadata_line("bluefog_end", end, last=True))
        self._write(lines)
        os.close(self.fd)

    def _run(self):
        try:
            while not self._stop.wait(FLUSH_S):
                more = True
                while more and not self._stop.is_set():   # in slices: a backlog goes out as it is formatted
                    lines = []
                    more = self._format_pending(lines, _SLICE)
                    if lines:
                        self._write(lines)
        except Exception as exc:   # a tracing bug must not abort the job (init's thread excepthook would)
            self.failed = exc
            if _recorder.current is self.recorder:
                _recorder.current = None
            sys.stderr.write(f"bluefog_lite WARNING: the timeline writer for {self.path} stopped: {exc!r}\n")

    def _write(self, lines):
        if self.failed is not None:
            return
        data = _paged("".join(lines).encode(), self._offset)
        start, done = self._offset, 0
        try:
            while done < len(data):
                done += os.write(self.fd, data[done:])
        except OSError as exc:   # e.g. disk full: stop tracing, never take the job down
            self.failed = exc
            if _recorder.current is self.recorder:
                _recorder.current = None
            try:                 # no cut line: the file stays loadable
                os.ftruncate(self.fd, start + data.rfind(b"\n", 0, done) + 1)
            except OSError:
                pass
            sys.stderr.write(f"bluefog_lite WARNING: timeline writing to {self.path} failed "
                             f"({exc}); the timeline is incomplete\n")
        self._offset = start + done

    # ---- formatting -------------------------------------------------------------
    def _quote(self, text):
        q = self._quoted.get(text)
        if q is None:
            if len(self._quoted) >= _CACHED:     # (ever new activity names must not grow it without bound)
                self._quoted.clear()
            q = self._quoted[text] = json.dumps(str(text))
        return q

    def _tid(self, ident, name=None):
        tid = self._tids.get(ident)
        if tid is None:
            self._last_tid = tid = self._tids[ident] = self._last_tid + 1
            if name is None:
                name = self.recorder.thread_names.get(ident) or _thread_name(ident, tid)
            self._names[ident] = name
        return tid

    def _new_track(self, name, ident, lines):
        pid = self._pids.get(name)
        if pid is None:
            self._last_pid += 1
            pid = self._pids[name] = self._last_pid
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

    def _forget(self, name, ident):
        """The row (name, ident) has no open span left: if name is an unnamed call's
        (<op>.noname.<n>, never used again), its track (and with its last track its
        pid) is dropped once _FINISHED_KEPT later such rows have finished (a call
        finishes two: its caller's and the communication thread's): kept, they
        grew the writer's memory by ~3 KB per unnamed call; dropped at once, an event
        that comes after the operation's end (the copy of a GPU result back to its
        device, recorded at synchronize) opened a second row of the same name."""
        if not GENERATED_NAME.fullmatch(name):
            return
        finished = self._finished
        finished.append((name, ident))
        while len(finished) > _FINISHED_KEPT:
            old = finished.popleft()
            track = self._tracks.get(old)
            if track is None or track.stack:     # (already dropped; or open again: kept)
                continue
            del self._tracks[old]
            if not any((old[0], other) in self._tracks for other in self._tids):
                del self._pids[old[0]]

    def _new_thread(self, ident, name):
        """ident is a thread named name from now on (see Recorder.know_thread); if it
        was another's (one that ended), that one's rows are kept aside (close() ends
        their open spans) and the new thread gets its own tid and rows."""
        if ident in self._tids:
            for key in [k for k in self._tracks if k[1] == ident]:
                track = self._tracks.pop(key)
                if track.stack:     # (spans to end at close)
                    self._retired.append(track)
            del self._tids[ident]
        self._tid(ident, name)

    def _head(self, activity, kind):
        """The start of activity's line of kind 0 (B), 1 (E), 2 (instant) or 3 (X)."""
        heads = self._heads_of.get(activity)
        return (heads or self._heads(activity))[kind]

    def _heads(self, activity):
        """The constant starts of this activity's B, E, instant and X lines."""
        q = self._quote(activity)
        if len(self._heads_of) >= _CACHED:
            self._heads_of.clear()
        heads = self._heads_of[activity] = (f'{{"name":{q},"ph":"B","ts":', f'{{"name":{q},"ph":"E","ts":',
                                            f'{{"name":{q},"ph":"i","s":"t","ts":',
                                            f'{{"name":{q},"ph":"X","ts":')
        return heads

    def _format_pending(self, lines, most=None):
        """Format the queued events (at most ``most``) into lines (the hot loop of the
        writer thread); True if some are left."""
        events = self.recorder.events
        pop = events.popleft
        tracks, heads_of, append = self._tracks, self._heads_of, lines.append
        queued = len(events)
        taken = queued if most is None or most > queued else most
        for _ in range(taken):
            ph, t, name, activity, ident = pop()
            if ph == "T":
                self._new_thread(ident, activity)
                continue
            track = tracks.get((name, ident))
            if track is None:
                track = self._new_track(name, ident, lines)
                if ph != "B" and ph != "S" and ".noname." in name:
                    # a row that begins with no begin (a COPY_TO_DEVICE of a call synchronized
                    # on another thread; an end of a call begun before recording) has no end to wait for
                    self._forget(name, ident)
            if ph == "X":
                # A whole span, recorded at its end, after what happened inside it: cut
                # where something began or ended on its row since it began (the last
                # piece starts at the last of them); what follows starts no earlier
                # than its end.
                begin, t = t
                heads = heads_of.get(activity) or self._heads(activity)
                if begin < track.last:
                    begin = self._pieces(track, begin, t, heads[3], append)
                if t < begin:
                    t = begin
                track.last = track.xend = t
                s, d = str(begin), t - begin
                d = str(d) if d >= 1000 else f"{d:04d}"     # (cheaper than divmod)
                append(f"{heads[3]}{s[:-3]}.{s[-3:]},\"dur\":{d[:-3]}.{d[-3:]},{track.tail}")
                continue
            if ph == "i":
                # an instant cannot break nesting: it does not move the row's time (a
                # span recorded at its end may still begin before it)
                s = str(t if t > track.last else track.last)
                heads = heads_of.get(activity) or self._heads(activity)
                append(f"{heads[2]}{s[:-3]}.{s[-3:]},{track.tail}")
                continue
            if t < track.last:
                t = track.last
            else:
                track.last = t
            marks = track.marks
            if not marks or marks[-1] != t:
                marks.append(t)
            # perf_counter_ns counts ns since boot (>= 1000): the string split
            # gives exact microseconds with three decimals, cheaply
            s = str(t)
            if ph == "E":
                stack = track.stack
                if stack and (stack[-1][0] == activity or (activity is None and not stack[-1][1])):
                    ended = stack.pop()[0]
                    heads = heads_of.get(ended) or self._heads(ended)
                    append(f"{heads[1]}{s[:-3]}.{s[-3:]},{track.tail}")
                    if not stack and ".noname." in name:
                        self._forget(name, ident)
                else:
                    self._end_inner(track, f"{s[:-3]}.{s[-3:]}", activity, lines)
            else:
                track.stack.append((activity, ph == "S"))
                heads = heads_of.get(activity) or self._heads(activity)
                append(f"{heads[0]}{s[:-3]}.{s[-3:]},{track.tail}")
        return taken < queued

    @staticmethod
    def _pieces(track, begin, end, head, append):
        """Write the complete span [begin, end] (head: the start of its line) but its last
        piece, cut at the track's marks after begin; return the last piece's begin.
        Begins no earlier than the oldest mark if older ones may have been dropped, nor
        than the end of the last complete span on the track."""
        marks = track.marks
        if len(marks) == _MARKS and marks[0] > begin:
            begin = marks[0]
        if begin < track.xend:      # (no piece starts inside an earlier complete span)
            begin = track.xend
        for m in marks:
            if begin < m < end:
                s, d = _ts(begin), _ts(m - begin)
                append(f'{head}{s},"dur":{d},{track.tail}')
                begin = m
        return begin if begin >= track.last else track.last

    def _end_inner(self, track, ts, activity, lines):
        """An end for a span that is not the innermost: close the spans opened
        inside it, close it, reopen them (all at ts) so that slices stay nested."""
        stack = track.stack
        i = len(stack) - 1
        while i >= 0 and (stack[i][0] != activity if activity is not None else stack[i][1]):
            i -= 1
        if i < 0:
            self.dropped_ends += 1      # its begin was not recorded
            return
        inner = stack[i + 1:]
        for act, _ in reversed(stack[i:]):
            lines.append(f"{self._head(act, 1)}{ts},{track.tail}")
        for act, _ in inner:
            lines.append(f"{self._head(act, 0)}{ts},{track.tail}")
        del stack[i:]
        stack.extend(inner)


def _paged(data, offset):
    """data (whole lines) to be written at offset, with empty lines added so that
    every multiple of PAGE in the file falls right after a newline (unless a line
    is longer than a page). Empty lines, not spaces: a viewer that strips the
    newlines and a comma at the end of a cut file then finds a comma."""
    room = PAGE - offset % PAGE      # bytes up to the next page boundary
    if len(data) <= room:
        return data
    out, pos, size = [], 0, len(data)
    while size - pos > room:
        cut = data.rfind(b"\n", pos, pos + room)    # the last line that ends in this page
        if cut >= 0:
            out.append(data[pos:cut + 1])
            out.append(b"\n" * (pos + room - cut - 1))
            pos, room = cut + 1, PAGE
        elif room < PAGE:            # the write's first line would cross: it starts the next page
            out.append(b"\n" * room)
            room = PAGE
        else:                        # a line longer than a page: it crosses
            cut = data.find(b"\n", pos + room)
            if cut < 0:
                break
            out.append(data[pos:cut + 1])
            room = PAGE - (cut + 1 - pos - room) % PAGE
            pos = cut + 1
    out.append(data[pos:])
    return b"".join(out)


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


"""Reading timeline files back: events (also from a killed agent's unterminated
array, and streamed one at a time for large files), metadata, and the spans of
every (pid, tid) row with their nesting."""
import collections
import json
import math
import os
import re

Span = collections.namedtuple("Span", "pid tid name begin end parent")
Span.__doc__ = "One slice: begin/end in µs; parent is the enclosing slice's name on the row, or None."


def read_events(path):
    """The list of events in a timeline file.

    A file whose writer was killed ends inside the array (maybe even inside a
    line, if the kill interrupted a write): the incomplete last line is dropped
    and the array closed."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    if not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
    body = text.rstrip().rstrip(",")
    return json.loads(body + "]") if body.startswith("[") else []


def metadata(events):
    """The args of the file's bluefog_metadata event (rank, size, hostname, clock offset...)."""
    for ev in events:
        if ev.get("ph") == "M" and ev.get("name") == "bluefog_metadata":
            if not isinstance(ev.get("args"), dict):
                raise ValueError("its bluefog_metadata event has no args object")
            return ev["args"]
    raise ValueError("no bluefog_metadata event: not a bluefog_lite timeline file")


def read_spans(events, complete=True):
    """Every slice ("B"/"E" pairs and "X" events) as a Span, checking what a
    viewer needs: the timestamps of "B", "E" and instant events never decrease
    on a row in file order (an "X" is written when it ends, after what happened
    inside it), each "E" closes the innermost open "B" of its row, and slices
    nest (no partial overlap). complete=True also requires every "B" to be closed (a clean
    shutdown); a killed agent's spans still open are left out.
    Raises ValueError describing the first violation."""
    last = collections.defaultdict(float)
    open_b = collections.defaultdict(list)
    rows = collections.defaultdict(list)      # (pid, tid) -> [(begin, end, name)]
    for ev in events:
        ph = ev.get("ph")
        if ph not in ("B", "E", "X", "i"):
            continue
        key, ts = (ev["pid"], ev["tid"]), ev["ts"]
        if ph == "X":
            rows[key].append((ts, ts + ev["dur"], ev["name"], _ns(ts), _ns(ts) + _ns(ev["dur"])))
            continue
        if ts < last[key]:
            raise ValueError(f"time goes backwards on row {key}: {ev}")
        last[key] = ts
        if ph == "B":
            open_b[key].append((ev["name"], ts))
        elif ph == "E":
            if not open_b[key]:
                raise ValueError(f"E without an open B on row {key}: {ev}")
            name, begin = open_b[key].pop()
            if ev.get("name", name) != name:
                raise ValueError(f"E {ev['name']!r} closes B {name!r} on row {key}")
            rows[key].append((begin, ts, name, _ns(begin), _ns(ts)))
    if complete:
        still = {k: v for k, v in open_b.items() if v}
        if still:
            raise ValueError(f"spans left open: {still}")
    spans = []
    for key, row in rows.items():
        stack = []
        # compared in whole nanoseconds, the files' resolution (ts + dur in floats
        # ends a hair after the next span's begin, more so the longer the host is up)
        slack = _slack_ns(max(abs(s[1]) for s in row))
        for begin, end, name, b, e in sorted(row, key=lambda s: (s[3], -s[4])):
            while stack and stack[-1][1] <= b + slack:
                stack.pop()
            if stack and e > stack[-1][1] + slack:
                raise ValueError(f"slices overlap partially on row {key}: {stack[-1][2]} and {(begin, end, name)}")
            spans.append(Span(key[0], key[1], name, begin, end, stack[-1][2] if stack else None))
            stack.append((b, e, name))
    return spans


def _ns(us):
    """Whole nanoseconds of a time the writer wrote with three decimals, read back as a
    float: the value whose text reads back as it (round(us * 1000) alone is 1 ns off for
    some times once the clock passes 2**42 us, a host up 51 days)."""
    n = round(us * 1000)
    for c in (n, n - 1, n + 1):
        a = abs(c)
        if float(f"{'-' if c < 0 else ''}{a // 1000}.{a % 1000:03d}") == us:
            return c
    return n


def _slack_ns(us):
    """How many nanoseconds two times near ``us`` (float microseconds) may be off from
    each other after reading: 0 while floats there resolve a nanosecond (up to 2**43 us,
    ~101 days since the boot of the host), then twice the spacing of floats there."""
    spacing = math.ulp(us) * 1000
    return 0 if spacing < 1 else 2 * math.ceil(spacing)


# ---- streaming (bftimeline): one event at a time, for files of hundreds of MB ----

# The writer's begin/end/instant/complete lines; anything else goes through json.loads.
_FAST_LINE = re.compile(r'\{"name":"([^"\\]*)","ph":"([BEiX])",(?:"s":"t",)?"ts":(-?[0-9.]+),'
                        r'(?:"dur":([0-9.]+),)?"pid":(-?\d+),"tid":(-?\d+)\}\Z')


def iter_events(path):
    """The events of a timeline file one by one, without holding the file in memory.

    Reads the writer's layout (an array with one event per line) line by line;
    like read_events it accepts a killed agent's file (no closing bracket, the
    last line maybe cut) and drops an incomplete last line. Any other JSON
    layout (one line, indented, an object with "traceEvents") is loaded whole.
    Raises ValueError naming the path when the file is not a JSON trace."""
    try:
        yield from _iter_lines(path)
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a timeline file (not UTF-8 text)") from None


def _iter_lines(path):
    with open(path, encoding="utf-8") as f:
        first = f.readline()
        if first.strip() != "[":
            yield from _load_whole(path)
            return
        bad = None           # (line number, text) of an unparsable line, fatal unless it is the last
        for number, line in enumerate(f, start=2):
            line = line.rstrip()
            if line.endswith(","):
                line = line[:-1]
            if not line or line == "]":
                continue
            if bad is not None:
                raise ValueError(f"{path}: line {bad[0]} is not a JSON trace event: {bad[1][:80]!r}")
            m = _FAST_LINE.match(line)
            if m is not None and (m[2] != "X" or m[4] is not None):   # (an "X" without its dur: below)
                name, ph, ts, dur, pid, tid = m.groups()
                ev = {"name": name, "ph": ph, "ts": float(ts), "pid": int(pid), "tid": int(tid)}
                if ph == "i":
                    ev["s"] = "t"
                elif ph == "X":
                    ev["dur"] = float(dur)
                yield ev
                continue
            if line.endswith("]"):       # "...}]": the array closed on the last event's line
                line = line[:-1].rstrip().rstrip(",")
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                if number == 2:          # an indented array: not the one-event-per-line layout
                    yield from _load_whole(path)
                    return
                bad = (number, line)
                continue
            if not isinstance(ev, dict):
                raise ValueError(f"{path}: line {number} is not a JSON trace event: {line[:80]!r}")
            yield ev


def _load_whole(path):
    try:
        events = read_events(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a timeline file (not a JSON trace: {exc})") from None
    if isinstance(events, dict):
        events = events.get("traceEvents")
    if not isinstance(events, list) or not all(isinstance(ev, dict) for ev in events):
        raise ValueError(f"{path} is not a timeline file (not a JSON array of trace events)")
    return iter(events)


def is_empty(path):
    """True for a file its agent opened but wrote no whole event into: at most "[\\n",
    or that and the start of its first line (cut by a full disk or a short write)."""
    if os.path.getsize(path) <= 2:
        return True
    with open(path, "rb") as f:
        if f.read(2) != b"[\n":
            return False
        rest = f.read(1 << 16)
    if b"\n" in rest.rstrip(b"\n"):
        return False
    try:
        json.loads(rest.decode().strip().rstrip(","))
    except (ValueError, UnicodeDecodeError):
        return True        # (json.JSONDecodeError is a ValueError)
    return False


def read_metadata(path, within=64):
    """The bluefog_metadata args of a file, reading only its first events (the
    writer puts them first). Raises ValueError naming the path if absent."""
    if is_empty(path):
        raise ValueError(f"{path} is empty: its agent wrote no timeline (killed before its writer's first "
                         "flush, or a file left from elsewhere; --allow-missing reads the run without it)")
    for k, ev in enumerate(iter_events(path)):
        if ev.get("ph") == "M" and ev.get("name") == "bluefog_metadata":
            if not isinstance(ev.get("args"), dict):
                raise ValueError(f"{path}: its bluefog_metadata event has no args object")
            return ev["args"]
        if k >= within:
            break
    raise ValueError(f"{path} is not a bluefog_lite timeline file (no bluefog_metadata event at its start)")

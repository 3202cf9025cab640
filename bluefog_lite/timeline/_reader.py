"""Reading timeline files back: events (also from a killed agent's unterminated
array), metadata, and the spans of every (pid, tid) row with their nesting."""
import collections
import json

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
            return ev["args"]
    raise ValueError("no bluefog_metadata event: not a bluefog_lite timeline file")


def read_spans(events, complete=True):
    """Every slice ("B"/"E" pairs and "X" events) as a Span, checking what a
    viewer needs: timestamps never decrease on a row in file order, each "E"
    closes the innermost open "B" of its row, and slices nest (no partial
    overlap). complete=True also requires every "B" to be closed (a clean
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
            rows[key].append((begin, ts, name))
        elif ph == "X":
            rows[key].append((ts, ts + ev["dur"], ev["name"]))
    if complete:
        still = {k: v for k, v in open_b.items() if v}
        if still:
            raise ValueError(f"spans left open: {still}")
    spans = []
    for key, row in rows.items():
        stack = []
        for begin, end, name in sorted(row, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= begin:
                stack.pop()
            if stack and end > stack[-1][1] + 1e-6:
                raise ValueError(f"slices overlap partially on row {key}: {stack[-1]} and {(begin, end, name)}")
            spans.append(Span(key[0], key[1], name, begin, end, stack[-1][2] if stack else None))
            stack.append((begin, end, name))
    return spans

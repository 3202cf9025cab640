"""The timeline writer and control, in one process (no MPI job but one of a single
agent): nesting repair, escaping, crash-safe partial files, environment validation."""
import json
import os
import random
import re
import tempfile
import threading
import time

import pytest

from bluefog_lite.timeline import _api, _control, _recorder
from bluefog_lite.timeline._reader import iter_events, read_events, read_spans
from bluefog_lite.timeline._writer import PAGE, Writer
from mpi_helpers import run_agents

META = {"rank": 0}


def write(tmp_path, events, names=None):
    """Run a Writer over synthetic event tuples; return the parsed file."""
    rec = _recorder.Recorder()
    rec.events.extend(events)
    path = tmp_path / "t0.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    w = Writer(fd, str(path), rec, META, names or {})
    w.close(10_000_000)
    with open(path) as f:
        return json.load(f), w


def spans(events):
    """(pid, name, begin, end) per slice; read_spans asserts proper nesting per (pid, tid)."""
    return sorted((s.pid, s.name, s.begin, s.end) for s in read_spans(events))


def test_partially_overlapping_spans_are_split_to_nest(tmp_path):
    t = 1
    events, w = write(tmp_path, [("B", 1000, "p", "BACKWARD", t), ("B", 2000, "p", "ENQUEUE_X", t),
                                 ("E", 3000, "p", "BACKWARD", t), ("E", 5000, "p", "ENQUEUE_X", t)])
    got = sorted((name, b, e) for _, name, b, e in spans(events))
    assert got == [("BACKWARD", 1.0, 3.0), ("ENQUEUE_X", 2.0, 3.0), ("ENQUEUE_X", 3.0, 5.0)]


def test_anonymous_end_skips_scoped_spans(tmp_path):
    """A communication launched after forward (adapt-with-combine) is still in
    flight when the parameter's BACKWARD (a scoped span) begins; the op's end,
    recorded by the communication thread without an activity, must close the
    ENQUEUE span, not BACKWARD."""
    t = 1
    events, w = write(tmp_path, [("B", 1000, "p", "ENQUEUE_X", t), ("S", 2000, "p", "BACKWARD", t),
                                 ("E", 3000, "p", None, t), ("E", 4000, "p", "BACKWARD", t)])
    got = sorted((name, b, e) for _, name, b, e in spans(events))
    assert got == [("BACKWARD", 2.0, 3.0), ("BACKWARD", 3.0, 4.0), ("ENQUEUE_X", 1.0, 3.0)]
    assert w.dropped_ends == 0


def test_unmatched_end_is_dropped_and_open_spans_end_at_stop(tmp_path):
    events, w = write(tmp_path, [("E", 1000, "a", None, 7), ("B", 2000, "a", "X", 7),
                                 ("E", 2500, "a", "NOT_OPEN", 7)])
    assert w.dropped_ends == 2
    assert [(n, b, e) for _, n, b, e in spans(events)] == [("X", 2.0, 10000.0)]
    assert events[-1]["name"] == "bluefog_end" and events[-1]["args"]["clean_shutdown"]


def test_time_never_goes_backwards_on_a_row(tmp_path):
    # the end of an ENQUEUE is stamped by the communication thread: it may be a hair early
    events, _ = write(tmp_path, [("B", 5000, "a", "X", 1), ("E", 4990, "a", None, 1)])
    assert spans(events) == [(1, "X", 5.0, 5.0)]


def test_complete_spans_are_written_after_what_they_contain(tmp_path):
    """Sub-phases, FORWARD and BACKWARD are recorded once they end ("X"): after the
    instants inside them, which must neither move them nor be moved."""
    c = 2
    events, _ = write(tmp_path, [("B", 1000, "p", "MPI_OP", c), ("i", 2500, "p", "SEND_TO 1", c),
                                 ("X", (2000, 4000), "p", "COMMUNICATE", c),
                                 ("X", (4000, 4500), "p", "COMPUTE_AVERAGE", c), ("E", 5000, "p", None, c)])
    assert spans(events) == [(1, "COMMUNICATE", 2.0, 4.0), (1, "COMPUTE_AVERAGE", 4.0, 4.5),
                             (1, "MPI_OP", 1.0, 5.0)]
    parents = {s.name: s.parent for s in read_spans(events)}
    assert parents == {"MPI_OP": None, "COMMUNICATE": "MPI_OP", "COMPUTE_AVERAGE": "MPI_OP"}
    assert [e["ts"] for e in events if e["ph"] == "i"] == [2.5]


def test_complete_span_is_cut_where_a_span_ended_inside_it_and_pushes_what_follows(tmp_path):
    # BACKWARD's begin is the end of the previous stretch; the ENQUEUE that ended
    # meanwhile on its row (stamped by the communication thread) cuts it in two pieces,
    # the first inside the ENQUEUE (before, the first was dropped: compute time and its
    # overlap with communication went missing), and a begin stamped a hair before
    # BACKWARD's end is moved after it
    t = 1
    events, _ = write(tmp_path, [("B", 1000, "p", "ENQUEUE_X", t), ("E", 3000, "p", "ENQUEUE_X", t),
                                 ("X", (2000, 5000), "p", "BACKWARD", t), ("B", 4900, "p", "ENQUEUE_X", t),
                                 ("E", 6000, "p", "ENQUEUE_X", t)])
    assert spans(events) == [(1, "BACKWARD", 2.0, 3.0), (1, "BACKWARD", 3.0, 5.0), (1, "ENQUEUE_X", 1.0, 3.0),
                             (1, "ENQUEUE_X", 5.0, 6.0)]
    parents = sorted((s.begin, s.parent) for s in read_spans(events) if s.name == "BACKWARD")
    assert parents == [(2.0, "ENQUEUE_X"), (3.0, None)]


def test_a_piece_never_starts_inside_an_earlier_complete_span(tmp_path):
    # (a module calling itself in its forward: the inner FORWARD ends inside the outer one,
    # and a launch's ENQUEUE begins and ends in between)
    t = 1
    events, _ = write(tmp_path, [("X", (10000, 20000), "p", "BACKWARD", t), ("B", 25000, "p", "ENQUEUE_X", t),
                                 ("E", 30000, "p", "ENQUEUE_X", t), ("X", (15000, 40000), "p", "FORWARD", t)])
    assert [(n, b, e) for _, n, b, e in spans(events)] == [
        ("BACKWARD", 10.0, 20.0), ("ENQUEUE_X", 25.0, 30.0), ("FORWARD", 20.0, 25.0), ("FORWARD", 25.0, 30.0),
        ("FORWARD", 30.0, 40.0)]


def test_complete_span_is_cut_at_every_begin_and_end_inside_it(tmp_path):
    """Pieces tile the span, each nested where it lies (read_spans checks the nesting);
    with more begins and ends inside than the writer keeps, it starts at the oldest kept."""
    t = 1
    inside = [("B", 2000, "p", "A", t), ("B", 2500, "p", "C", t), ("E", 3000, "p", "C", t), ("E", 3500, "p", "A", t)]
    events, _ = write(tmp_path, inside + [("X", (1500, 4000), "p", "BACKWARD", t)])
    assert [(b, e) for _, n, b, e in spans(events) if n == "BACKWARD"] == \
        [(1.5, 2.0), (2.0, 2.5), (2.5, 3.0), (3.0, 3.5), (3.5, 4.0)]
    many = [(ph, 2000 + 100 * i, "p", "A", t) for i, ph in enumerate("BEBEBEBEBE")]     # ten marks, 2.0 .. 2.9
    events, _ = write(tmp_path, many + [("X", (1500, 4000), "p", "BACKWARD", t)])
    pieces = [(b, e) for _, n, b, e in spans(events) if n == "BACKWARD"]
    assert pieces[0][0] == 2.2 and pieces[-1] == (2.9, 4.0), pieces
    assert all(abs(a[1] - b[0]) < 1e-9 for a, b in zip(pieces, pieces[1:])), pieces


@pytest.mark.parametrize("dur_ns, text", [(0, "0.000"), (7, "0.007"), (999, "0.999"), (1000, "1.000"),
                                          (123456789, "123456.789")])
def test_complete_span_durations_are_exact(tmp_path, dur_ns, text):
    write(tmp_path, [("X", (1234567, 1234567 + dur_ns), "p", "A", 1)])
    line = next(x for x in (tmp_path / "t0.json").read_text().splitlines() if '"ph":"X"' in x)
    assert f'"ts":1234.567,"dur":{text},' in line
    assert list(iter_events(tmp_path / "t0.json")) == read_events(tmp_path / "t0.json")


def test_names_are_escaped_and_rows_named(tmp_path):
    odd = 'we"ird\\name\n'
    main = threading.main_thread().ident
    events, _ = write(tmp_path, [("B", 1234567, odd, 'A"B', main), ("E", 1234999, odd, None, 99)],
                      names={main: "main"})
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert procs == {1: odd}
    assert threads == {(1, 1): "main", (1, 2): "thread-2"}
    b = next(e for e in events if e["ph"] == "B")
    assert b["name"] == 'A"B' and b["ts"] == 1234.567


def test_rows_of_unnamed_calls_are_forgotten_once_finished(tmp_path):
    """Each unnamed call has a name of its own (<op>.noname.<n>) that never comes
    back: its rows (caller and communication thread) are dropped once 1024 later
    such rows have finished, so the writer's memory does not grow by ~1 KB per call,
    and an event that comes after the call's end (COPY_TO_DEVICE, at synchronize)
    still finds its row; every row keeps a pid of its own and its name, and a named
    row stays."""
    from bluefog_lite.timeline._writer import _FINISHED_KEPT
    caller, comm = 1, 2
    events = [("B", 1500, "w", "ENQUEUE_NEIGHBOR_ALLREDUCE", caller)]
    n = 3000
    for i in range(n):
        name, t = f"allreduce.noname.{i}", 2000 + 10 * i
        events += [("B", t, name, "ENQUEUE_ALLREDUCE", caller), ("B", t + 1, name, "MPI_ALLREDUCE", comm),
                   ("X", (t + 2, t + 3), name, "COMMUNICATE", comm), ("i", t + 3, name, "SEND_TO 1", comm),
                   ("E", t + 4, name, None, comm), ("E", t + 5, name, None, caller)]
    late = f"allreduce.noname.{n - 1000}"     # (about 1024 calls are kept)
    events += [("X", (10 ** 6, 10 ** 6 + 5), late, "COPY_TO_DEVICE", caller),
               ("B", 2 * 10 ** 6, "allreduce.noname.7x", "A", caller),
               ("E", 2 * 10 ** 6 + 1, "allreduce.noname.7x", "A", caller)]
    got, w = write(tmp_path, events)
    assert ("w", caller) in w._tracks and ("allreduce.noname.7x", caller) in w._tracks   # (not generated)
    assert len(w._tracks) == _FINISHED_KEPT + 2 and len(w._pids) <= _FINISHED_KEPT + 2
    procs = [(e["pid"], e["args"]["name"]) for e in got if e["name"] == "process_name"]
    assert len(procs) == n + 2 and len({pid for pid, _ in procs}) == n + 2
    assert sorted(name for _, name in procs) == sorted(["w", "allreduce.noname.7x"]
                                                       + [f"allreduce.noname.{i}" for i in range(n)])
    found = spans(got)
    assert len(found) == 3 * n + 3
    pid_of = {name: pid for pid, name in procs}
    assert [(p, b) for p, n_, b, _ in found if n_ == "COPY_TO_DEVICE"] == [(pid_of[late], 1000.0)]
    assert [(n_, b, e) for _, n_, b, e in found if n_ == "ENQUEUE_NEIGHBOR_ALLREDUCE"] == [
        ("ENQUEUE_NEIGHBOR_ALLREDUCE", 1.5, 10000.0)]     # still open at the stop: ended there


def test_rows_of_unnamed_calls_without_a_begin_are_forgotten_too(tmp_path):
    """A row that gets only complete spans (the COPY_TO_DEVICE of an unnamed call
    synchronized on another thread than the one that made it) or only an end (a
    call begun before recording began) never empties a stack: it is forgotten
    like the others, not kept for the file's life."""
    from bluefog_lite.timeline._writer import _FINISHED_KEPT
    events = []
    for i in range(3 * _FINISHED_KEPT):
        name, t = f"allreduce.noname.{i}", 2000 + 10 * i
        events += [("X", (t, t + 2), name, "COPY_TO_DEVICE", 3), ("E", t + 3, name, None, 4)]
    got, w = write(tmp_path, events)
    assert len(w._tracks) <= _FINISHED_KEPT and len(w._pids) <= _FINISHED_KEPT
    assert w.dropped_ends == 3 * _FINISHED_KEPT
    assert sum(e["name"] == "process_name" for e in got) == 3 * _FINISHED_KEPT


def test_caches_of_ever_new_activity_names_stay_bounded(tmp_path):
    """A user activity named anew each step (f"STEP_{i}") must not grow the writer's
    caches without bound; spans open while a cache is emptied still end by name."""
    t = 1
    events = [("S", 1000, "row", "EPOCH", t)]
    for i in range(10000):
        events += [("S", 2000 + 3 * i, "row", f"STEP_{i}", t), ("E", 2001 + 3 * i, "row", f"STEP_{i}", t)]
    events.append(("E", 10 ** 6, "row", "EPOCH", t))
    got, w = write(tmp_path, events)
    assert len(w._heads_of) <= 4096 and len(w._quoted) <= 4096
    found = spans(got)
    assert len(found) == 10001 and ("EPOCH", 1.0, 1000.0) in [(n, b, e) for _, n, b, e in found]
    assert [n for _, n, _, _ in found].count("STEP_9999") == 1


def test_file_loads_while_being_written(tmp_path):
    """What a kill -9 leaves: the lines flushed so far, as an unterminated array."""
    rec = _recorder.Recorder()
    path = tmp_path / "t0.json"
    w = Writer(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644), str(path), rec, META, {})
    w.start()
    for k in range(100):
        rec.begin("x", "A", 1)
        rec.end("x", 1)
    # flushed every FLUSH_S (50 ms) without a close; polled, not timed: a loaded host
    # may run the writer late
    deadline = time.monotonic() + 5.0
    while True:
        time.sleep(0.05)
        events = read_events(path)
        if sum(e["ph"] == "B" for e in events) == 100 or time.monotonic() > deadline:
            break
    assert sum(e["ph"] == "B" for e in events) == 100
    w.close(time.perf_counter_ns())
    with open(path) as f:
        assert len(json.load(f)) == len(events) + 1


def test_reader_drops_a_torn_last_line(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('[\n{"name":"bluefog_metadata","ph":"M","pid":0,"tid":0,"args":{}},\n{"name":"A","ph":"B","ts":1')
    assert len(read_events(path)) == 1


def test_user_api_off_is_false_and_validates():
    assert _recorder.current is None
    assert _api.timeline_start_activity("t", "A") is False
    assert _api.timeline_end_activity("t") is False
    with _api.timeline_context("t", "A") as on:
        assert on is False
    with pytest.raises(TypeError, match="tensor_name"):
        _api.timeline_start_activity(3, "A")
    with pytest.raises(TypeError, match="activity_name"):
        _api.timeline_context("t", "")
    for library_span in ("MPI_IO", "ENQUEUE_ALLREDUCE"):      # bftimeline would count them as operations
        with pytest.raises(ValueError, match=f"{library_span}.*library's own spans"):
            _api.timeline_start_activity("t", library_span)
        with pytest.raises(ValueError, match="library's own spans"):
            _api.timeline_context("t", library_span)
    assert _api.timeline_start_activity("t", "MY_MPI_IO") is False     # (only the prefixes)
    for call in (_api.timeline_start_activity, _api.timeline_context):   # (the rows of unnamed calls)
        with pytest.raises(ValueError, match="'allreduce.noname.3' has the form"):
            call("allreduce.noname.3", "A")
    assert _api.timeline_start_activity("my.noname.x", "A") is False


@pytest.mark.parametrize("start,end,message", [("x", "", "BLUEFOG_TIMELINE_START_STEP"),
                                               ("", "-1", "BLUEFOG_TIMELINE_END_STEP"),
                                               ("5", "2", "must be >=")])
def test_step_window_variables_are_validated(monkeypatch, start, end, message):
    monkeypatch.setenv("BLUEFOG_TIMELINE_START_STEP", start)
    monkeypatch.setenv("BLUEFOG_TIMELINE_END_STEP", end)
    with pytest.raises(ValueError, match=message):
        _control._window_from_environment()


def _chrome_repair(text):
    """What a trace viewer does with an unterminated array: drop the newlines at the
    end, then a comma, then close the array."""
    return re.sub(r"\s*,$", "", re.sub(r"[\r\n]*$", "", text)) + "]"


def test_a_write_cut_at_any_page_boundary_leaves_whole_lines(tmp_path):
    """A kill -9 can cut a large write short at a page boundary of the file (the
    kernel copies page by page): every page must end with a line's end, so that the
    file cut there loads; only a line longer than a page may cross one."""
    rec = _recorder.Recorder()
    path = tmp_path / "t0.json"
    w = Writer(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644), str(path), rec, META, {})
    w.start()
    for burst in range(30):      # flushes of every size, at every offset
        for k in range(burst * 37 % 400):
            rec.begin(f"row{k % 7}", "A" * (k % 90 + 1), 1)
            rec.end(f"row{k % 7}", 1)
        if burst == 11:
            rec.instant("long", "L" * (2 * PAGE), 1)
        time.sleep(0.06)
    w.close(time.perf_counter_ns())
    data = path.read_bytes()
    assert len(data) > 20 * PAGE
    crossing = 0
    for b in range(PAGE, len(data), PAGE):
        if data[b - 1] != ord("\n"):
            start, end = data.rfind(b"\n", 0, b), data.find(b"\n", b)
            assert end - start > PAGE, f"a line of {end - start} bytes crosses offset {b}"
            crossing += 1
            continue
        cut = data[:b].decode()
        assert json.loads(_chrome_repair(cut)) == json.loads(cut.rstrip().rstrip(",") + "]")
    assert 1 <= crossing <= 3     # the long line only
    assert len(json.load(open(path))) > 3000


def test_a_failed_write_is_cut_back_to_whole_lines_and_a_first_write_failing_is_refused(tmp_path):
    """A full disk (here a file size limit) in the middle of a write: the file ends
    with its last whole line (it loads), the job goes on; a file that cannot take its
    first lines is refused at timeline_start (it would only have dropped events)."""
    _, out = run_agents(1, "tl_disk_full.py", str(tmp_path / "tl"), timeout=60)
    assert "timeline writing to" in out and "failed" in out, out
    data = (tmp_path / "tl0.json").read_bytes()
    assert 0 < len(data) <= 20000 and data.endswith(b",\n"), data[-200:]
    events = json.loads(_chrome_repair(data.decode()))
    assert events[0]["name"] == "bluefog_metadata" and len(events) > 50


def test_a_timeline_context_entered_again_or_on_two_threads_ends_each_span():
    rec = _recorder.Recorder()
    _recorder.current = rec
    try:
        span = _api.timeline_context("ctx", "BLOCK")
        with span:
            with span:         # the same object inside its own block
                pass
            inner_end = time.perf_counter_ns()
        gate_a, gate_b, a_done = threading.Event(), threading.Event(), threading.Event()

        def a():
            with span:
                gate_b.set()
                gate_a.wait(5)
            a_done.set()

        def b():
            gate_b.wait(5)
            with span:
                gate_a.set()
                a_done.wait(5)      # thread a's span ends first
        threads = [threading.Thread(target=f) for f in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        _recorder.current = None
    events = [e for e in rec.events if e[0] != "T"]      # (the threads' names)
    assert [e[0] for e in events] == ["S", "S", "E", "E", "S", "S", "E", "E"]
    assert events[3][1] >= inner_end
    by_thread = {}
    for ph, t, name, activity, tid in events[4:]:
        by_thread.setdefault(tid, []).append((ph, t))
    assert len(by_thread) == 2 and all([p for p, _ in v] == ["S", "E"] for v in by_thread.values())
    (a_begin, a_end), (b_begin, b_end) = sorted((v[0][1], v[1][1]) for v in by_thread.values())
    assert a_end < b_end, "thread a's end was recorded on thread b's span"


def test_a_thread_ident_reused_by_a_new_thread_gets_a_row_of_its_own(tmp_path):
    """Python reuses the ident of a thread that ended; the recorder's "T" event
    (Recorder.know_thread) makes the writer start new rows named after the new thread,
    and the old thread's span still open is ended at the stop."""
    events, w = write(tmp_path, [("B", 1000, "r", "OLD", 5), ("B", 1100, "q", "DONE", 5), ("E", 1200, "q", "DONE", 5),
                                 ("T", 2000, None, "second", 5),
                                 ("B", 3000, "r", "NEW", 5), ("E", 4000, "r", "NEW", 5)], names={5: "first"})
    assert len(w._retired) == 1     # (only rows with a span to end: a thread per batch must not grow it)
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    got = sorted((rows[(s.pid, s.tid)], s.name, s.begin, s.end) for s in read_spans(events))
    assert got == [("first", "DONE", 1.1, 1.2), ("first", "OLD", 1.0, 10000.0), ("second", "NEW", 3.0, 4.0)]


def test_know_thread_tells_a_reused_ident_apart():
    """Each new thread's first know_thread sends its name ("T"), also when it got
    the ident of a thread that ended (CPython on Linux usually gives it)."""
    rec = _recorder.Recorder()
    idents = []

    def run():
        idents.append(threading.get_ident())
        rec.know_thread(idents[-1])
        rec.know_thread(idents[-1])      # (the same thread again: nothing new)
    for k in range(20):
        t = threading.Thread(target=run, name=f"t{k}")
        t.start()
        t.join()
    assert [(e[0], e[3], e[4]) for e in rec.events] == [("T", f"t{k}", i) for k, i in enumerate(idents)]
    assert rec.thread_names[idents[-1]] == "t19"


def test_back_to_back_complete_spans_are_not_read_as_overlapping():
    """ts + dur in floating point can end a hair after the next span's begin (more
    so the longer the host has been up: timestamps count from boot)."""
    for ts, dur in ((1164481020.834, 131.026), (21600e6 + 0.001, 0.003), (4e11 + 0.007, 123.456)):
        events = [{"ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": 1, "name": "A"},
                  {"ph": "X", "ts": float(f"{ts + dur:.3f}"), "dur": 5.0, "pid": 1, "tid": 1, "name": "B"}]
        assert [(s.name, s.parent) for s in read_spans(events)] == [("A", None), ("B", None)], (ts, dur)


@pytest.mark.parametrize("days", [20, 51, 52, 60, 102, 150, 400])
def test_back_to_back_complete_spans_read_back_on_a_host_up_for_days(days):
    """Times written to the nanosecond, read as floats: past 2**42 us (51 days up) round(ts * 1000)
    is 1 ns off for some times, past 2**43 us floats no longer tell nanoseconds apart. Pieces
    of a span cut by the writer still read as back to back, not as overlapping; a real overlap
    is found while floats resolve a nanosecond."""
    def text(ns):
        return f"{ns // 1000}.{ns % 1000:03d}"

    rng = random.Random(days)
    for _ in range(300):
        a = days * 86_400 * 10**9 + rng.randrange(10**11)
        d = rng.randrange(1, 10**7)
        file = f'[{{"ph":"X","ts":{text(a)},"dur":{text(d)},"pid":1,"tid":1,"name":"A"}},' \
               f'{{"ph":"X","ts":{text(a + d)},"dur":5.000,"pid":1,"tid":1,"name":"A"}}]'
        assert [s.parent for s in read_spans(json.loads(file))] == [None, None], file
        if days < 100:
            overlap = file.replace(f'"ts":{text(a + d)}', f'"ts":{text(a + d - 1)}')
            with pytest.raises(ValueError, match="overlap partially"):
                read_spans(json.loads(overlap))


def test_a_backlog_is_written_in_slices_as_it_is_formatted():
    """The spec's flush at least every 100 ms also holds for a burst of events: the
    writer writes each slice it formats (it formatted a whole backlog, seconds of
    work at 400k events/s, before writing any)."""
    rec = _recorder.Recorder()
    rec.events.extend(("X", (1000 + k, 2000 + k), f"r{k % 5}", "SPAN", 1) for k in range(300_000))
    path = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, name = tempfile.mkstemp(dir=path, suffix=".json")
    w = Writer(fd, name, rec, META, {})
    left = []           # events not formatted yet at each write of the writer's thread
    real_write = w._write

    def write_lines(lines):
        if threading.current_thread() is w._thread:
            left.append(len(rec.events))
        return real_write(lines)
    w._write = write_lines
    w.start()
    deadline = time.monotonic() + 20
    while not left and time.monotonic() < deadline:
        time.sleep(0.001)
    w.close(time.perf_counter_ns())
    events = read_events(name)
    os.unlink(name)
    assert left and left[0] > 100_000, f"only {left[:1]} events were left when the first lines were written"
    assert sum(e.get("ph") == "X" for e in events) == 300_000

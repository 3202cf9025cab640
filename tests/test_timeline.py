"""The per-agent timeline (SPEC section 6): files, format, nesting, metadata, control.

Multi-agent tests run real jobs (workers tests/workers/tl_*.py) and check the
files structurally, the way a trace viewer reads them: per (pid, tid) every
"E" closes the innermost "B" and timestamps never go backwards (Perfetto drops
partially overlapping slices).
"""
import json
import math
import os
import signal
import socket
import subprocess
import sys

import pytest

from bluefog_lite.timeline._reader import metadata, read_events, read_spans
from mpi_helpers import REPO, WORKERS, run_agents

SUB_PHASES = {"ALLOCATE_OUTPUT", "COMMUNICATE", "COMPUTE_AVERAGE", "NEGOTIATION",
              "MEMCPY_IN_FUSION_BUFFER", "WIN_SYNC_COMPUTE_AVERAGE", "ACQUIRE_MUTEX"}


# ---- reading a trace -----------------------------------------------------------

class Trace:
    """One agent's file: names of processes/threads and the spans per (pid, tid),
    checked as a viewer needs them (read_spans raises on partial overlap)."""

    def __init__(self, events, complete=True):
        self.events = events
        self.meta = metadata(events)
        self.process = {}      # pid -> tensor name
        self.thread = {}       # (pid, tid) -> thread name
        for ev in events:
            if ev.get("ph") == "M" and ev["name"] == "process_name":
                self.process[ev["pid"]] = ev["args"]["name"]
            elif ev.get("ph") == "M" and ev["name"] == "thread_name":
                self.thread[(ev["pid"], ev["tid"])] = ev["args"]["name"]
        # spans: (tensor, thread name, activity, begin, end, parent activity), by begin
        self._check_nesting(complete)

    def _check_nesting(self, complete):
        for ev in self.events:
            if ev.get("ph") in ("B", "E", "X", "i"):
                assert (ev["pid"], ev["tid"]) in self.thread and ev["pid"] in self.process, f"unnamed row: {ev}"
        self.spans = [(self.process[s.pid], self.thread[(s.pid, s.tid)], s.name, s.begin, s.end, s.parent)
                      for s in read_spans(self.events, complete)]   # raises on bad nesting
        self.spans.sort(key=lambda s: s[3])
        self.instants = [(self.process[ev["pid"]], self.thread[(ev["pid"], ev["tid"])], ev["name"])
                         for ev in self.events if ev.get("ph") == "i"]

    def activities(self, tensor, thread=None):
        return [s[2] for s in self.spans if s[0] == tensor and (thread is None or s[1] == thread)]

    def count(self, tensor, thread, activity):
        """How many spans of activity the row has, a span cut into adjacent pieces (the
        writer cuts a FORWARD or BACKWARD where another span of its row began or ended
        inside it) counting once."""
        ends, n = [], 0
        for s in self.spans:
            if s[0] == tensor and s[1] == thread and s[2] == activity:
                # equal to the nanosecond, the files' resolution, or to what floats resolve
                # there (an end is ts + dur in floats: off by ~1e-5 us on a host up for a day,
                # by more than a nanosecond after 51 days)
                tol = max(5e-4, 4 * math.ulp(s[3]))
                n += not any(abs(s[3] - e) < tol for e in ends)
                ends.append(s[4])
        return n


def load(prefix, rank, complete=True):
    path = f"{prefix}{rank}.json"
    if complete:
        with open(path) as f:
            events = json.load(f)          # a clean shutdown leaves a complete JSON array
    else:
        events = read_events(path)
    return Trace(events, complete)


# ---- a real run: operations, user activities, hooks --------------------------------

@pytest.fixture(scope="module")
def ops_traces(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("tl") / "timeline")
    run_agents(4, "tl_ops.py", timeout=120,
               env={"BLUEFOG_TIMELINE": prefix, "BLUEFOG_TIMELINE_MARK_CYCLES": "1",
                    "BLUEFOG_RANKS_PER_MACHINE": "2"})
    return prefix, [load(prefix, r) for r in range(4)]


def test_one_file_per_agent_named_prefix_rank(ops_traces):
    prefix, traces = ops_traces
    folder = os.path.dirname(prefix)
    assert sorted(os.listdir(folder)) == [f"timeline{r}.json" for r in range(4)]


def test_metadata_rank_size_host_and_clock_offset(ops_traces):
    _, traces = ops_traces
    for r, t in enumerate(traces):
        m = t.meta
        assert (m["rank"], m["size"], m["hostname"]) == (r, 4, socket.gethostname())
        assert m["ts_unit"] == "us" and m["clock_offset_measured"] is True
        assert isinstance(m["wall_time_of_ts0_us"], float)
        # one host, one monotonic clock: every agent reads rank 0's clock (offset exactly 0)
        assert (m["clock_offset_us"], m["clock_shared_with_rank0"]) == (0.0, True), m


@pytest.mark.parametrize("mode", ["shared", "measured"])
def test_clock_offset_is_exact_on_one_kernel_and_measured_across_them(mode):
    run_agents(4, "tl_clock.py", mode, timeout=60)


def test_every_op_has_enqueue_on_caller_and_mpi_on_communication_thread(ops_traces):
    _, traces = ops_traces
    kinds = {"nar": "NEIGHBOR_ALLREDUCE", "ar": "ALLREDUCE", "bc": "BROADCAST", "ag": "ALLGATHER",
             "nag": "NEIGHBOR_ALLGATHER", "gossip": "PAIR_GOSSIP", "nb.2": "NEIGHBOR_ALLREDUCE",
             "ar.nb": "ALLREDUCE"}
    for t in traces:
        for tensor, kind in kinds.items():
            enq = t.activities(tensor, "main")
            mpi = [a for a in t.activities(tensor, "communication") if a.startswith("MPI_")]
            assert enq and set(enq) == {f"ENQUEUE_{kind}"}, (tensor, enq)
            assert mpi and set(mpi) == {f"MPI_{kind}"}, (tensor, mpi)
            assert len(enq) == len(mpi)
        assert len(t.activities("nar", "main")) == 3


def test_sub_phases_nest_inside_their_mpi_span(ops_traces):
    _, traces = ops_traces
    for t in traces:
        phases = [s for s in t.spans if s[2] in SUB_PHASES]
        assert {"ALLOCATE_OUTPUT", "COMMUNICATE", "COMPUTE_AVERAGE", "NEGOTIATION"} <= {s[2] for s in phases}
        for tensor, thread, activity, _, _, parent in phases:
            assert thread == "communication"
            assert parent is not None and parent.startswith("MPI_"), (tensor, activity, parent)
        nar = t.activities("nar", "communication")
        assert nar[:4] == ["MPI_NEIGHBOR_ALLREDUCE", "ALLOCATE_OUTPUT", "COMMUNICATE", "COMPUTE_AVERAGE"]


def test_a_broadcast_root_marks_its_sends_inside_communicate(ops_traces):
    """(bftimeline draws a killed root's arrows from the mark: it must be where the
    data went out, after the root's MPI call was posted)"""
    _, traces = ops_traces
    root = traces[0]
    pid = next(p for p, name in root.process.items() if name == "bc")
    marks = [ev["ts"] for ev in root.events if ev.get("ph") == "i" and ev["pid"] == pid]
    comm = [(s[3], s[4]) for s in root.spans if s[0] == "bc" and s[2] == "COMMUNICATE"]
    assert len(marks) == 1 and len(comm) == 1 and comm[0][0] <= marks[0] <= comm[0][1], (marks, comm)
    assert not [i for t in traces[1:] for i in t.instants if i[0] == "bc"]      # (only the root sends)


def test_machine_ops_have_the_three_phases_and_name_their_receivers(ops_traces):
    """hierarchical_neighbor_allreduce and the machine-local allreduce (2 machines of 2
    agents) show ALLOCATE_OUTPUT, COMMUNICATE and COMPUTE_AVERAGE; each SEND_TO mark
    names the ranks a call sent to ("SEND_TO " for a call that sent to nobody)."""
    _, traces = ops_traces
    for r, t in enumerate(traces):
        for tensor, kind in (("hier", "HIERARCHICAL_NEIGHBOR_ALLREDUCE"), ("ar.local", "ALLREDUCE"),
                             ("hier.ring", "HIERARCHICAL_NEIGHBOR_ALLREDUCE")):
            acts = t.activities(tensor, "communication")
            assert acts[0] == f"MPI_{kind}", (tensor, acts)
            assert {"ALLOCATE_OUTPUT", "COMMUNICATE", "COMPUTE_AVERAGE"} <= set(acts), (tensor, acts)
        marks = lambda tensor: sorted(i[2] for i in t.instants if i[0] == tensor)  # noqa: E731
        peer, other_machine = r ^ 1, (r + 2) % 4
        assert marks("ar.local") == [f"SEND_TO {peer}"]
        assert marks("hier") == sorted([f"SEND_TO {peer}", f"SEND_TO {other_machine}"])
        # the ring 0 -> 1 of 2 machines: machine 1 sends its machine sum to nobody
        assert marks("hier.ring") == sorted([f"SEND_TO {peer}", f"SEND_TO {other_machine}" if r < 2 else "SEND_TO "])


def test_mpi_span_lies_within_its_enqueue_span(ops_traces):
    _, traces = ops_traces
    for t in traces:
        # one op per name at a time: an ENQUEUE span never opens inside another (but
        # a window's and a neighbor operation's, "both")
        assert not [s for s in t.spans if s[2].startswith("ENQUEUE_") and (s[5] or "").startswith("ENQUEUE_")
                    and s[0] != "both"]
        for tensor in ("nar", "ar", "nb.0", "nb.3"):
            enq = [s for s in t.spans if s[0] == tensor and s[2].startswith("ENQUEUE_")]
            mpi = [s for s in t.spans if s[0] == tensor and s[2].startswith("MPI_")]
            assert enq and len(enq) == len(mpi), (tensor, enq, mpi)
            for e, m in zip(enq, mpi):
                assert e[3] <= m[3] and m[4] <= e[4], (tensor, e, m)


def test_device_tensors_show_their_copies_around_the_operation(ops_traces):
    """On the caller's thread, in the operation's row: COPY_TO_HOST before ENQUEUE_,
    COPY_TO_DEVICE after the result was ready (at synchronize)."""
    _, traces = ops_traces
    for t in traces:
        for tensor, kind in (("dev.nar", "NEIGHBOR_ALLREDUCE"), ("dev.ar", "ALLREDUCE"),
                             ("dev.win#1", "WIN_UPDATE")):
            spans = sorted((s for s in t.spans if s[0] == tensor and s[1] == "main"), key=lambda s: s[3])
            assert [s[2] for s in spans] == ["COPY_TO_HOST", f"ENQUEUE_{kind}", "COPY_TO_DEVICE"], (tensor, spans)
            assert spans[0][4] <= spans[1][3] and spans[1][4] <= spans[2][3], spans
            assert all(s[5] is None for s in spans), spans    # none inside another
        # win_create's copy and the put are in the window's row (win_create's ENQUEUE_ in
        # "win_create"'s); the update's copies above in its own op's row, not inside the put's
        put = [s[2] for s in sorted(t.spans, key=lambda s: s[3]) if s[0] == "dev.win" and s[1] == "main"]
        assert put == ["COPY_TO_HOST", "COPY_TO_HOST", "ENQUEUE_WIN_PUT"], put
        # a nonblocking call whose copy is still running when the thread admits it (the
        # stand-in's copy lands 0.3 s late) waits for it first, inside its MPI_ span
        later = t.activities("dev.later", "communication")
        assert later[:3] == ["MPI_NEIGHBOR_ALLREDUCE", "WAIT_COPY_TO_HOST", "ALLOCATE_OUTPUT"], later
        wait = [s for s in t.spans if s[0] == "dev.later" and s[2] == "WAIT_COPY_TO_HOST"]
        assert len(wait) == 1 and wait[0][4] > wait[0][3] and wait[0][5] == "MPI_NEIGHBOR_ALLREDUCE", wait
        # a blocking call waits for it on the caller's thread, before its ENQUEUE_
        spans = sorted((s for s in t.spans if s[0] == "dev.later.blocking" and s[1] == "main"), key=lambda s: s[3])
        assert [s[2] for s in spans] == ["COPY_TO_HOST", "WAIT_COPY_TO_HOST", "ENQUEUE_NEIGHBOR_ALLREDUCE",
                                         "COPY_TO_DEVICE"], spans
        assert "WAIT_COPY_TO_HOST" not in t.activities("dev.later.blocking", "communication")


def test_user_activities_and_cycle_markers(ops_traces):
    _, traces = ops_traces
    for t in traces:
        assert t.activities("user", "main") == ["LOAD_DATA", "EVALUATE"]
        cycles = [i for i in t.instants if i[2] == "CYCLE_START"]
        assert cycles and all(i[:2] == ("cycle", "communication") for i in cycles)


def test_a_user_activity_ends_itself_not_the_operation_beside_it(ops_traces):
    """Rank 0 opens PREPARE on an operation's row, starts the operation (its neighbors
    call 1 s later) and ends PREPARE: PREPARE ends then, ENQUEUE_ (split around
    PREPARE's end, so that slices nest) ends when the operation does."""
    _, traces = ops_traces
    spans = [s for s in traces[0].spans if s[0] == "shared.row"]
    prepare = [s for s in spans if s[2] == "PREPARE"]
    enqueue = [s for s in spans if s[2] == "ENQUEUE_NEIGHBOR_ALLREDUCE"]
    mpi = [s for s in spans if s[2] == "MPI_NEIGHBOR_ALLREDUCE"]
    assert len(prepare) == 1 and len(mpi) == 1 and enqueue, spans
    assert prepare[0][4] - prepare[0][3] < 300e3, prepare    # us: not until the operation's end
    assert prepare[0][4] < mpi[0][4] - 400e3, (prepare, mpi)
    assert max(s[4] for s in enqueue) >= mpi[0][4], (enqueue, mpi)


def test_a_short_lived_thread_keeps_its_name(ops_traces):
    _, traces = ops_traces
    for t in traces:
        assert t.activities("loader.row", "data-loader") == ["READ"], [s for s in t.spans if s[0] == "loader.row"]


def test_a_thread_with_only_forward_and_backward_keeps_its_name(ops_traces):
    _, traces = ops_traces
    for t in traces:
        assert {"FORWARD", "BACKWARD"} <= set(t.activities("0.weight", "trainer")), \
            sorted({s[1] for s in t.spans if s[0] == "0.weight"})


def test_str_subclass_names_make_one_row_each(ops_traces):
    _, traces = ops_traces
    for t in traces:
        assert "np.name" in t.process.values() and "np.win" in t.process.values()
        assert all(len(name) > 1 for name in t.process.values()), sorted(t.process.values())
        assert set(t.activities("np.name", "communication")) >= {"MPI_NEIGHBOR_ALLREDUCE", "COMMUNICATE"}
        assert "MPI_WIN_PUT" in t.activities("np.win", "communication")


def test_a_window_and_an_operation_sharing_a_name_end_their_own_spans(ops_traces):
    _, traces = ops_traces
    spans = {s[2]: s[4] - s[3] for s in traces[0].spans if s[0] == "both" and s[2].startswith("MPI_")}
    # (the others call the neighbor_allreduce 1 s after rank 0; margins for the agents' skew)
    assert spans["MPI_NEIGHBOR_ALLREDUCE"] > 600e3 and spans["MPI_WIN_PUT"] < 400e3, spans    # us


def test_forward_backward_share_the_row_of_the_parameter(ops_traces):
    _, traces = ops_traces
    params = ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"]
    for t in traces:
        for p in params:
            acts = t.activities(p, "main")
            assert t.count(p, "main", "FORWARD") == 3 and t.count(p, "main", "BACKWARD") == 3, (p, acts)
            assert acts.count("ENQUEUE_NEIGHBOR_ALLREDUCE") == 3, (p, acts)
            assert "MPI_NEIGHBOR_ALLREDUCE" in t.activities(p, "communication")
        # back-propagation runs last layer first: its gradient is ready first
        bwd_end = {p: max(s[4] for s in t.spans if s[0] == p and s[2] == "BACKWARD") for p in params}
        assert bwd_end["5.weight"] < bwd_end["3.weight"] < bwd_end["1.weight"] < bwd_end["0.weight"]
        # processes are numbered in first-seen order: forward order of the layers
        pid = {name: p for p, name in t.process.items()}
        assert pid["0.weight"] < pid["1.weight"] < pid["3.weight"] < pid["5.weight"]


def test_forward_ends_before_the_modules_other_forward_hooks(ops_traces):
    """A communication launched by a forward hook registered before the timeline's
    starts after FORWARD ended: one ENQUEUE slice, not one split around FORWARD's end."""
    _, traces = ops_traces
    for t in traces:
        forward = [s for s in t.spans if s[0] == "late.weight" and s[2] == "FORWARD"]
        enqueue = [s for s in t.spans if s[0] == "late.weight" and s[2].startswith("ENQUEUE_")]
        assert len(forward) == 1 and len(enqueue) == 1, (forward, enqueue)
        assert enqueue[0][3] >= forward[0][4], (forward, enqueue)


def test_optimizer_wrappers_record_compute_and_communication_per_parameter(ops_traces):
    _, traces = ops_traces
    for t in traces:
        for tag in ("awc", "atc"):
            for p in (f"{tag}1.weight", f"{tag}1.bias", f"{tag}2.weight", f"{tag}2.bias"):
                acts = t.activities(p, "main")
                # a span split around an overlapping one shows as two slices: count begins
                assert acts.count("FORWARD") == 3, (p, acts)
                assert acts.count("ENQUEUE_NEIGHBOR_ALLREDUCE") == 3, (p, acts)
                assert 3 <= acts.count("BACKWARD") <= 6, (p, acts)
                assert t.activities(p, "communication").count("MPI_NEIGHBOR_ALLREDUCE") == 3
        for p in ("wp.winput1.weight", "wp.winput1.bias", "wp.winput2.weight", "wp.winput2.bias"):
            acts = t.activities(p, "main")
            assert acts.count("FORWARD") == 3 and acts.count("ENQUEUE_WIN_PUT") == 3, (p, acts)
            assert 3 <= acts.count("BACKWARD") <= 6, (p, acts)
        assert not [s for s in t.spans if s[0].startswith("winput")], "rows without the window prefix"
        for p in ("pair.gen1.weight", "pair.gen2.bias", "pair.disc1.weight", "pair.disc2.bias"):
            acts = t.activities(p, "main")    # a list of models: each model's own names, as in Bluefog
            assert acts.count("FORWARD") == 3 and acts.count("ENQUEUE_NEIGHBOR_ALLREDUCE") == 3, (p, acts)
            assert 3 <= acts.count("BACKWARD") <= 6, (p, acts)


# ---- timeline off, bad prefix ------------------------------------------------------

def test_timeline_off_records_nothing_and_writes_no_file(tmp_path):
    run_agents(2, "tl_off.py", str(tmp_path), timeout=60, env={"BLUEFOG_TIMELINE": ""})
    assert os.listdir(tmp_path) == []


def test_missing_directory_is_a_clear_error_at_init(tmp_path):
    prefix = str(tmp_path / "no" / "such" / "dir" / "tl")
    _, out = run_agents(2, "tl_bad_prefix.py", "0,1", str(tmp_path / "no" / "such" / "dir"),
                        timeout=60, env={"BLUEFOG_TIMELINE": prefix})
    assert "does not exist" in out


def test_unwritable_file_fails_only_on_that_agent(tmp_path):
    prefix = str(tmp_path / "tl")
    os.mkdir(prefix + "1.json")           # rank 1's file cannot be opened for writing
    _, out = run_agents(2, "tl_bad_prefix.py", "1", prefix + "{rank}.json",
                        timeout=60, env={"BLUEFOG_TIMELINE": prefix})
    assert "rank 1 error" in out and "rank 0 error" not in out
    load(prefix, 0)


# ---- crash, runtime control, step window --------------------------------------------

def test_killed_agent_leaves_a_loadable_file(tmp_path):
    prefix = str(tmp_path / "crash")
    code, out = run_agents(2, "tl_crash.py", "1.5", timeout=60, expect_ok=False,
                           env={"BLUEFOG_TIMELINE": prefix})
    assert code != 0 and "killing itself" in out, out[-2000:]
    with open(prefix + "1.json") as f:
        text = f.read()
    assert not text.rstrip().endswith("]"), "a killed agent cannot have terminated its array"
    trace = load(prefix, 1, complete=False)
    loops = trace.activities("loop", "main")
    assert loops.count("ITERATION") > 10 and loops.count("INNER") > 10
    assert trace.activities("x", "communication")


def test_timeline_start_stop_at_run_time(tmp_path):
    prefix = str(tmp_path / "rt")
    run_agents(2, "tl_runtime.py", prefix, timeout=60, env={"BLUEFOG_TIMELINE": ""})
    for r in range(2):
        t = load(prefix, r)
        # known from init, although the timeline started later (one host: rank 0's clock itself)
        assert t.meta["clock_offset_measured"] is True and t.meta["clock_shared_with_rank0"] is True
        assert (t.meta["clock_offset_us"], t.meta["clock_offset_rtt_us"]) == (0.0, 0.0)
        names = set(t.process.values())
        assert {"during", "open_at_stop", "u"} <= names
        assert not names & {"before", "after"}
        assert t.activities("during", "main") == ["ENQUEUE_NEIGHBOR_ALLREDUCE"]
        assert t.activities("u", "main") == ["OPEN_AT_STOP"]      # ended by timeline_stop
        assert "ENQUEUE_NEIGHBOR_ALLREDUCE" in t.activities("open_at_stop", "main")
        assert any(i[2] == "CYCLE_START" for i in t.instants)     # mark_cycles=True
        # optimizer wrappers created before the start: compute spans of the two steps
        # recorded, once each, whether the wrapper or the user installed the hooks
        for p in ("0.weight", "2.bias", "b1.weight", "b2.bias"):
            acts = t.activities(p, "main")
            assert t.count(p, "main", "FORWARD") == 2 and t.count(p, "main", "BACKWARD") == 2, (p, acts)
            assert acts.count("ENQUEUE_NEIGHBOR_ALLREDUCE") == 2, (p, acts)
        same = load(prefix + "same_", r)        # started three times under one prefix: the last
        assert {"third"} <= set(same.process.values()) and not {"first", "second"} & set(same.process.values())
        again = load(prefix + "again_", r)      # a second file, started without mark_cycles
        assert "again" in again.process.values() and "u" not in again.process.values()
        assert not [i for i in again.instants if i[2] == "CYCLE_START"], "mark_cycles outlived its file"


def test_step_window_records_only_its_steps(tmp_path):
    prefix = str(tmp_path / "win")
    run_agents(2, "tl_steps.py", timeout=60, env={
        "BLUEFOG_TIMELINE": prefix, "BLUEFOG_TIMELINE_START_STEP": "2",
        "BLUEFOG_TIMELINE_END_STEP": "3"})
    for r in range(2):
        t = load(prefix, r)
        assert set(t.process.values()) == {"step2", "step3"}
        assert (t.meta["start_step"], t.meta["end_step"]) == (2, 3)


def test_bfrun_timeline_filename_and_mark_cycles(tmp_path):
    """The launcher's flags reach every agent: relative prefix, cycle markers."""
    cmd = [sys.executable, os.path.join(REPO, "bfrun"), "-np", "2", "--timeline-filename", "tl_",
           "--timeline-mark-cycles", sys.executable, os.path.join(WORKERS, "tl_bfrun.py")]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)    # bfrun takes its ranks down
        out, _ = proc.communicate()
        pytest.fail(f"bfrun did not finish in 90 s:\n{out[-3000:]}")
    assert proc.returncode == 0 and out.count("AGENT OK") == 2, out[-3000:]
    for r in range(2):
        t = load(str(tmp_path / "tl_"), r)
        assert t.meta["prefix"] == str(tmp_path / "tl_")
        assert t.activities("x", "communication").count("MPI_NEIGHBOR_ALLREDUCE") == 3
        assert any(i[2] == "CYCLE_START" for i in t.instants)


def test_a_copied_or_saved_model_carries_inert_timeline_hooks(tmp_path):
    """With FORWARD/BACKWARD hooks installed (as while a timeline records), torch.save(model)
    works and copy.deepcopy(model) / torch.load give a model whose passes record nothing;
    the original still records. (The hooks were closures: torch.save failed on them.)"""
    import copy
    import torch
    from bluefog_lite import hooks
    from bluefog_lite.timeline import _recorder
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    installed = hooks.timeline_install_hooks(model)
    torch.save(model, tmp_path / "model.pt")
    copies = [copy.deepcopy(model), torch.load(tmp_path / "model.pt", weights_only=False)]
    rec, saved = _recorder.Recorder(), _recorder.current
    _recorder.current = rec
    try:
        for other in copies:
            other(torch.randn(4, 3)).sum().backward()
        assert not rec.events, list(rec.events)[:4]
        model(torch.randn(4, 3)).sum().backward()
    finally:
        _recorder.current = saved
        installed.remove()
    recorded = {(name, activity) for ph, _, name, activity, _ in rec.events if ph != "T"}   # (T: thread names)
    assert recorded == {(f"{i}.{kind}", act) for i in (0, 1) for kind in ("weight", "bias")
                        for act in ("FORWARD", "BACKWARD")}, recorded


def test_installing_timeline_hooks_again_replaces_the_earlier_ones():
    """A second timeline_install_hooks on a model takes the first call's place (as it takes
    a wrapper's), with its own prefix: every span is recorded once, under the new names; the
    first handle's remove() then removes nothing. (Both sets recorded: every span twice.)"""
    import torch
    from bluefog_lite import hooks
    from bluefog_lite.timeline import _recorder
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    first = hooks.timeline_install_hooks(model)
    second = hooks.timeline_install_hooks(model, prefix="m.")
    expected = sorted((f"m.{i}.{kind}", act) for i in (0, 1) for kind in ("weight", "bias")
                      for act in ("FORWARD", "BACKWARD"))
    saved = _recorder.current
    try:
        for step in ("both installed", "first removed", "second removed"):
            if step == "first removed":
                first.remove()
            elif step == "second removed":
                second.remove()
            rec = _recorder.current = _recorder.Recorder()
            model(torch.randn(4, 3)).sum().backward()
            recorded = sorted((name, activity) for ph, _, name, activity, _ in rec.events if ph != "T")
            assert recorded == ([] if step == "second removed" else expected), (step, recorded)
    finally:
        _recorder.current = saved
        second.remove()


def test_forward_spans_tile_the_models_forward_pass():
    """Work between the modules that own parameters (activations, pooling) is compute too:
    each FORWARD begins where the previous one ended (the first at the model's forward),
    as BACKWARD tiles the backward pass. A module called on its own, and one called after
    a forward pass that raised, get their own forward only. (FORWARD covered only the
    modules with parameters: the time between them showed as idle, and the summary's
    overlap counted communication hidden behind it as exposed.)"""
    import time
    import torch
    from bluefog_lite import hooks
    from bluefog_lite.timeline import _recorder

    class Sleep(torch.nn.Module):
        def __init__(self, seconds, fail=False):
            super().__init__()
            self.seconds, self.fail = seconds, fail

        def forward(self, x):
            time.sleep(self.seconds)
            if self.fail:
                raise RuntimeError("a forward that raises")
            return x

    model = torch.nn.Sequential(Sleep(0.1), torch.nn.Linear(3, 4), Sleep(0.15), torch.nn.Linear(4, 2))
    raising = torch.nn.Sequential(torch.nn.Linear(2, 2), Sleep(0.01, fail=True))
    installed = [hooks.timeline_install_hooks(model), hooks.timeline_install_hooks(raising, prefix="r.")]
    rec, saved = _recorder.Recorder(), _recorder.current
    _recorder.current = rec
    try:
        for _ in range(2):
            model(torch.randn(2, 3))
        model[3](torch.randn(2, 4))       # on its own
        with pytest.raises(RuntimeError, match="a forward that raises"):
            raising(torch.randn(2, 2))
        time.sleep(0.1)
        raising[0](torch.randn(2, 2))     # on its own, after its model's forward raised
    finally:
        _recorder.current = saved
        for h in installed:
            h.remove()
    spans = [(name, span) for _, span, name, activity, _ in rec.events if activity == "FORWARD"]
    first = [span for name, span in spans if name == "1.weight"]
    second = [span for name, span in spans if name == "3.weight"]
    after_raise = [span for name, span in spans if name == "r.0.weight"]
    assert len(first) == 2 and len(second) == 3 and len(after_raise) == 2, spans
    for k in range(2):
        assert first[k][1] - first[k][0] >= 100e6, "the sleep before the first Linear is its FORWARD's"
        assert second[k][0] == first[k][1], "the next FORWARD begins where the previous one ended"
        assert second[k][1] - second[k][0] >= 150e6, "the sleep between the Linears is the second's FORWARD"
    for alone in (second[2], after_raise[1]):       # (not a sleep of 100 ms or more; a loaded host's delays)
        assert alone[1] - alone[0] < 60e6, f"called on its own: its own forward only ({(alone[1] - alone[0]) / 1e6} ms)"


def test_a_wrappers_launch_is_not_in_the_next_forward_span():
    """An optimizer wrapper starts a layer's communication from its forward hook (after
    FORWARD's end): that launch is the operation's ENQUEUE_, so the next layer's FORWARD
    begins after it (it began at the layer's end, swallowing every launch)."""
    import time
    import torch
    from bluefog_lite import hooks
    from bluefog_lite.timeline import _recorder

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))

    def slow_launch(module, args, output):       # as optimizers._AfterForward does
        time.sleep(0.1)
        hooks.launched()
    model[0].register_forward_hook(slow_launch)
    installed = hooks.timeline_install_hooks(model)
    rec, saved = _recorder.Recorder(), _recorder.current
    _recorder.current = rec
    try:
        model(torch.randn(2, 3))
    finally:
        _recorder.current = saved
        installed.remove()
    span = {name: s for _, s, name, activity, _ in rec.events if activity == "FORWARD"}
    assert span["1.weight"][0] - span["0.weight"][1] >= 100e6, span
    assert span["1.weight"][1] - span["1.weight"][0] < 60e6, span       # (without the launch's 100 ms)


@pytest.mark.parametrize("mode", ["plain", "wrapped", "nested", "nested_wrapped", "around_wrapper", "after_raise",
                                  "none"])
def test_step_window_counts_plain_and_wrapped_optimizers(tmp_path, mode):
    """A script with a plain torch.optim optimizer gets its window (it recorded nothing: only
    the wrappers counted steps); a wrapper's step, which steps the optimizer it wraps, counts
    once; with no optimizer step at all the file is empty and shutdown warns."""
    prefix = str(tmp_path / "win")
    _, out = run_agents(2, "tl_steps_optimizers.py", mode, timeout=60, env={
        "BLUEFOG_TIMELINE": prefix, "BLUEFOG_TIMELINE_START_STEP": "2", "BLUEFOG_TIMELINE_END_STEP": "3"})
    for r in range(2):
        names = set(load(prefix, r).process.values())
        if mode == "none":
            assert not {n for n in names if n.startswith("step")}, names
        else:
            assert {n for n in names if n.startswith("step")} == {"step2", "step3"}, names
    never = "the step window (BLUEFOG_TIMELINE_START_STEP=2) never opened: this agent made 0 optimizer steps"
    assert out.count(never) == (2 if mode == "none" else 0), out[-3000:]


def test_timeline_context_decorates_a_function():
    """@bf.timeline_context(name, activity) records each call (Bluefog's contextmanager
    worked as a decorator; here it raised TypeError: not callable). Nested calls nest."""
    import bluefog_lite as bf
    from bluefog_lite.timeline import _recorder

    @bf.timeline_context("loader", "LOAD")
    def load(depth):
        """Loads."""
        return depth if depth == 0 else load(depth - 1) + 1

    rec, saved = _recorder.Recorder(), _recorder.current
    _recorder.current = rec
    try:
        assert load(2) == 2 and load(0) == 0
    finally:
        _recorder.current = saved
    assert load.__doc__ == "Loads." and load(1) == 1      # not recording: just the call
    marks = [(e[0], e[3]) for e in rec.events if e[2] == "loader"]
    assert marks == [("S", "LOAD")] * 3 + [("E", "LOAD")] * 3 + [("S", "LOAD"), ("E", "LOAD")], rec.events
    with pytest.raises(TypeError, match="decorates a function"):
        bf.timeline_context("loader", "LOAD")(42)

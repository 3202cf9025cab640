"""bftimeline (SPEC section 6, beyond): merge, summary and plot of all agents' files.

Synthetic traces, written in the writer's layout with hand-computed answers
(exactly 50 % overlap, a 3 ms clock offset, a known straggler, a crashed
agent), and one real 4-agent run through the command line.
"""
import collections
import configparser
import json
import os
import struct
import subprocess
import sys

import pytest

from bluefog_lite.timeline import _reader
from bluefog_lite.timeline.__main__ import main
from bluefog_lite.timeline._reader import iter_events, metadata, read_events, read_spans
from mpi_helpers import REPO, run_agents

THREAD_TIDS = {"main": 1, "communication": 2}


# ---- writing synthetic agent files -------------------------------------------------

def write_agent(path, rank, size, slices, offset_us=0.0, rtt_us=2.0, instants=(), crashed=False, host="h",
                run=("run-a", 1.8e9), prefix=None):
    """An agent file as the writer lays it out. slices: (tensor, thread, activity,
    begin, end) in µs on the agent's own clock; end None leaves the slice open
    (crashed=True then also leaves the array unterminated with a cut last line)."""
    pids, lines = {}, ["[\n"]
    meta = {"rank": rank, "size": size, "hostname": host, "clock_offset_us": offset_us,
            "clock_offset_rtt_us": rtt_us, "clock_offset_measured": True, "run_id": run[0], "run_started_s": run[1]}
    if prefix is not None:
        meta["prefix"] = prefix
    lines.append(json.dumps({"name": "bluefog_metadata", "ph": "M", "pid": 0, "tid": 0, "args": meta}) + ",\n")
    timed = []
    for tensor, thread, activity, begin, end in slices:
        pid = pids.setdefault(tensor, len(pids) + 1)
        tid = THREAD_TIDS[thread]
        timed.append(((begin, 1, -(end if end is not None else 1e18)), activity, "B", pid, tid))
        if end is not None:
            timed.append(((end, 0, -begin), activity, "E", pid, tid))
    for tensor, thread, activity, ts in instants:
        pid = pids.setdefault(tensor, len(pids) + 1)
        timed.append(((ts, 2, 0), activity, "i", pid, THREAD_TIDS[thread]))
    for tensor, pid in pids.items():
        lines.append(json.dumps({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                                 "args": {"name": tensor}}) + ",\n")
        for thread, tid in THREAD_TIDS.items():
            lines.append(json.dumps({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                                     "args": {"name": thread}}) + ",\n")
    for (ts, _, _), activity, ph, pid, tid in sorted(timed, key=lambda t: t[0]):
        extra = '"s":"t",' if ph == "i" else ""
        lines.append(f'{{"name":"{activity}","ph":"{ph}",{extra}"ts":{ts:.3f},"pid":{pid},"tid":{tid}}},\n')
    if crashed:
        lines.append('{"name":"COMPUTE_AVERAGE","ph":"B","ts":99')        # cut by the kill
    else:
        lines.append('{"name":"bluefog_end","ph":"M","pid":0,"tid":0,"args":{"clean_shutdown":true}}\n]\n')
    with open(path, "w") as f:
        f.writelines(lines)


def op_call(tensor, kind, enqueue, mpi, communicate):
    """The slices of one operation call: ENQUEUE_ on main, MPI_ with one COMMUNICATE on communication."""
    return [(tensor, "main", "ENQUEUE_" + kind, *enqueue), (tensor, "communication", "MPI_" + kind, *mpi),
            (tensor, "communication", "COMMUNICATE", *communicate)]


def cli(args, capsys):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def load_json(path):
    with open(path) as f:
        return json.load(f)


# ---- reading the merged trace back ----------------------------------------------------

def innermost_slice(spans, pid, tid, ts):
    inside = [s for s in spans if s.pid == pid and s.tid == tid and s.begin <= ts <= s.end]
    return max(inside, key=lambda s: s.begin) if inside else None


def check_flows(events, unfinished_sends=()):
    """Every arrow has one start and one finish, each inside a COMMUNICATE slice (a
    start of the occurrences in unfinished_sends, (pid, occurrence) of a killed agent's
    last call, inside its MPI_ slice); returns [(from pid, to pid, s event, f event)]."""
    spans = read_spans(events)          # also checks nesting on every (pid, tid) row
    ends = collections.defaultdict(dict)
    for ev in events:
        if ev.get("ph") in ("s", "f"):
            assert ev["ph"] not in ends[ev["id"]], f"flow id {ev['id']} used twice: {ev}"
            ends[ev["id"]][ev["ph"]] = ev
    arrows = []
    for flow_id, pair in ends.items():
        assert set(pair) == {"s", "f"}, f"flow {flow_id} is not paired: {pair}"
        s, f = pair["s"], pair["f"]
        assert s["cat"] == f["cat"] and s["name"] == f["name"] and f.get("bp") == "e"
        for ev in (s, f):
            where = innermost_slice(spans, ev["pid"], ev["tid"], ev["ts"])
            slice_name = "COMMUNICATE"
            if ev is s and (ev["pid"], s["args"]["occurrence"]) in unfinished_sends:
                slice_name = "MPI_" + s["args"]["op"]
            assert where is not None and where.name == slice_name, f"arrow end not in {slice_name}: {ev}"
        arrows.append((s["pid"], f["pid"], s, f))
    return arrows


def process_names(events):
    return {ev["pid"]: ev["args"]["name"] for ev in events if ev.get("name") == "process_name"}


# ---- summary: overlap, totals, idle -----------------------------------------------------

def overlap_trace(folder):
    """One agent. Communication (MPI_) [1000,1400] and [2200,2600]; compute FORWARD
    [1200,1600], BACKWARD on two rows [2000,2300] and [2100,2400] (one union
    [2000,2400]); overlap [1200,1400] + [2200,2400] = 400 of 800 µs: exactly 50 %.
    A user span COMPUTE_GRADIENT [2500,2700] overlaps communication by 100 µs.
    Window [1000,3000] (an instant at 3000); busy [1000,1600] + [2000,2700]."""
    prefix = str(folder / "tl_")
    slices = [("w", "main", "ENQUEUE_NEIGHBOR_ALLREDUCE", 1000, 1420),
              ("w", "communication", "MPI_NEIGHBOR_ALLREDUCE", 1000, 1400),
              ("w", "communication", "ALLOCATE_OUTPUT", 1000, 1100),
              ("w", "communication", "COMMUNICATE", 1100, 1300),
              ("w", "communication", "COMPUTE_AVERAGE", 1300, 1400),
              ("v", "main", "FORWARD", 1200, 1600),
              ("a", "main", "BACKWARD", 2000, 2300),
              ("b", "main", "BACKWARD", 2100, 2400),
              ("a", "communication", "MPI_ALLREDUCE", 2200, 2600),
              ("a", "communication", "COMMUNICATE", 2250, 2550),
              ("g", "main", "COMPUTE_GRADIENT", 2500, 2700)]
    write_agent(prefix + "0.json", 0, 1, slices, instants=[("cycle", "communication", "CYCLE_START", 3000)])
    return prefix


def test_summary_totals_idle_and_exactly_half_overlap(tmp_path, capsys):
    prefix = overlap_trace(tmp_path)
    code, out, _ = cli(["summary", prefix, "--json", tmp_path / "s.json"], capsys)
    assert code == 0
    agent, = load_json(tmp_path / "s.json")["agents"]
    expected_ms = {"FORWARD": 0.4, "BACKWARD": 0.4, "communication": 0.8, "COMMUNICATE": 0.5,
                   "ALLOCATE_OUTPUT": 0.1, "COMPUTE_AVERAGE": 0.1}
    assert agent["time_ms"] == pytest.approx(expected_ms)
    assert agent["window_ms"] == pytest.approx(2.0)
    assert agent["idle_ms"] == pytest.approx(2.0 - 0.6 - 0.7)
    assert agent["overlap_percent"] == pytest.approx(50.0)
    row = next(line for line in out.splitlines() if line.startswith("0 "))
    assert row.split()[-1] == "50.0" and "0.400" in row


def test_summary_counts_extra_compute_activities(tmp_path, capsys):
    prefix = overlap_trace(tmp_path)
    code, _, _ = cli(["summary", prefix, "--compute", "COMPUTE_GRADIENT", "--json", tmp_path / "s.json"], capsys)
    assert code == 0
    agent, = load_json(tmp_path / "s.json")["agents"]
    assert agent["overlap_percent"] == pytest.approx(100.0 * 500 / 800)
    assert agent["time_ms"]["COMPUTE_GRADIENT"] == pytest.approx(0.2)
    code, _, err = cli(["summary", prefix, "--compute", "COMPUTE_GRADIANT"], capsys)     # a typo: said
    assert code == 0 and "--compute 'COMPUTE_GRADIANT': no agent recorded an activity of that name" in err, err


def test_summary_shows_odd_names_escaped_and_cut_and_keeps_them_whole_in_json(tmp_path, capsys):
    """Names the library accepts (newlines, tabs, a lone surrogate, 200 characters)
    must not break the tables or the command: escaped and cut in the text, whole
    in --json."""
    odd = ["a\nb\tc", "s\ud800t", "L" * 200]
    for rank in range(2):
        slices = []
        for i, name in enumerate(odd):
            t = 100.0 * i + 10 * rank
            slices += op_call(name, "ALLREDUCE", (t, t + 50), (t + 1, t + 49), (t + 2, t + 40))
        write_agent(tmp_path / f"o{rank}.json", rank, 2, slices)
    code, out, _ = cli(["summary", tmp_path / "o", "--json", tmp_path / "s.json"], capsys)
    assert code == 0
    assert {op["name"] for op in load_json(tmp_path / "s.json")["operations"]} == set(odd)
    assert "a\\nb\\tc" in out and "s\\ud800t" in out and "L" * 57 + "..." in out and "L" * 58 not in out
    assert max(len(line) for line in out.splitlines()) < 160


def test_output_that_the_terminal_cannot_encode_is_escaped():
    import io
    from bluefog_lite.timeline.__main__ import _write
    stream = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    _write(stream, "caf\u00e9 s\ud800t\n")
    stream.flush()
    assert stream.buffer.getvalue() == b"caf\\xe9 s\\ud800t\n"


# ---- clocks: a known 3 ms offset ----------------------------------------------------------

def offset_run(folder):
    """Two agents, one neighbor_allreduce "x". Agent 1's clock reads 3 ms less than
    rank 0's (clock_offset_us = +3000: add it to get rank 0's time). On rank 0's
    clock agent 0 calls at 10000, agent 1 at 10500: agent 1 is the straggler,
    although its own timestamps (7500) are earlier."""
    prefix = str(folder / "tl_")
    write_agent(prefix + "0.json", 0, 2, op_call("x", "NEIGHBOR_ALLREDUCE", (10000, 10900), (10050, 10850),
                                                 (10100, 10800)))
    shift = -3000.0
    write_agent(prefix + "1.json", 1, 2, op_call("x", "NEIGHBOR_ALLREDUCE", (10500 + shift, 11000 + shift),
                                                 (10550 + shift, 10950 + shift), (10600 + shift, 10700 + shift)),
                offset_us=3000.0)
    return prefix


def test_merge_aligns_clocks_with_the_recorded_offset(tmp_path, capsys):
    prefix = offset_run(tmp_path)
    out = tmp_path / "merged.json"
    code, _, _ = cli(["merge", prefix, "-o", out], capsys)
    assert code == 0
    events = load_json(out)
    names = process_names(events)
    assert names == {1: "rank 0 (h)", 2: "rank 1 (h)"}
    spans = read_spans(events)
    comm = {(s.pid, s.name): (s.begin, s.end) for s in spans}
    assert comm[(2, "COMMUNICATE")] == (10600.0, 10700.0)
    assert comm[(2, "ENQUEUE_NEIGHBOR_ALLREDUCE")] == (10500.0, 11000.0)
    assert comm[(1, "COMMUNICATE")] == (10100.0, 10800.0)
    arrows = {(a, b): (s["ts"], f["ts"]) for a, b, s, f in check_flows(events)}
    # from the begin of the sender's COMMUNICATE to the end of the receiver's (0.5 µs inside)
    assert arrows == {(1, 2): (10100.5, 10699.5), (2, 1): (10600.5, 10799.5)}


def test_straggler_uses_the_corrected_clock(tmp_path, capsys):
    prefix = offset_run(tmp_path)
    code, _, _ = cli(["summary", prefix, "--json", tmp_path / "s.json"], capsys)
    assert code == 0
    st = load_json(tmp_path / "s.json")["stragglers"]
    assert st["operations"] == [{"name": "x", "kind": "NEIGHBOR_ALLREDUCE", "calls": 1,
                                 "last": [{"rank": 1, "times": 1, "held_up_ms": pytest.approx(0.5)}]}]
    assert [(x["rank"], x["times_last"]) for x in st["ranking"]] == [(1, 1), (0, 0)]


# ---- a known straggler ---------------------------------------------------------------------

def straggler_run(folder):
    """Four agents, clocks offset by -700*r µs. "x" (neighbor_allreduce) is called
    6 times: in calls 0-4 agent 2 comes 2000 µs after the first agent and 1700 µs
    after the next-to-last (agent 3, +300); in call 5 agent 3 comes last (+1300,
    1100 after agent 2). "g" (allreduce) twice, agent 0 last by 300 µs."""
    prefix = str(folder / "tl_")
    late = {k: {0: 0, 1: 100, 2: 2000, 3: 300} for k in range(5)}
    late[5] = {0: 0, 1: 100, 2: 200, 3: 1300}
    for r in range(4):
        slices = []
        for k in range(6):
            t = 10000.0 * (k + 1)
            a = t + late[k][r]
            slices += op_call("x", "NEIGHBOR_ALLREDUCE", (a, t + 5000), (a + 10, t + 4900), (a + 20, t + 4800))
        for k in range(2):
            t = 100000.0 + 10000.0 * k
            a = t + {0: 500, 1: 0, 2: 100, 3: 200}[r]
            slices += op_call("g", "ALLREDUCE", (a, t + 5000), (a + 10, t + 4900), (a + 20, t + 4800))
        write_agent(f"{prefix}{r}.json", r, 4, [(n, th, act, b + 700.0 * r, e + 700.0 * r)
                                                for n, th, act, b, e in slices], offset_us=-700.0 * r)
    return prefix


def test_known_straggler_is_ranked_first(tmp_path, capsys):
    prefix = straggler_run(tmp_path)
    code, out, _ = cli(["summary", prefix, "--json", tmp_path / "s.json"], capsys)
    assert code == 0
    st = load_json(tmp_path / "s.json")["stragglers"]
    ops = {op["name"]: op for op in st["operations"]}
    assert ops["x"]["calls"] == 6 and ops["g"]["calls"] == 2
    assert ops["x"]["last"] == [{"rank": 2, "times": 5, "held_up_ms": pytest.approx(5 * 1.7)},
                                {"rank": 3, "times": 1, "held_up_ms": pytest.approx(1.1)}]
    assert ops["g"]["last"] == [{"rank": 0, "times": 2, "held_up_ms": pytest.approx(0.6)}]
    # ranked by the time held up: rank 2 8.5 ms, rank 3 1.1 ms, rank 0 0.6 ms, rank 1 never last
    assert [(x["rank"], x["times_last"], x["calls"]) for x in st["ranking"]] == \
        [(2, 5, 8), (3, 1, 8), (0, 2, 8), (1, 0, 8)]
    assert [x["held_up_ms"] for x in st["ranking"]] == pytest.approx([8.5, 1.1, 0.6, 0.0])
    assert [x["held_up_summed_ms"] for x in st["ranking"]] == pytest.approx([8.5, 1.1, 0.6, 0.0])
    ranking = out[out.index("straggler ranking"):].splitlines()
    assert ranking[2].split()[:4] == ["rank", "2", "5", "of"]


def test_calls_held_up_at_once_count_once_in_the_ranking(tmp_path, capsys):
    """Six layers' operations called together each step, three steps: rank 1 is 50 ms late
    in steps 0 and 1 (2.6 ms late for one layer only in step 2), rank 3 20 ms late for
    one layer in step 2. Rank 1 held the job up 100 ms (+2.6), not 600: it ranks first by
    the time it held calls up, and rank 3 (20 ms) second; the sum over calls is kept apart."""
    prefix = str(tmp_path / "tl_")
    for r in range(4):
        slices = []
        for step in range(3):
            t = 200000.0 * (step + 1)
            for layer in range(6):
                late = {0: 0.0, 1: 50000.0 if step < 2 else 0.0, 2: 100.0, 3: 0.0}[r]
                if step == 2 and layer == 0:
                    late = {0: 0.0, 1: 2700.0, 2: 100.0, 3: 0.0}[r]
                if step == 2 and layer == 5:
                    late = {0: 0.0, 1: 0.0, 2: 100.0, 3: 20100.0}[r]
                a = t + late + 10.0 * layer
                slices += op_call(f"l{layer}", "NEIGHBOR_ALLREDUCE", (a, t + 90000), (a + 5, t + 89000),
                                  (a + 6, t + 88000))
        write_agent(f"{prefix}{r}.json", r, 4, slices)
    code, out, _ = cli(["summary", prefix, "--json", tmp_path / "s.json"], capsys)
    assert code == 0
    ranking = load_json(tmp_path / "s.json")["stragglers"]["ranking"]
    assert [x["rank"] for x in ranking[:2]] == [1, 3]
    assert ranking[0]["held_up_ms"] == pytest.approx(2 * 49.95 + 2.6)    # (the layers 10 µs apart)
    assert ranking[0]["held_up_summed_ms"] == pytest.approx(12 * 49.9 + 2.6)
    assert ranking[1]["held_up_ms"] == ranking[1]["held_up_summed_ms"] == pytest.approx(20.0)


def test_merge_flows_follow_a_given_topology(tmp_path, capsys):
    prefix = straggler_run(tmp_path)
    code, _, _ = cli(["merge", prefix, "-o", tmp_path / "all.json"], capsys)
    assert code == 0
    code, _, _ = cli(["merge", prefix, "-o", tmp_path / "ring.json", "--topology", "RingGraph"], capsys)
    assert code == 0
    every_pair = {(u, v) for u in range(4) for v in range(4) if u != v}
    ring = {(r, (r + 1) % 4) for r in range(4)} | {(r, (r - 1) % 4) for r in range(4)}
    for name, x_pairs in (("all.json", every_pair), ("ring.json", ring)):
        arrows = check_flows(load_json(tmp_path / name))
        by_op = collections.defaultdict(collections.Counter)
        for u, v, s, _ in arrows:
            by_op[s["name"]][(u - 1, v - 1)] += 1
        assert by_op["x"] == {pair: 6 for pair in x_pairs}, name
        assert by_op["g"] == {pair: 2 for pair in every_pair}, name     # a collective reaches everyone


def test_broadcast_arrows_go_from_the_root_only(tmp_path, capsys):
    """A broadcast's root marks the ranks it sends to: arrows root -> each other agent,
    not between every pair (files without the mark keep every pair)."""
    prefix = str(tmp_path / "tl_")
    for r in range(3):
        call = op_call("b", "BROADCAST", (1000, 2000), (1010, 1990), (1020, 1980))
        marks = [("b", "communication", "SEND_TO 0,2", 1030)] if r == 1 else []
        write_agent(f"{prefix}{r}.json", r, 3, call, instants=marks)
    code, _, _ = cli(["merge", prefix, "-o", tmp_path / "m.json"], capsys)
    assert code == 0
    arrows = {(u - 1, v - 1) for u, v, _, _ in check_flows(load_json(tmp_path / "m.json"))}
    assert arrows == {(1, 0), (1, 2)}, arrows
    # the root's file missing (--allow-missing): no arrows for the broadcast, not every pair of
    # the others (the files carry send marks: not an older version's); a neighbor call keeps its
    os.remove(f"{prefix}1.json")
    for r in (0, 2):
        calls = (op_call("b", "BROADCAST", (1000, 2000), (1010, 1990), (1020, 1980))
                 + op_call("n", "NEIGHBOR_ALLREDUCE", (3000, 4000), (3010, 3990), (3020, 3980)))
        write_agent(f"{prefix}{r}.json", r, 3, calls, instants=[("n", "communication", f"SEND_TO {2 - r}", 3030)])
    code, _, _ = cli(["merge", prefix, "--allow-missing", "-o", tmp_path / "m2.json"], capsys)
    assert code == 0
    events = load_json(tmp_path / "m2.json")
    names = {e["id"]: e["name"] for e in events if e.get("ph") == "s"}
    arrows = {(names[s["id"]], u - 1, v - 1) for u, v, s, _ in check_flows(events)}
    assert arrows == {("n", 0, 2), ("n", 2, 0)}, arrows


def test_an_agent_that_sent_to_nobody_has_no_arrows_and_a_local_allreduce_stays_in_its_machine(tmp_path, capsys):
    """Neighbor calls: agent 0 marks "SEND_TO " (nobody), the others mark their one
    receiver; a machine-local allreduce (machines {0, 1} and {2, 3}) marks each agent's
    machine peer: arrows only where the marks say (they went from agent 0 to every
    agent, and the local allreduce linked every pair across machines)."""
    prefix = str(tmp_path / "tl_")
    for r in range(4):
        calls = (op_call("n", "NEIGHBOR_ALLREDUCE", (1000, 2000), (1010, 1990), (1020, 1980))
                 + op_call("l", "ALLREDUCE", (3000, 4000), (3010, 3990), (3020, 3980)))
        marks = [("n", "communication", "SEND_TO " + ("" if r == 0 else str((r + 1) % 4)), 1030),
                 ("l", "communication", f"SEND_TO {r ^ 1}", 3030)]
        write_agent(f"{prefix}{r}.json", r, 4, calls, instants=marks)
    code, _, _ = cli(["merge", prefix, "-o", tmp_path / "m.json"], capsys)
    assert code == 0
    events = load_json(tmp_path / "m.json")
    names = {e["id"]: e["name"] for e in events if e.get("ph") == "s"}
    arrows = {(u - 1, v - 1) for u, v, _, _ in check_flows(events)}
    assert arrows == {(1, 2), (2, 3), (3, 0)} | {(0, 1), (1, 0), (2, 3), (3, 2)}, arrows
    assert len(names) == 3 + 4, names


def test_a_call_in_flight_when_recording_began_is_not_paired(tmp_path, capsys):
    """Agent 0's file began (timeline_start) while its first call of "x" was in flight:
    it has that call's MPI_ slice without its ENQUEUE_; agent 1's file does not have
    it at all. Call k of one agent is call k of the other (they were paired off by one)."""
    prefix = str(tmp_path / "tl_")
    calls = [(1000, 2000), (3000, 4000)]
    for r in range(2):
        slices = [("x", "communication", "MPI_NEIGHBOR_ALLREDUCE", 100, 500),
                  ("x", "communication", "COMMUNICATE", 150, 450)] if r == 0 else []
        for b, e in calls:
            slices += op_call("x", "NEIGHBOR_ALLREDUCE", (b, e), (b + 10, e - 10), (b + 20, e - 20))
        marks = [("x", "communication", f"SEND_TO {1 - r}", b + 30) for b, _ in calls]
        write_agent(f"{prefix}{r}.json", r, 2, slices, instants=marks)
    code, _, _ = cli(["merge", prefix, "-o", tmp_path / "m.json"], capsys)
    assert code == 0
    arrows = check_flows(load_json(tmp_path / "m.json"))
    assert len(arrows) == 4, arrows
    for _, _, s, f in arrows:      # sent and received within the same call's window
        assert any(b <= s["ts"] <= e and b <= f["ts"] <= e for b, e in calls), (s, f)


# ---- crashed agents ---------------------------------------------------------------------------

def crashed_run(folder):
    """Agent 1 was killed during its second call of "x": ENQUEUE_, MPI_ and
    COMMUNICATE never ended, the array is unterminated and its last line cut. Its
    last complete event is the end of a FORWARD at 20500."""
    prefix = str(folder / "tl_")
    first = op_call("x", "NEIGHBOR_ALLREDUCE", (10000, 10900), (10050, 10850), (10100, 10800))
    write_agent(prefix + "0.json", 0, 2, first + op_call("x", "NEIGHBOR_ALLREDUCE", (20000, 20900),
                                                         (20050, 20850), (20100, 20800)))
    write_agent(prefix + "1.json", 1, 2, first + op_call("x", "NEIGHBOR_ALLREDUCE", (20000, None), (20050, None),
                                                         (20100, None)) + [("v", "main", "FORWARD", 20200, 20500)],
                crashed=True)
    return prefix


def test_a_killed_agents_marked_sends_of_its_last_call_still_get_arrows(tmp_path, capsys):
    """As the writer records it now: a sub-phase is one "X" event written when it ends,
    so agent 1, killed inside the COMMUNICATE of its second call, left no COMMUNICATE
    for it, only the open MPI_ slice and the "SEND_TO 0" mark made when it sent."""
    prefix = str(tmp_path / "tl_")
    first = op_call("x", "NEIGHBOR_ALLREDUCE", (10000, 10900), (10050, 10850), (10100, 10800))
    write_agent(prefix + "0.json", 0, 2, first + op_call("x", "NEIGHBOR_ALLREDUCE", (20000, 20900),
                                                         (20050, 20850), (20100, 20800)))
    write_agent(prefix + "1.json", 1, 2, first + [("x", "main", "ENQUEUE_NEIGHBOR_ALLREDUCE", 20000, None),
                                                  ("x", "communication", "MPI_NEIGHBOR_ALLREDUCE", 20050, None),
                                                  ("v", "main", "FORWARD", 20200, 20500)],
                instants=[("x", "communication", "SEND_TO 0", 20120)], crashed=True)
    code, _, _ = cli(["merge", prefix, "-o", tmp_path / "m.json"], capsys)
    assert code == 0
    flows = check_flows(load_json(tmp_path / "m.json"), unfinished_sends={(2, 1)})
    arrows = sorted((u, v, s["args"]["occurrence"]) for u, v, s, _ in flows)
    assert arrows == [(1, 2, 0), (2, 1, 0), (2, 1, 1)]      # (pids: agent r is r + 1)
    last = [s for u, v, s, _ in flows if s["args"]["occurrence"] == 1]
    assert 20120 <= last[0]["ts"] <= 20500, last       # from the mark


def test_no_arrow_ends_in_a_killed_agents_call_whose_first_phase_ended(tmp_path, capsys):
    """Agent 1 was killed in the second COMMUNICATE of its last call (a hierarchical
    exchange: the machine's, then the machines'): the first ended, so it is in the
    file, but it is not where the call received what agent 0 sent it."""
    prefix = str(tmp_path / "tl_")
    kind = "HIERARCHICAL_NEIGHBOR_ALLREDUCE"
    first = op_call("h", kind, (10000, 10900), (10050, 10850), (10100, 10800))
    write_agent(prefix + "0.json", 0, 2, first + op_call("h", kind, (20000, 20900), (20050, 20850), (20100, 20800)))
    write_agent(prefix + "1.json", 1, 2, first + [("h", "main", "ENQUEUE_" + kind, 20000, None),
                                                  ("h", "communication", "MPI_" + kind, 20050, None),
                                                  ("h", "communication", "COMMUNICATE", 20100, 20200),
                                                  ("v", "main", "FORWARD", 20300, 20500)], crashed=True)
    code, _, _ = cli(["merge", prefix, "-o", tmp_path / "m.json"], capsys)
    assert code == 0
    arrows = sorted((u, v, s["args"]["occurrence"]) for u, v, s, _ in check_flows(load_json(tmp_path / "m.json")))
    assert arrows == [(1, 2, 0), (2, 1, 0), (2, 1, 1)]      # none into agent 1's last call


def test_hierarchical_arrows_start_and_end_in_the_phase_of_their_exchange(tmp_path, capsys):
    """Two machines of two agents (0, 1 | 2, 3): each call exchanges within the machine
    in its first COMMUNICATE (1100-1500), then between machines in its second
    (2000-2800, agent r sends to r +- 2). An arrow between agents of one machine lies in
    the first on both sides, one between machines in the second. Before, every arrow
    left at the first's begin and arrived at the second's end (a machine arrow left
    before the sender had the machine sum it sends)."""
    prefix = str(tmp_path / "tl_")
    kind = "HIERARCHICAL_NEIGHBOR_ALLREDUCE"
    for r in range(4):
        local, remote = r ^ 1, (r + 2) % 4
        write_agent(prefix + f"{r}.json", r, 4,
                    [("h", "main", "ENQUEUE_" + kind, 1000, 3000), ("h", "communication", "MPI_" + kind, 1050, 2900),
                     ("h", "communication", "COMMUNICATE", 1100, 1500),
                     ("h", "communication", "COMMUNICATE", 2000, 2800)],
                    instants=[("h", "communication", f"SEND_TO {local}", 1150),
                              ("h", "communication", f"SEND_TO {remote}", 2050)])
    code, _, _ = cli(["merge", prefix, "-o", tmp_path / "m.json"], capsys)
    assert code == 0
    arrows = check_flows(load_json(tmp_path / "m.json"))
    assert sorted((u - 1, v - 1) for u, v, _, _ in arrows) == sorted(
        [(r, r ^ 1) for r in range(4)] + [(r, (r + 2) % 4) for r in range(4)])
    for u, v, start, finish in arrows:
        phase = (1100, 1500) if (u - 1) ^ 1 == v - 1 else (2000, 2800)
        assert phase[0] <= start["ts"] <= phase[1] and phase[0] <= finish["ts"] <= phase[1], (u, v, start, finish)


def test_a_split_fused_members_arrows_end_where_its_last_wait_ended(tmp_path, capsys):
    """Agent 0 fused a and b; agent 1 called b late, so the stall inspector split agent
    0's group: b's MPI_ slice holds the group's COMMUNICATE (1100-1500, with the
    SEND_TO mark), then b's own wait for agent 1 (1600-3000, no mark), while agent 1
    sent b in 2000-2800. The arrow 1 -> 0 ends in the second: before, it ended at the
    split (1500), before agent 1 had sent."""
    prefix = str(tmp_path / "tl_")
    kind = "NEIGHBOR_ALLREDUCE"
    write_agent(prefix + "0.json", 0, 2,
                [("b", "main", "ENQUEUE_" + kind, 1000, 3100), ("b", "communication", "MPI_" + kind, 1050, 3050),
                 ("b", "communication", "COMMUNICATE", 1100, 1500),
                 ("b", "communication", "COMMUNICATE", 1600, 3000)],
                instants=[("b", "communication", "SEND_TO 1", 1150)])
    write_agent(prefix + "1.json", 1, 2, op_call("b", kind, (1900, 2900), (1950, 2850), (2000, 2800)),
                instants=[("b", "communication", "SEND_TO 0", 2050)])
    code, _, _ = cli(["merge", prefix, "-o", tmp_path / "m.json"], capsys)
    assert code == 0
    arrows = {(u - 1, v - 1): (s["ts"], f["ts"]) for u, v, s, f in check_flows(load_json(tmp_path / "m.json"))}
    assert set(arrows) == {(0, 1), (1, 0)}
    assert 1100 <= arrows[(0, 1)][0] <= 1500                       # agent 0 sent in the group's slice
    assert 2000 <= arrows[(1, 0)][0] <= 2800 and 1600 <= arrows[(1, 0)][1] <= 3000
    assert arrows[(1, 0)][0] <= arrows[(1, 0)][1]


def test_streaming_reader_accepts_a_crashed_file(tmp_path):
    prefix = crashed_run(tmp_path)
    path = prefix + "1.json"
    events = list(iter_events(path))
    assert events == read_events(path)
    assert events[-1] == {"name": "FORWARD", "ph": "E", "ts": 20500.0, "pid": 2, "tid": 1}


def test_merge_and_summary_of_a_crashed_run(tmp_path, capsys):
    prefix = crashed_run(tmp_path)
    code, _, _ = cli(["merge", prefix, "-o", tmp_path / "m.json"], capsys)
    assert code == 0
    events = load_json(tmp_path / "m.json")
    spans = read_spans(events)               # complete: the open slices were ended
    unfinished = sorted((s.name, s.begin, s.end) for s in spans if s.pid == 2 and s.begin >= 20000 and
                        s.name != "FORWARD")
    assert unfinished == [("COMMUNICATE", 20100, 20500), ("ENQUEUE_NEIGHBOR_ALLREDUCE", 20000, 20500),
                          ("MPI_NEIGHBOR_ALLREDUCE", 20050, 20500)]
    arrows = sorted((u, v, s["args"]["occurrence"]) for u, v, s, _ in check_flows(events))
    # agent 1 never received in call 1: no arrow ends there; its send still starts one
    assert arrows == [(1, 2, 0), (2, 1, 0), (2, 1, 1)]
    code, out, _ = cli(["summary", prefix, "--json", tmp_path / "s.json"], capsys)
    assert code == 0
    agents = load_json(tmp_path / "s.json")["agents"]
    assert agents[1]["unfinished_slices"] == 3
    assert agents[1]["time_ms"]["COMMUNICATE"] == pytest.approx((700 + 400) / 1000.0)
    assert "never ended" in out
    # the straggler table says that a cut file's agent is missing from the later calls
    assert "(ranked among the agents whose file records each call: rank 1 only up to where its file was cut)" \
        in out, out


def test_summary_names_an_agent_killed_between_calls(tmp_path, capsys):
    """Agent 1 was killed between its first and second call of "x": no slice is left
    open, but its file has no end mark, and the second call is ranked without it."""
    prefix = str(tmp_path / "tl_")
    first = op_call("x", "NEIGHBOR_ALLREDUCE", (10000, 10900), (10050, 10850), (10100, 10800))
    second = op_call("x", "NEIGHBOR_ALLREDUCE", (20000, 20900), (20050, 20850), (20100, 20800))
    write_agent(prefix + "0.json", 0, 3, first + second)
    write_agent(prefix + "1.json", 1, 3, first, crashed=True)
    write_agent(prefix + "2.json", 2, 3, first + second)
    code, out, _ = cli(["summary", prefix], capsys)
    assert code == 0, out
    assert "files without the writer's end mark (the agent was killed, or is still writing): rank 1" in out, out
    assert "(ranked among the agents whose file records each call: rank 1 only up to where its file was cut)" \
        in out, out


def test_summary_names_an_agent_whose_file_records_fewer_calls(tmp_path, capsys):
    """A file closed cleanly but earlier than the others' (timeline_stop on one agent):
    the calls after its end are ranked without it, and the note says so."""
    prefix = str(tmp_path / "tl_")
    calls = [op_call("x", "NEIGHBOR_ALLREDUCE", (t, t + 900), (t + 50, t + 850), (t + 100, t + 800))
             for t in (10000, 20000, 30000)]
    write_agent(prefix + "0.json", 0, 3, sum(calls, []))
    write_agent(prefix + "1.json", 1, 3, calls[0])
    write_agent(prefix + "2.json", 2, 3, sum(calls, []))
    code, out, _ = cli(["summary", prefix], capsys)
    assert code == 0, out
    assert "end mark" not in out, out
    assert ("(ranked among the agents whose file records each call: rank 1 not in 2 calls that other agents' "
            "files record (its file ended earlier") in out, out


def test_summary_names_an_agent_whose_file_records_no_call(tmp_path, capsys):
    """A file with metadata only, ended cleanly (its step window never opened): its agent is
    in no ranking, and the note says so (it was left out without a word)."""
    prefix = str(tmp_path / "tl_")
    call = op_call("x", "NEIGHBOR_ALLREDUCE", (10000, 10900), (10050, 10850), (10100, 10800))
    write_agent(prefix + "0.json", 0, 3, call)
    write_agent(prefix + "1.json", 1, 3, [])
    write_agent(prefix + "2.json", 2, 3, call)
    code, out, _ = cli(["summary", prefix], capsys)
    assert code == 0, out
    assert "(ranked among the agents whose file records each call: not rank 1, whose file records none of them)" \
        in out, out


# ---- bad input -----------------------------------------------------------------------------

def test_missing_files_are_a_clear_error(tmp_path, capsys):
    code, _, err = cli(["summary", tmp_path / "nothing_"], capsys)
    assert code == 1 and "no timeline files" in err and "nothing_0.json" in err
    write_agent(tmp_path / "tl_0.json", 0, 3, [])
    write_agent(tmp_path / "tl_2.json", 2, 3, [])
    code, _, err = cli(["merge", tmp_path / "tl_", "-o", tmp_path / "m.json"], capsys)
    assert code == 1 and "missing" in err and "tl_1.json" in err
    write_agent(tmp_path / "tl_1.json", 1, 3, [])
    code, _, err = cli(["merge", tmp_path / "tl_", "-o", tmp_path / "no" / "m.json"], capsys)
    assert code == 1 and f"cannot write {tmp_path / 'no' / 'm.json'}: its folder" in err and "partial" not in err, err
    code, _, err = cli(["merge", tmp_path / "tl_", "-o", tmp_path], capsys)
    assert code == 1 and "it is a folder" in err and not list(tmp_path.parent.glob("*.partial")), err


@pytest.mark.parametrize("content", ['{"a": 1}', "hello, world\n",
                                     '[\n{"name":"x","ph":"B","ts":1,"pid":1,"tid":1},\n'])
def test_a_file_that_is_not_a_timeline_is_a_clear_error(tmp_path, capsys, content):
    (tmp_path / "tl_0.json").write_text(content)
    code, _, err = cli(["summary", tmp_path / "tl_"], capsys)
    assert code == 1 and "tl_0.json" in err and "not a" in err


def test_files_of_different_runs_under_one_prefix_are_refused(tmp_path, capsys):
    """A rerun of the same size that died before ranks 2 and 3 reopened their files:
    the four files look like one run but are two; every command names both."""
    for r in range(4):
        write_agent(tmp_path / f"tl_{r}.json", r, 4, [], run=("run-a", 1.8e9) if r < 2 else ("run-b", 1.8e9 + 5000))
    for command in (["summary", tmp_path / "tl_"], ["merge", tmp_path / "tl_", "-o", tmp_path / "m.json"]):
        code, _, err = cli(command, capsys)
        assert code == 1 and "different runs" in err, err
        assert "ranks 0, 1 of a run of 4 agents started" in err and "ranks 2, 3 of a run of 4 agents" in err, err
    for r in range(4):    # a rerun with fewer agents: the stale files are named by their run
        write_agent(tmp_path / f"tl_{r}.json", r, 4 if r < 2 else 8, [], run=("run-a", 1.8e9))
    code, _, err = cli(["summary", tmp_path / "tl_"], capsys)
    assert code == 1 and "ranks 2, 3 of a run of 8 agents" in err, err


def test_an_empty_file_is_named_as_empty(tmp_path, capsys):
    write_agent(tmp_path / "tl_0.json", 0, 2, [])
    (tmp_path / "tl_1.json").write_text("[\n")
    code, _, err = cli(["summary", tmp_path / "tl_"], capsys)
    assert code == 1 and "tl_1.json is empty" in err, err
    # cut inside its first line (a full disk, a short write): no whole event, so empty too,
    # and --allow-missing reads the run without it (it was "not a bluefog_lite timeline file")
    whole = (tmp_path / "tl_0.json").read_text()
    (tmp_path / "tl_1.json").write_text(whole[:60])
    code, _, err = cli(["summary", tmp_path / "tl_"], capsys)
    assert code == 1 and "tl_1.json is empty" in err, err
    code, out, err = cli(["summary", tmp_path / "tl_", "--allow-missing"], capsys)
    assert code == 0 and "tl_1.json (empty)" in out + err, (out, err)


def test_a_run_whose_agents_did_not_all_write_is_read_with_allow_missing(tmp_path, capsys):
    """Of 4 agents, 1 left an empty file and 3 none: refused, the message pointing to
    --allow-missing; with it every command reads agents 0 and 2, names what it left
    out, and merge's arrows join only the agents present."""
    prefix = str(tmp_path / "tl_")
    call = op_call("x", "ALLREDUCE", (10000, 10900), (10050, 10850), (10100, 10800))
    for r in (0, 2):
        write_agent(f"{prefix}{r}.json", r, 4, call)
    (tmp_path / "tl_1.json").write_text("[\n")
    code, _, err = cli(["summary", prefix], capsys)
    assert code == 1 and "tl_1.json is empty" in err and "--allow-missing" in err, err
    (tmp_path / "tl_1.json").unlink()
    code, _, err = cli(["merge", prefix, "-o", tmp_path / "m.json"], capsys)
    assert code == 1 and "missing: " in err and "tl_3.json" in err and "--allow-missing" in err, err
    (tmp_path / "tl_1.json").write_text("[\n")
    left_out = [f"{prefix}1.json (empty)", f"{prefix}3.json (missing)"]

    code, out, _ = cli(["summary", prefix, "--allow-missing", "--json", tmp_path / "s.json"], capsys)
    assert code == 0 and "without " + ", ".join(left_out) in out, out
    assert "(ranked among the agents whose file records each call: not the agents of the 2 skipped files)" in out, out
    summary = load_json(tmp_path / "s.json")
    assert [a["rank"] for a in summary["agents"]] == [0, 2] and summary["skipped"] == left_out
    assert all(a["time_ms"]["COMMUNICATE"] == pytest.approx(0.7) for a in summary["agents"])

    code, out, _ = cli(["merge", prefix, "--allow-missing", "-o", tmp_path / "m.json"], capsys)
    assert code == 0 and "2 agents" in out and "without " + ", ".join(left_out) in out, out
    events = load_json(tmp_path / "m.json")
    assert sorted(process_names(events).values()) == ["rank 0 (h)", "rank 2 (h)"]
    assert sorted((u, v) for u, v, _, _ in check_flows(events)) == [(1, 3), (3, 1)]    # pids of ranks 0, 2

    pytest.importorskip("matplotlib")
    code, out, _ = cli(["plot", prefix, "--allow-missing", "-o", tmp_path / "p.png"], capsys)
    assert code == 0 and "without " + ", ".join(left_out) in out and (tmp_path / "p.png").stat().st_size > 0

    for r in (0, 2):
        (tmp_path / f"tl_{r}.json").write_text("[\n")
    code, _, err = cli(["summary", prefix, "--allow-missing"], capsys)
    assert code == 1 and "every timeline file" in err and "is empty" in err, err


def test_merge_does_not_overwrite_its_inputs_and_leaves_no_partial_output(tmp_path, capsys):
    prefix = overlap_trace(tmp_path)
    before = (tmp_path / "tl_0.json").read_bytes()
    code, _, err = cli(["merge", prefix, "-o", f"{prefix}0.json"], capsys)
    assert code == 1 and "an input of the merge" in err, err
    assert (tmp_path / "tl_0.json").read_bytes() == before
    code, _, _ = cli(["merge", prefix, "-o", tmp_path / "m.json"], capsys)
    assert code == 0 and load_json(tmp_path / "m.json")
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".partial")]


def test_summary_json_and_plot_do_not_overwrite_their_inputs(tmp_path, capsys):
    """As merge: summary --json and plot -o onto a timeline file of the run are refused
    (summary wrote its JSON over rank 0's file)."""
    prefix = overlap_trace(tmp_path)
    before = (tmp_path / "tl_0.json").read_bytes()
    code, _, err = cli(["summary", prefix, "--json", f"{prefix}0.json"], capsys)
    assert code == 1 and "an input of the summary" in err, err
    pytest.importorskip("matplotlib")
    code, _, err = cli(["plot", prefix, "-o", f"{prefix}0.json"], capsys)
    assert code == 1 and "an input of the plot" in err, err
    assert (tmp_path / "tl_0.json").read_bytes() == before


def test_plot_of_a_window_without_slices_is_a_clear_error(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    prefix = overlap_trace(tmp_path)
    code, _, err = cli(["plot", prefix, "-o", tmp_path / "p.png", "--start", "5000", "--end", "6000"], capsys)
    assert code == 1 and "nothing to plot between 5000 and 6000 ms" in err, err
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("name", ["other", "communication", "COMMUNICATE", "MPI_NEIGHBOR_ALLREDUCE"])
def test_summary_refuses_compute_names_that_are_not_compute(tmp_path, capsys, name):
    prefix = overlap_trace(tmp_path)
    code, _, err = cli(["summary", prefix, "--compute", name], capsys)
    assert code == 1 and "not a compute activity" in err, err


def test_a_file_whose_rank_differs_from_its_name_is_refused(tmp_path, capsys):
    write_agent(tmp_path / "tl_0.json", 1, 2, [])
    code, _, err = cli(["summary", tmp_path / "tl_"], capsys)
    assert code == 1 and "records rank 1" in err


def test_a_run_under_a_prefix_that_extends_another_is_left_out(tmp_path, capsys):
    """Runs under run and run1 in one folder: run1's rank 0 file, run10.json, is not
    rank 10 of run (the tools refused run: 'records rank 0, not 10')."""
    for prefix, run in (("run", ("A", 1.7e9)), ("run1", ("B", 1.8e9))):
        for r in range(2):
            write_agent(tmp_path / f"{prefix}{r}.json", r, 2, op_call("w", "ALLREDUCE", (10, 50), (12, 48), (20, 40)),
                        run=run, prefix=str(tmp_path / prefix))
    code, out, err = cli(["summary", tmp_path / "run"], capsys)
    assert code == 0 and "2 agents" in out, err
    code, out, err = cli(["merge", tmp_path / "run", "-o", tmp_path / "m.json"], capsys)
    assert code == 0 and "run10.json (another run's" in out and "run11.json (another run's" in out, (out, err)
    assert len({e["pid"] for e in load_json(tmp_path / "m.json") if e.get("ph") == "B"}) == 2   # agents
    code, out, err = cli(["summary", tmp_path / "run1"], capsys)
    assert code == 0 and "2 agents" in out, err


@pytest.mark.parametrize("case", ["args_list", "no_ts", "ts_text", "x_no_name"])
def test_malformed_events_are_a_clear_error_not_a_traceback(tmp_path, capsys, case):
    write_agent(tmp_path / "tl_0.json", 0, 1, op_call("w", "ALLREDUCE", (10, 50), (12, 48), (20, 40)))
    text = (tmp_path / "tl_0.json").read_text()
    bad = {"args_list": lambda t: t.replace('"args": {"rank"', '"args": [], "was": {"rank"', 1),
           "no_ts": lambda t: t.replace('"ph":"B","ts":10.000,', '"ph":"B",', 1),
           "ts_text": lambda t: t.replace('"ts":10.000', '"ts":"10"', 1),
           "x_no_name": lambda t: t.replace('{"name":"COMMUNICATE","ph":"B","ts":20.000',
                                            '{"ph":"X","dur":1,"ts":20.000', 1)}[case](text)
    assert bad != text
    (tmp_path / "tl_0.json").write_text(bad)
    for command in (["summary"], ["merge", "-o", tmp_path / "m.json"]):
        code, _, err = cli([command[0], tmp_path / "tl_", *command[1:]], capsys)
        assert code == 1 and "error:" in err and "Traceback" not in err, err


def test_plot_without_matplotlib_names_the_install_command(tmp_path, capsys, monkeypatch):
    prefix = overlap_trace(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # import matplotlib raises ImportError
    code, _, err = cli(["plot", prefix, "-o", tmp_path / "p.png"], capsys)
    assert code == 1 and "pip install matplotlib" in err
    assert not (tmp_path / "p.png").exists()


# ---- the streaming reader on other layouts ------------------------------------------------------

def test_streaming_reader_reads_other_json_layouts(tmp_path):
    events = [{"name": "bluefog_metadata", "ph": "M", "pid": 0, "tid": 0, "args": {"rank": 0}},
              {"name": "A", "ph": "B", "ts": 1.5, "pid": 1, "tid": 1, "args": {"k": "v"}},
              {"name": "A\"q", "ph": "E", "ts": 2.0, "pid": 1, "tid": 1}]
    layouts = {"indented.json": json.dumps(events, indent=2), "oneline.json": json.dumps(events),
               "object.json": json.dumps({"traceEvents": events}),
               "lines.json": "[\n" + "".join(json.dumps(e) + ",\n" for e in events) + "]\n"}
    for name, text in layouts.items():
        (tmp_path / name).write_text(text)
        assert list(iter_events(tmp_path / name)) == events, name
        assert _reader.read_metadata(tmp_path / name) == {"rank": 0}


# ---- packaging --------------------------------------------------------------------------------------

def test_setup_declares_the_command_and_matplotlib_for_tests():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "setup.cfg"))
    scripts = cfg["options.entry_points"]["console_scripts"].split("\n")
    assert "bftimeline = bluefog_lite.timeline.__main__:main" in [s.strip() for s in scripts]
    assert "bfrun = bluefog_lite.run:main" in [s.strip() for s in scripts]
    assert "matplotlib" in cfg["options.extras_require"]["test"].split()


# ---- a real 4-agent run through the command line -------------------------------------------------

REAL_STEPS = 8


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bft")
    prefix = str(folder / "tl_")
    run_agents(4, "bft_train.py", REAL_STEPS, timeout=180, env={"BLUEFOG_TIMELINE": prefix})
    return folder, prefix


def _python_m(*args):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "bluefog_lite.timeline", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_real_run_files_share_one_run_id(real_run):
    _, prefix = real_run
    ids = {metadata(read_events(f"{prefix}{r}.json"))["run_id"] for r in range(4)}
    assert len(ids) == 1 and None not in ids, ids


def test_real_run_merge_has_one_process_per_agent_and_paired_arrows(real_run):
    folder, prefix = real_run
    proc = _python_m("merge", prefix, "-o", folder / "merged.json", "--topology", "RingGraph")
    assert proc.returncode == 0, proc.stderr
    events = load_json(folder / "merged.json")
    host = metadata(read_events(prefix + "0.json"))["hostname"]
    assert process_names(events) == {r + 1: f"rank {r} ({host})" for r in range(4)}
    arrows = check_flows(events)
    ring = {(r, (r + 1) % 4) for r in range(4)} | {(r, (r - 1) % 4) for r in range(4)}
    sync = collections.Counter((u - 1, v - 1) for u, v, s, _ in arrows if s["name"] == "sync")
    assert sync == {pair: REAL_STEPS for pair in ring}
    # on one clock, a receive ends after the neighbor's send began (within the offsets' error bound)
    slack = sum(metadata(read_events(f"{prefix}{r}.json"))["clock_offset_rtt_us"] for r in range(4)) + 2.0
    for _, _, s, f in arrows:
        assert s["ts"] <= f["ts"] + slack, (s, f)


def test_real_run_arrows_follow_the_recorded_sends_without_a_topology(real_run):
    """Each neighbor call records the ranks it sent to (SEND_TO marks): merge needs no
    --topology to draw exactly the ring's arrows (and none between non-neighbors)."""
    folder, prefix = real_run
    marks = [ev["name"] for ev in read_events(prefix + "0.json")
             if ev.get("ph") == "i" and ev["name"].startswith("SEND_TO ")]
    assert len(marks) >= REAL_STEPS and set(marks) == {"SEND_TO 1,3"}, sorted(set(marks))
    proc = _python_m("merge", prefix, "-o", folder / "merged_plain.json")
    assert proc.returncode == 0, proc.stderr
    arrows = check_flows(load_json(folder / "merged_plain.json"))
    ring = {(r, (r + 1) % 4) for r in range(4)} | {(r, (r - 1) % 4) for r in range(4)}
    sync = collections.Counter((u - 1, v - 1) for u, v, s, _ in arrows if s["name"] == "sync")
    assert sync == {pair: REAL_STEPS for pair in ring}


def _union_length(intervals):
    total, reach = 0.0, -float("inf")
    for b, e in sorted(intervals):
        if e > reach:
            total += e - max(b, reach)
            reach = e
    return total


def test_real_run_summary_matches_the_files_and_finds_the_slow_agent(real_run, capsys):
    folder, prefix = real_run
    code, out, err = cli(["summary", prefix, "--json", folder / "summary.json"], capsys)
    assert code == 0, err
    assert "straggler ranking" in out and "overlap %" in out
    summary = load_json(folder / "summary.json")
    assert [a["rank"] for a in summary["agents"]] == [0, 1, 2, 3]
    for a in summary["agents"]:
        spans = read_spans(read_events(f"{prefix}{a['rank']}.json"))
        for activity in ("FORWARD", "BACKWARD", "COMMUNICATE"):
            intervals = [(s.begin, s.end) for s in spans if s.name == activity]
            expected = _union_length(intervals) / 1000.0
            # to a nanosecond per span: the files' resolution (float microseconds since boot
            # are off by ~1e-5 us on a host up for a day)
            assert expected > 0 and a["time_ms"][activity] == pytest.approx(expected, abs=1e-6 * len(intervals))
        assert 0.0 <= a["overlap_percent"] <= 100.0
        assert a["idle_ms"] >= 0.0 and a["window_ms"] > a["time_ms"]["communication"]
    ops = {op["name"]: op for op in summary["stragglers"]["operations"]}
    assert ops["sync"]["calls"] == REAL_STEPS
    slowest = ops["sync"]["last"][0]                 # rank 3 sleeps 50 ms before every sync
    assert slowest["rank"] == 3 and slowest["times"] > REAL_STEPS // 2


def test_real_run_plot_is_a_png_of_sane_size_with_the_phase_colors(real_run):
    folder, prefix = real_run
    out = folder / "timeline.png"
    code = main(["plot", prefix, "-o", str(out)])
    assert code == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width == 1400 and 300 <= height <= 1200 and len(data) > 20_000
    import matplotlib.image
    pixels = (matplotlib.image.imread(str(out))[:, :, :3] * 255).round().astype(int)
    colors = {tuple(p) for p in pixels.reshape(-1, 3)}
    for hex_color in ("#2171b5", "#6a51a3", "#e6550d"):   # FORWARD, BACKWARD, COMMUNICATE
        assert tuple(int(hex_color[i:i + 2], 16) for i in (1, 3, 5)) in colors


def test_window_operations_phases_are_not_kept_after_their_span():
    """The reader keeps a row's COMMUNICATE slices only until its MPI_ span ends, also
    for window operations (no exchange arrows): a long run holds a few numbers per
    call, not every window call's slices."""
    from bluefog_lite.timeline._exchanges import AgentExchanges
    from bluefog_lite.timeline._slices import Slice
    ex = AgentExchanges()
    for k in range(1000):
        t = 10.0 * k
        ex.instant(1, 2, t + 1, "SEND_TO 1")
        ex.add(Slice(1, 2, "COMMUNICATE", t + 1, t + 5, True))
        ex.add(Slice(1, 2, "MPI_WIN_PUT", t, t + 6, True))
    assert not any(ex._communicate.values()) and not any(ex._sends.values())


def test_summary_lists_each_operations_communication_time(tmp_path, capsys):
    """Per operation: the mean over the agents of its COMMUNICATE and MPI_ time, its calls,
    the longest COMMUNICATE first (no per-operation figure said which layer's exchange
    took the time)."""
    prefix = str(tmp_path / "tl_")
    for r in range(2):
        slices = []
        for k in range(2):      # "big": MPI_ 6000 + 1000 r µs, COMMUNICATE 5000 + 1000 r
            t = 100000.0 * (k + 1)
            slices += op_call("big", "NEIGHBOR_ALLREDUCE", (t, t + 7000 + 1000 * r), (t + 10, t + 6010 + 1000 * r),
                              (t + 20, t + 5020 + 1000 * r))
        for k in range(3):      # "small": MPI_ 3000 µs, COMMUNICATE 1000
            t = 50000.0 + 100000.0 * k
            slices += op_call("small", "ALLREDUCE", (t, t + 4000), (t + 10, t + 3010), (t + 20, t + 1020))
        write_agent(f"{prefix}{r}.json", r, 2, slices)
    code, out, _ = cli(["summary", prefix, "--json", tmp_path / "s.json"], capsys)
    assert code == 0
    ops = load_json(tmp_path / "s.json")["operations"]
    assert [(o["name"], o["calls"], o["agents"]) for o in ops] == [("big", 2, 2), ("small", 3, 2)]
    assert ops[0]["communicate_ms"] == pytest.approx(2 * 5.5) and ops[0]["mpi_ms"] == pytest.approx(2 * 6.5)
    assert ops[1]["communicate_ms"] == pytest.approx(3 * 1.0) and ops[1]["mpi_ms"] == pytest.approx(3 * 3.0)
    table = out[out.index("operations by communication time"):].splitlines()
    assert table[2].split() == ["big", "2", "11.000", "13.000", "5.500"], table[:4]


def test_summary_gives_unnamed_calls_of_a_kind_one_row(tmp_path, capsys):
    """Calls without a name get one each (<kind>.noname.<n>): a loop of them made one row
    per call, one call each, in the operations and straggler tables; they are one row
    per kind."""
    prefix = str(tmp_path / "tl_")
    for r in range(2):
        slices = []
        for k in range(5):      # 5 unnamed neighbor_allreduce calls: MPI_ 3000 µs, COMMUNICATE 1000 + 1000 r
            t = 50000.0 * (k + 1)
            slices += op_call(f"neighbor_allreduce.noname.{k + 7}", "NEIGHBOR_ALLREDUCE", (t, t + 100),
                              (t + 10, t + 3010), (t + 20, t + 1020 + 1000 * r))
        t = 400000.0            # one unnamed allreduce, and a user's name that only looks alike
        slices += op_call("allreduce.noname.0", "ALLREDUCE", (t, t + 4000), (t + 10, t + 3010), (t + 20, t + 2020))
        slices += op_call("w.noname.x", "ALLREDUCE", (t + 5000, t + 6000), (t + 5010, t + 5510), (t + 5020, t + 5520))
        write_agent(f"{prefix}{r}.json", r, 2, slices)
    code, out, _ = cli(["summary", prefix, "--json", tmp_path / "s.json"], capsys)
    assert code == 0
    ops = load_json(tmp_path / "s.json")["operations"]
    assert [(o["name"], o["calls"], o["agents"]) for o in ops] == [
        ("neighbor_allreduce.noname.*", 5, 2), ("allreduce.noname.*", 1, 2), ("w.noname.x", 1, 2)]
    assert ops[0]["communicate_ms"] == pytest.approx(5 * 1.5) and ops[0]["mpi_ms"] == pytest.approx(5 * 3.0)
    assert "neighbor_allreduce.noname.*" in out and "noname.7" not in out
    st = load_json(tmp_path / "s.json")["stragglers"]["operations"]
    assert [(o["name"], o["calls"]) for o in st] == [("allreduce.noname.*", 1), ("neighbor_allreduce.noname.*", 5),
                                                      ("w.noname.x", 1)]

"""Communication overlaps computation for real (SPEC section 7), read off the timeline.

A 5-layer MLP (width 512, batch 256) is trained with the AWC and the ATC
optimizer on 2 agents with the timeline on (worker tests/workers/overlap_train.py);
the test reads each agent's file and compares, step by step, when each
parameter's MPI_NEIGHBOR_ALLREDUCE (communication thread) begins with the
FORWARD/BACKWARD spans of the layers (main thread):

- AWC sends a module's parameters right after its forward: each MPI_ span
  begins after that layer's FORWARD ended and before the step's backward pass
  is over (the last BACKWARD span ends).
- ATC sends a parameter as soon as its gradient is ready and its local step
  done: each MPI_ span begins after that layer's BACKWARD ended, and the last
  layer's begins while the first layer (later in back-propagation) is still in
  BACKWARD.

The order constraints (nothing sent before its forward or gradient) hold in
every step. Whether the communication thread gets a core before the backward
pass ends is the scheduler's call: with both cores busy in back-propagation it
usually runs within ~1 ms (margins of 5-10 ms), but once in a while it waits a
whole time slice (~7 ms, seen once in a CI run). So each agent may have up to
three steps of the ten in which overlap did not happen; four or more fail the
test. (If 1 step in 20 has a hiccup, 4 of 10 happen in 1 run in 1000; 2 of
5, the previous rule, in 1 in 44.)
"""
import collections

import pytest

from bluefog_lite.timeline._reader import read_events, read_spans
from mpi_helpers import run_agents

AGENTS, STEPS, LAYERS = 2, 11, 5
LATE_ALLOWED = 3
WARMUP = 1   # the first step allocates buffers and the optimizer state: not representative


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("overlap") / "tl")
    run_agents(AGENTS, "overlap_train.py", STEPS, 512, 256, timeout=180, env={"BLUEFOG_TIMELINE": prefix})
    return [_spans_by_row(read_events(f"{prefix}{r}.json")) for r in range(AGENTS)]


def _spans_by_row(events):
    """{(tensor name, thread name): [(activity, begin, end), ...]} of one agent's file."""
    process = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e.get("ph") == "M" and e["name"] == "thread_name"}
    rows = collections.defaultdict(list)
    for s in read_spans(events):
        rows[(process[s.pid], thread[(s.pid, s.tid)])].append((s.name, s.begin, s.end))
    return rows


def _steps(rows, tag):
    """Per step after the warm-up: {param: {"FORWARD"/"BACKWARD": (first begin, last end), "MPI": begin}}.
    A span the writer split around an overlapping one shows as several slices:
    take the first begin and the last end."""
    windows = [(b, e) for name, b, e in rows[(f"{tag}.step", "main")] if name == "STEP"]
    assert len(windows) == STEPS, windows
    params = [f"{tag}{i}.{kind}" for i in range(LAYERS) for kind in ("weight", "bias")]
    steps = []
    for begin, end in windows[WARMUP:]:
        step = {}
        for p in params:
            inside = [(a, b, e) for a, b, e in rows[(p, "main")] if begin <= b <= end]
            mpi = [b for a, b, e in rows[(p, "communication")]
                   if a == "MPI_NEIGHBOR_ALLREDUCE" and begin <= b <= end]
            assert len(mpi) == 1, (tag, p, mpi)      # one exchange per parameter per step
            step[p] = {"MPI": mpi[0]}
            for activity in ("FORWARD", "BACKWARD"):
                spans = [(b, e) for a, b, e in inside if a == activity]
                assert spans, (tag, p, activity)
                step[p][activity] = (min(b for b, _ in spans), max(e for _, e in spans))
        steps.append(step)
    return steps


def _overlapped_in_most_steps(late, rank):
    """late: {step: [what started too late]}; a few scheduler hiccups per agent are allowed."""
    assert len(late) <= LATE_ALLOWED, (rank, f"no overlap in {len(late)} of {STEPS - WARMUP} steps", late)


def test_awc_communication_starts_after_forward_and_before_backward_ends(traces):
    for rank, rows in enumerate(traces):
        late = {}
        for n, step in enumerate(_steps(rows, "awc")):
            backward_end = max(s["BACKWARD"][1] for s in step.values())
            for p, s in step.items():
                assert s["MPI"] >= s["FORWARD"][1], (rank, n, p, "sent before its forward ended")
                if s["MPI"] >= backward_end:
                    late.setdefault(n, []).append(
                        f"{p}: MPI_ began {(s['MPI'] - backward_end) / 1e3:.2f} ms after the backward pass")
        _overlapped_in_most_steps(late, rank)


def test_atc_sends_each_layer_while_earlier_layers_are_still_in_backward(traces):
    last, first = f"atc{LAYERS - 1}", "atc0"
    for rank, rows in enumerate(traces):
        late = {}
        for n, step in enumerate(_steps(rows, "atc")):
            for p, s in step.items():
                assert s["MPI"] >= s["BACKWARD"][1], (rank, n, p, "sent before its gradient was ready")
            for kind in ("weight", "bias"):
                start = step[f"{last}.{kind}"]["MPI"]
                still_running = step[f"{first}.weight"]["BACKWARD"][1]
                if start >= still_running:
                    late.setdefault(n, []).append(f"{last}.{kind} sent {(start - still_running) / 1e3:.2f} ms "
                                                  "after the first layer's BACKWARD ended")
        _overlapped_in_most_steps(late, rank)

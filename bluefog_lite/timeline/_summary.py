"""bftimeline summary: where each agent's time went, how much communication
overlapped computation, and which agent made the others wait.

Times are lengths of unions (a phase running on two rows at once counts once):
- compute: FORWARD, BACKWARD (and any extra activity names given as compute);
- communication: the MPI_<OP> slices (the communication thread working on an
  operation), and each of their sub-phases separately;
- idle: the agent's recorded window (first to last timestamp) minus the union
  of all its slices: no activity of any kind recorded.
Overlap = |communication ∩ compute| / |communication|.

Operations: per operation name (a layer's parameter, a window...), the mean over
the agents of its COMMUNICATE time and of its MPI_ time, and its calls, the
longest COMMUNICATE first: where the communication time goes (several
operations in flight at once each count their own time; MPI_ also holds the
wait for a collective's turn behind the ones before it). Unnamed calls, which
get a new name each (<kind>.noname.<n>), are one row per kind, <kind>.noname.*.

Stragglers: for the k-th call of each two-sided operation, the agents'
ENQUEUE_ begins on rank 0's clock; the last one is that call's straggler, and
it held the call up by its lead over the second-to-last agent (unnamed calls:
one row per kind here too). The ranking
orders the agents by the time during which they held at least one call up
(calls held up at once, e.g. every layer's of one step, count once), and gives
the sum over calls too.
"""
import collections
from array import array

import numpy as np

from . import _intervals
from ._agents import find_agents, refuse_as_output
from ._exchanges import EXCHANGE_KINDS, AgentExchanges
from ._reader import iter_events
from ._slices import SliceReader
from ._writer import GENERATED_NAME

COMPUTE = ("FORWARD", "BACKWARD")
PHASES = ("NEGOTIATION", "ALLOCATE_OUTPUT", "COMMUNICATE", "COMPUTE_AVERAGE", "MEMCPY_IN_FUSION_BUFFER",
          "WIN_SYNC_COMPUTE_AVERAGE", "ACQUIRE_MUTEX", "COPY_TO_HOST", "COPY_TO_DEVICE",
          "WAIT_COPY_TO_HOST")
COMMUNICATION = "communication"
_OTHER = "other"


def summarize(prefix, compute=(), allow_missing=False, output=None):
    """The summary of a run as a dict (what --json writes). allow_missing: see
    find_agents; output: where the caller will write it (refused if a run file)."""
    for name in compute:
        if name in (COMMUNICATION, _OTHER) or name in PHASES or name.startswith(("MPI_", "ENQUEUE_")):
            raise ValueError(f"--compute {name!r}: that is not a compute activity (communication phases and the "
                             f"summary's own '{COMMUNICATION}' and '{_OTHER}' columns cannot be counted as compute)")
    compute = tuple(dict.fromkeys(COMPUTE + tuple(compute)))
    agents, arrivals = [], {}
    found = find_agents(prefix, allow_missing)
    if output is not None:
        refuse_as_output(found, output, "summary")
    per_op = collections.defaultdict(list)       # name -> each agent's (MPI_ us, COMMUNICATE us, calls)
    for agent in found:
        row, arrivals[agent.rank], ops = _agent_summary(agent, compute)
        agents.append(row)
        groups = collections.defaultdict(lambda: [0.0, 0.0, 0])
        for name, times in ops.items():
            group = groups[_row_name(name)]
            for i, t in enumerate(times):
                group[i] += t
        for name, times in groups.items():
            per_op[name].append(times)
    asked = [name for name in compute if name not in COMPUTE]
    return {"prefix": prefix, "agents": agents, "skipped": found.skipped, "compute": list(compute),
            "compute_not_found": [name for name in asked if not any(name in a["time_ms"] for a in agents)],
            "phases": [p for p in PHASES if any(p in a["time_ms"] for a in agents)],
            "operations": _operations(per_op), "stragglers": stragglers(arrivals)}


def _operations(per_op):
    """Each operation's mean (over the agents) MPI_ and COMMUNICATE time and calls,
    the longest COMMUNICATE first."""
    rows = [{"name": name, "agents": len(times),
             "mpi_ms": sum(t[0] for t in times) / len(times) / 1000.0,
             "communicate_ms": sum(t[1] for t in times) / len(times) / 1000.0,
             "calls": max(t[2] for t in times)} for name, times in per_op.items()]
    return sorted(rows, key=lambda r: (-r["communicate_ms"], -r["mpi_ms"], r["name"]))


def _agent_summary(agent, compute):
    """One pass over the file: per-category intervals (about one file's slices), op records."""
    reader = SliceReader(iter_events(agent.path), agent.offset_us)
    records = AgentExchanges()
    category = {}
    spans = collections.defaultdict(lambda: (array("d"), array("d")))
    per_op = collections.defaultdict(lambda: [0.0, 0.0, 0])    # pid -> [MPI_ us, COMMUNICATE us, calls]
    for s in reader:
        records.add(s)
        cat = category.get(s.name)
        if cat is None:
            cat = category[s.name] = _category(s.name, compute)
        b, e = spans[cat]
        b.append(s.begin)
        e.append(s.end)
        if cat is COMMUNICATION:
            times = per_op[s.pid]
            times[0] += s.end - s.begin
            times[2] += 1
        elif cat == "COMMUNICATE":
            per_op[s.pid][1] += s.end - s.begin
    unions = {cat: _intervals.union(*spans.pop(cat)) for cat in list(spans)}
    busy = _intervals.union(np.concatenate([u[0] for u in unions.values()] or [[]]),
                            np.concatenate([u[1] for u in unions.values()] or [[]]))
    compute_parts = [unions[c] for c in compute if c in unions]
    compute_union = _intervals.union(np.concatenate([u[0] for u in compute_parts] or [[]]),
                                     np.concatenate([u[1] for u in compute_parts] or [[]]))
    comm = unions.get(COMMUNICATION)
    window = reader.last - reader.first if reader.last >= reader.first else 0.0
    time_ms = {cat: _intervals.length(u) / 1000.0 for cat, u in unions.items() if cat != _OTHER}
    comm_us = _intervals.length(comm) if comm is not None else 0.0
    overlap = 100.0 * _intervals.overlap(comm, compute_union) / comm_us if comm_us > 0 else None
    rtt = agent.meta.get("clock_offset_rtt_us")
    row = {"rank": agent.rank, "hostname": agent.hostname, "clock_offset_us": agent.offset_us,
           "clock_error_us": rtt / 2.0 if isinstance(rtt, (int, float)) else None,
           "window_ms": window / 1000.0, "time_ms": time_ms,
           "idle_ms": (window - _intervals.length(busy)) / 1000.0,
           "overlap_percent": overlap, "unfinished_slices": reader.unfinished, "ended": reader.ended}
    ops = {reader.process_name(pid): tuple(times) for pid, times in per_op.items() if times[2]}
    return row, records.finish(reader.process_name).arrivals, ops


def _category(name, compute):
    if name in compute or name in PHASES:
        return name
    if name.startswith("MPI_"):
        return COMMUNICATION
    return _OTHER


def _row_name(name):
    """The row of an operation in the tables: its name, or <kind>.noname.* for an
    unnamed call (which has a name of its own: <kind>.noname.<n>)."""
    return name.rsplit(".", 1)[0] + ".*" if GENERATED_NAME.fullmatch(name) else name


def stragglers(arrivals):
    """Straggler ranking from {rank: {(op name, kind): ENQUEUE begins by occurrence}}."""
    rows = {}     # (row name, kind) -> [calls, times last, held up] (unnamed calls of a kind: one row)
    total_last = collections.Counter()
    total_held = collections.Counter()       # summed over calls
    held_spans = collections.defaultdict(lambda: (array("d"), array("d")))   # rank -> the spans it held calls up
    total_calls = collections.Counter()
    total_missed = collections.Counter()     # calls ranked without an agent whose file has other calls of the op
    for key in sorted({k for per_agent in arrivals.values() for k in per_agent}):
        if key[1] not in EXCHANGE_KINDS:
            continue
        last, held, calls = collections.Counter(), collections.Counter(), 0
        columns = {r: per_agent[key] for r, per_agent in arrivals.items() if key in per_agent}
        for k in range(max(len(c) for c in columns.values())):
            called = sorted((c[k], r) for r, c in columns.items() if k < len(c))
            if len(called) < 2:
                continue
            calls += 1
            total_missed.update(r for r, c in columns.items() if k >= len(c))
            (t2, _), (t1, r_last) = called[-2], called[-1]
            last[r_last] += 1
            held[r_last] += t1 - t2
            held_spans[r_last][0].append(t2)
            held_spans[r_last][1].append(t1)
            for _, r in called:
                total_calls[r] += 1
        if calls == 0:
            continue
        total_last.update(last)
        total_held.update(held)
        row = rows.setdefault((_row_name(key[0]), key[1]), [0, collections.Counter(), collections.Counter()])
        row[0] += calls
        row[1].update(last)
        row[2].update(held)
    ops = [{"name": name, "kind": kind, "calls": calls,
            "last": [{"rank": r, "times": n, "held_up_ms": held[r] / 1000.0}
                     for r, n in sorted(last.items(), key=lambda x: (-x[1], -held[x[0]], x[0]))]}
           for (name, kind), (calls, last, held) in rows.items()]
    held_wall = {r: _intervals.length(_intervals.union(*spans)) for r, spans in held_spans.items()}
    ranking = [{"rank": r, "times_last": total_last[r], "calls": total_calls[r],
                "held_up_ms": held_wall.get(r, 0.0) / 1000.0, "held_up_summed_ms": total_held[r] / 1000.0,
                "calls_missing": total_missed[r]}
               for r in sorted(total_calls, key=lambda r: (-held_wall.get(r, 0.0), -total_held[r],
                                                           -total_last[r], r))]
    return {"operations": ops, "ranking": ranking}


# ---- the table ------------------------------------------------------------------

def format_summary(summary):
    """The summary as readable text."""
    agents = summary["agents"]
    lines = [f"bftimeline summary of {summary['prefix']}<rank>.json: {len(agents)} agents, "
             "times in ms on rank 0's clock"]
    if summary.get("skipped"):
        lines.append("without " + ", ".join(summary["skipped"]))
    columns = ([(c, _shown(c)) for c in summary["compute"] if any(c in a["time_ms"] for a in agents)]
               + [(COMMUNICATION, "comm (MPI_*)")] + [(p, p) for p in summary["phases"]])
    headers = ["agent", "host", "clock ±us", "window"] + [label for _, label in columns] + ["idle", "overlap %"]
    rows = []
    for a in agents:
        overlap = "-" if a["overlap_percent"] is None else f"{a['overlap_percent']:.1f}"
        clock = "-" if a["clock_error_us"] is None else f"{a['clock_error_us']:.0f}"
        rows.append([str(a["rank"]), a["hostname"], clock, f"{a['window_ms']:.3f}"]
                    + [f"{a['time_ms'].get(c, 0.0):.3f}" for c, _ in columns]
                    + [f"{a['idle_ms']:.3f}", overlap])
    lines += _table(headers, rows)
    unfinished = [f"rank {a['rank']} ({a['unfinished_slices']})" for a in agents if a["unfinished_slices"]]
    if unfinished:
        lines.append("slices never ended (crashed or killed agent; counted up to the file's last "
                     "timestamp): " + ", ".join(unfinished))
    unended = [f"rank {a['rank']}" for a in agents if not a.get("ended", True)]
    if unended:
        lines.append("files without the writer's end mark (the agent was killed, or is still writing): "
                     + ", ".join(unended))
    lines.append("clock ±us: at most this far off rank 0's clock (half the round trip of the offset "
                 "measurement at init)")
    lines.append("overlap % = time when communication (MPI_*) and compute (" + ", ".join(summary["compute"])
                 + ") ran at once / communication time")
    lines += [""] + _format_operations(summary.get("operations", []))
    lines += [""] + _format_stragglers(summary["stragglers"])
    cut_ranks = {a["rank"] for a in agents if a["unfinished_slices"] or not a.get("ended", True)}
    partial = [f"rank {r}" for r in sorted(cut_ranks)]
    short = [f"rank {x['rank']} not in {x['calls_missing']}" for x in summary["stragglers"]["ranking"]
             if x.get("calls_missing") and x["rank"] not in cut_ranks]
    ranked = {x["rank"] for x in summary["stragglers"]["ranking"]}
    # (a file that records no call at all: a step window that never opened on that agent)
    silent = [f"rank {a['rank']}" for a in agents if a["rank"] not in ranked and a["rank"] not in cut_ranks]
    if summary["stragglers"]["operations"] and (summary.get("skipped") or partial or short or silent):
        without = [f"not the agents of the {len(summary['skipped'])} skipped files"] if summary.get("skipped") else []
        cut = [", ".join(partial) + " only up to where its file was cut"] if partial else []
        fewer = [", ".join(short) + " calls that other agents' files record (its file ended earlier; had it "
                 "begun later, its calls were paired with the others' from the first, and misranked)"] if short else []
        none = [f"not {', '.join(silent)}, whose file records none of them"] if silent else []
        lines.append("(ranked among the agents whose file records each call: "
                     + "; ".join(without + cut + fewer + none) + ")")
    return "\n".join(lines) + "\n"


def _format_operations(ops, shown=12):
    if not ops:
        return ["operations: none recorded an MPI_ span"]
    lines = ["operations by communication time (mean over the agents; operations in flight at once each "
             "count their own time)" + (f", the first {shown} of {len(ops)}:" if len(ops) > shown else ":")]
    rows = [[_shown(op["name"]), str(op["calls"]), f"{op['communicate_ms']:.3f}", f"{op['mpi_ms']:.3f}",
             f"{op['communicate_ms'] / op['calls']:.3f}"] for op in ops[:shown]]
    return lines + _table(["operation", "calls", "COMMUNICATE ms", "MPI_ ms", "COMMUNICATE per call"], rows)


def _format_stragglers(st):
    if not st["operations"]:
        return ["stragglers: no operation was called by two or more agents"]
    lines = ["stragglers: the agent that called each operation last (ENQUEUE_ begin); "
             "held up = its lead over the second-to-last agent"]
    rows = []
    for op in st["operations"]:
        top = op["last"][0]
        others = ", ".join(f"{x['rank']}:{x['times']}" for x in op["last"][1:])
        rows.append([_shown(op["name"]), _shown(op["kind"]), str(op["calls"]), f"rank {top['rank']}",
                     f"{top['times']} ({100.0 * top['times'] / op['calls']:.0f}%)",
                     f"{top['held_up_ms']:.3f}", others or "-"])
    lines += _table(["operation", "kind", "calls", "last most often", "times", "held up ms",
                     "others last (rank:times)"], rows)
    lines += ["", "straggler ranking over all operations (by the time during which each agent held at least one "
              "call up; summed: over calls, so calls held up at once count each)"]
    rows = [[f"rank {x['rank']}", f"{x['times_last']} of {x['calls']}",
             f"{100.0 * x['times_last'] / x['calls']:.1f}" if x["calls"] else "-", f"{x['held_up_ms']:.3f}",
             f"{x['held_up_summed_ms']:.3f}"]
            for x in st["ranking"]]
    lines += _table(["agent", "last", "last %", "held up ms", "summed ms"], rows)
    return lines


_SHOWN = 60      # characters of a name the tables show (--json has them whole)


def _shown(name):
    """name as a table cell: characters that are not printable (newlines, tabs, NUL,
    escape sequences, lone surrogates) escaped, at most _SHOWN characters."""
    if not name.isprintable():
        name = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in name)
    return name if len(name) <= _SHOWN else name[:_SHOWN - 3] + "..."


def _table(headers, rows):
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells):     # the first two columns (names) left-aligned, numbers right-aligned
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [line(headers)] + [line(r) for r in rows]

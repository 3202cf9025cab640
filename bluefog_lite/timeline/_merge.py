"""bftimeline merge: every agent's file in one trace, on rank 0's clock, with
flow arrows from each exchange's send to the matching receive.

One process per agent ("rank R (host)"), one thread per row of the agent's
file ("<op name> / <thread>"). The output is streamed: each file is read once,
its events are written as they come, and only compact per-operation records
are kept for the arrows, which are written last (viewers sort by time).

Arrows: for the k-th call of a named two-sided operation, from the begin of
the sender's COMMUNICATE (when it posted its data) to the end of the
receiver's (when what it waited for had arrived). Collectives connect every
pair of agents; a neighbor operation's call connects its agent to the ranks it
recorded sending to (SEND_TO marks); for files without them, every pair, or the
edges of the topology if one is given.
"""
import json
import math
import os

from ._agents import find_agents, refuse_as_output
from ._exchanges import COLLECTIVE_KINDS, AgentExchanges, phase_of
from ._reader import iter_events
from ._slices import SliceReader

FLOW_CATEGORY = "exchange"
_INSIDE_US = 0.5   # arrow ends are placed this far (at most) inside their slice, so that they bind to it


def merge(prefix, out_path, topology=None, flows=True, allow_missing=False):
    """Write the merged trace of the run under prefix to out_path.

    topology: None, or a callable size -> networkx.DiGraph whose edges are the
    neighbor exchanges; allow_missing: see find_agents. Returns {"agents": n,
    "events": m, "flows": f, "skipped": [the files left out]}."""
    agents = find_agents(prefix, allow_missing)
    refuse_as_output(agents, out_path, "merge")
    counts = {"agents": len(agents), "events": 0, "flows": 0, "skipped": agents.skipped}
    folder = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write {out_path}: its folder {folder} does not exist")
    if os.path.isdir(out_path):
        raise ValueError(f"cannot write {out_path}: it is a folder (give a file name, e.g. {out_path}/merged.json)")
    partial = f"{out_path}.partial"     # moved to out_path once whole
    try:
        _write(prefix, agents, partial, topology, flows, counts)
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise
    os.replace(partial, out_path)
    counts["flows"] //= 2
    return counts


def _write(prefix, agents, path, topology, flows, counts):
    records = {}
    with open(path, "w", encoding="utf-8") as out:
        out.write("[\n")
        for agent in agents:
            writer = _AgentWriter(agent, out)
            counts["events"] += writer.copy()
            records[agent.rank] = (writer.records, writer.tids)
        if flows:     # (the run's size: files may be missing)
            size = agents[0].meta.get("size")
            edges = _edges(topology, size if isinstance(size, int) else agents[-1].rank + 1)
            for line in _flow_lines(records, edges):
                out.write(line)
                counts["flows"] += 1
        out.write(_line({"name": "bluefog_merged", "ph": "M", "pid": 0, "tid": 0,
                         "args": {"prefix": prefix, "agents": len(agents), "clock": "rank 0",
                                  "flows": counts["flows"] // 2}}, last=True))


def agent_pid(rank):
    return rank + 1


class _AgentWriter:
    """Copies one agent's events into the merged file: new pid, tid per row, shifted ts."""

    def __init__(self, agent, out):
        self.agent, self.out = agent, out
        self.pid = agent_pid(agent.rank)
        self.tids = {}            # (pid, tid) in the agent's file -> tid in the merged trace
        self.records = AgentExchanges()
        self._quoted = {}

    def copy(self):
        a, out = self.agent, self.out
        out.write(_line({"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0,
                         "args": {"name": f"rank {a.rank} ({a.hostname})"}}))
        out.write(_line({"name": "process_sort_index", "ph": "M", "pid": self.pid, "tid": 0,
                         "args": {"sort_index": a.rank}}))
        reader = SliceReader(self._passthrough(iter_events(a.path)), a.offset_us)
        reader.on_instant = self.records.instant
        count = 0
        for s in reader:
            self.records.add(s)
            if not s.finished:   # a crashed agent's open slice: end it where its file ends
                tid = self._tid(s.pid, s.tid)
                out.write(f'{{"name":{self._q(s.name)},"ph":"E","ts":{s.end:.3f},"pid":{self.pid},'
                          f'"tid":{tid},"args":{{"unfinished":true}}}},\n')
                count += 1
        self.records.finish(reader.process_name)
        self._name_threads(reader)
        return count + self._copied

    def _passthrough(self, events):
        """Yields the events unchanged (for the SliceReader) after writing their merged form."""
        write, off, pid, q, tids = self.out.write, self.agent.offset_us, self.pid, self._q, self.tids
        self._copied = 0
        for ev in events:
            ph = ev.get("ph")
            if ph == "M":
                if ev.get("name") == "bluefog_metadata" or ev.get("name") == "bluefog_end":
                    write(_line(dict(ev, pid=pid, tid=0)))
                    self._copied += 1
            elif (ph == "B" or ph == "E") and len(ev) == 5 or ph == "X" and len(ev) == 6:
                # the writer's plain begin/end/complete lines
                key = (ev["pid"], ev["tid"])
                tid = tids.get(key) or self._tid(*key)
                dur = f'"dur":{ev["dur"]:.3f},' if ph == "X" else ""
                write(f'{{"name":{q(ev["name"])},"ph":"{ph}","ts":{ev["ts"] + off:.3f},{dur}'
                      f'"pid":{pid},"tid":{tid}}},\n')
                self._copied += 1
            else:
                moved = dict(ev, pid=pid)
                if "tid" in ev:
                    moved["tid"] = self._tid(ev.get("pid"), ev["tid"])
                if "ts" in ev:
                    moved["ts"] = round(ev["ts"] + off, 3)
                write(_line(moved))
                self._copied += 1
            yield ev

    def _tid(self, pid, tid):
        new = self.tids.get((pid, tid))
        if new is None:
            new = self.tids[(pid, tid)] = len(self.tids) + 1
        return new

    def _q(self, text):
        quoted = self._quoted.get(text)
        if quoted is None:
            quoted = self._quoted[text] = json.dumps(text)
        return quoted

    def _name_threads(self, reader):
        for order, ((pid, tid), new) in enumerate(sorted(self.tids.items(), key=lambda kv: _row_order(kv[0]))):
            name = f"{reader.process_name(pid)} / {reader.thread_name(pid, tid)}"
            self.out.write(_line({"name": "thread_name", "ph": "M", "pid": self.pid, "tid": new,
                                  "args": {"name": name}}))
            self.out.write(_line({"name": "thread_sort_index", "ph": "M", "pid": self.pid, "tid": new,
                                  "args": {"sort_index": order}}))


def _row_order(key):
    pid, tid = key
    return (pid if isinstance(pid, int) else math.inf, tid if isinstance(tid, int) else math.inf, str(key))


def _line(ev, last=False):
    return json.dumps(ev, separators=(",", ":")) + ("\n]\n" if last else ",\n")


def _edges(topology, size):
    """(kind -> list of (src, dst)) chooser: every pair, or the topology's edges for neighbor ops."""
    everyone = [(u, v) for u in range(size) for v in range(size) if u != v]
    if topology is None:
        return lambda kind: everyone
    graph = topology(size)
    neighbors = sorted((int(u), int(v)) for u, v in graph.edges() if u != v)
    return lambda kind: everyone if kind in COLLECTIVE_KINDS else neighbors


def _flow_lines(records, edges):
    """The "s"/"f" event lines of every arrow, generated lazily."""
    flow_id = 0
    keys = sorted({key for recs, _ in records.values() for key in recs.exchanges})
    marked = any(d is not None for recs, _ in records.values() for ex in recs.exchanges.values() for d in ex.dsts)
    for key in keys:
        name, kind = key
        present = {r: recs for r, (recs, _) in records.items() if key in recs.exchanges}
        pairs = [(u, v) for u, v in edges(kind) if u in present and v in present]
        if not pairs:
            continue
        n = max(len(recs.exchanges[key].send) for recs in present.values())
        for k in range(n):
            for u, v in _pairs_of_call(present, key, k, kind, pairs, marked):
                send = _end_point(present[u], records[u][1], key, k, v, sending=True)
                recv = _end_point(present[v], records[v][1], key, k, u, sending=False)
                if send is None or recv is None:
                    continue
                flow_id += 1
                args = {"op": kind, "occurrence": k, "from_rank": u, "to_rank": v}
                yield _line({"name": name, "cat": FLOW_CATEGORY, "ph": "s", "id": flow_id, "ts": send[0],
                             "pid": agent_pid(u), "tid": send[1], "args": args})
                yield _line({"name": name, "cat": FLOW_CATEGORY, "ph": "f", "bp": "e", "id": flow_id,
                             "ts": recv[0], "pid": agent_pid(v), "tid": recv[1]})


def _pairs_of_call(present, key, k, kind, pairs, marked=False):
    """The (sender, receiver) pairs of the k-th call: the ranks each agent recorded
    sending to, where it did (neighbor operations; a broadcast's root; the agents of a
    machine-local allreduce), else the given pairs (an MPI collective records none).
    marked: the files record send marks (not an older version's): a broadcast without
    one had its root's file missing or cut, and gets no arrows."""
    if kind in COLLECTIVE_KINDS:
        sent = {u: _sent(recs, key, k) for u, recs in sorted(present.items())}
        if all(s is None for s in sent.values()):
            return [] if kind == "BROADCAST" and marked else pairs
        return [(u, v) for u, dsts in sent.items() for v in dsts or () if v in present]
    out = []
    for u, recs in sorted(present.items()):
        sent = _sent(recs, key, k)
        if sent is None:
            out.extend((a, b) for a, b in pairs if a == u)
        else:
            out.extend((u, v) for v in sent if v in present)
    return out


def _sent(recs, key, k):
    """The ranks an agent recorded sending to in the k-th call, or None."""
    dsts = recs.exchanges[key].dsts
    return dsts[k] if k < len(dsts) else None


def _end_point(recs, tids, key, k, peer, sending):
    """(ts, merged tid) of the send to peer or the receive from peer of occurrence k,
    inside its COMMUNICATE slice."""
    ex = recs.exchanges[key]
    if k >= len(ex.send):
        return None
    where = phase_of(ex, k, peer, sending)
    if where is None:
        return None
    begin, end = where
    ts = begin if sending else end
    if math.isnan(begin) or math.isnan(end):
        return None
    inside = min(_INSIDE_US, (end - begin) / 2.0)
    ts = ts + inside if sending else ts - inside
    return round(ts, 3), tids[(recs.pids[key[0]], ex.tid[k])]

"""Compact per-operation records of one agent: for the k-th call of each named
two-sided operation, when the agent called it and when its exchange ran.

Agents are matched by operation name and occurrence number: the k-th
``ENQUEUE_NEIGHBOR_ALLREDUCE`` of "x" on one agent is the same exchange as the
k-th on every other (operations of one name run one at a time on an agent).
Neighbor operations record the ranks each call sent to as an instant
"SEND_TO r1,r2" inside their MPI_ slice (files of older versions do not).
"""
import collections
from array import array

# Operations where data goes from agents to agents within one call; window
# operations are one-sided and have no matching receive.
COLLECTIVE_KINDS = ("ALLREDUCE", "BROADCAST", "ALLGATHER")
NEIGHBOR_KINDS = ("NEIGHBOR_ALLREDUCE", "NEIGHBOR_ALLGATHER", "HIERARCHICAL_NEIGHBOR_ALLREDUCE",
                  "PAIR_GOSSIP")
EXCHANGE_KINDS = frozenset(COLLECTIVE_KINDS + NEIGHBOR_KINDS)

NAN = float("nan")

SEND_TO = "SEND_TO "

Exchanges = collections.namedtuple("Exchanges", "send send_end recv_begin recv tid dsts phases")
Exchanges.__doc__ = """Arrays by occurrence: send = begin of the first COMMUNICATE of the
MPI_ slice (when this agent posted its data), recv = end of the last one (when
everything it waited for had arrived; NaN if it never completed), with the ends
of those slices and the row's tid, to place flow arrows inside them; dsts: the
ranks the call sent to (a tuple), or None where the file does not say; phases:
for a call of several COMMUNICATE slices (hierarchical_neighbor_allreduce: within
the machine, then between machines), (begin, end, ended, ranks it marked sending
to) of each, else None (see phase_of)."""


def phase_of(ex, k, peer, sending):
    """(begin, end) of the COMMUNICATE of call k where this agent sent to peer
    (sending) or received from it: the first slice whose send marks name peer for
    a send, the last for a receive (the exchange within a machine goes both ways;
    the later slices of a split fused group wait for the same ranks), else the
    first slice for a send and the last for a receive (between machines); None
    where that slice never ended. Calls of one COMMUNICATE: from send/send_end or
    recv_begin/recv."""
    phases = ex.phases[k] if k < len(ex.phases) else None
    if phases is None:
        return (ex.send[k], ex.send_end[k]) if sending else (ex.recv_begin[k], ex.recv[k])
    marked = [p for p in phases if peer in p[3]]
    begin, end, ended, _ = (marked[0] if sending else marked[-1]) if marked else phases[0 if sending else -1]
    return (begin, end) if ended or sending else None


class AgentExchanges:
    """Fed an agent's slices in the order they end (SliceReader); then ``finish``."""

    def __init__(self):
        self._arrivals = collections.defaultdict(lambda: array("d"))   # (pid, kind) -> ENQUEUE begins
        self._exchanges = {}                                            # (pid, kind) -> Exchanges
        self._communicate = collections.defaultdict(list)               # (pid, tid) -> pending slices
        self._enqueue_end = {}                                          # (pid, tid, name) -> last end
        self._sends = collections.defaultdict(list)                     # (pid, tid) -> [(ts, ranks)]
        self.arrivals = {}      # (op name, kind) -> array of ENQUEUE begins, by occurrence
        self.exchanges = {}     # (op name, kind) -> Exchanges
        self.pids = {}          # op name -> its pid in this agent's file

    def instant(self, pid, tid, ts, name):
        """SliceReader.on_instant: keep the SEND_TO marks until their MPI_ slice ends."""
        if name.startswith(SEND_TO):
            text = name[len(SEND_TO):]
            self._sends[(pid, tid)].append((ts, tuple(int(r) for r in text.split(",")) if text else ()))

    def add(self, s):
        name = s.name
        if name == "COMMUNICATE":
            self._communicate[(s.pid, s.tid)].append(s)
        elif name.startswith("ENQUEUE_"):
            kind = name[8:]
            if kind not in EXCHANGE_KINDS:
                return
            key = (s.pid, s.tid, name)
            # The writer splits a slice that must end inside a later one into two
            # adjacent slices; the second part is not a new call.
            continued = self._enqueue_end.get(key) == s.begin
            self._enqueue_end[key] = s.end
            if not continued:
                self._arrivals[(s.pid, kind)].append(s.begin)
        elif name.startswith("MPI_"):
            kind = name[4:]
            # this row's phases and marks so far belong to this span (kept only until it ends,
            # also for kinds without exchanges: window operations)
            pending = self._communicate.pop((s.pid, s.tid), ())
            sends = self._sends.pop((s.pid, s.tid), ())
            if kind not in EXCHANGE_KINDS:
                return
            inside = [c for c in pending if c.begin >= s.begin and c.end <= s.end]
            marked = [(ts, ranks) for ts, ranks in sends if s.begin <= ts <= s.end]   # ("SEND_TO ": nobody)
            marks = [r for _, ranks in marked for r in ranks]
            ex = self._exchanges.get((s.pid, kind))
            if ex is None:
                ex = self._exchanges[(s.pid, kind)] = Exchanges(*(array("d") for _ in range(4)), array("l"), [], [])
            ex.phases.append(_phases(inside, marked, s.finished) if len(inside) > 1 else None)
            if inside:
                first, final = inside[0], inside[-1]
                ex.send.append(first.begin)
                ex.send_end.append(first.end)
                ex.recv_begin.append(final.begin)
                # (an MPI_ slice that never ended: its last phase may be missing, so what
                # ended is not known to be the call's last receive)
                ex.recv.append(final.end if final.finished and s.finished else NAN)
            elif marked and not s.finished:
                # the agent was killed while it communicated: COMMUNICATE is written once
                # it ends (one "X" event), but its sends were marked: they leave from the mark
                ex.send.append(marked[0][0])
                ex.send_end.append(s.end)
                ex.recv_begin.append(NAN)
                ex.recv.append(NAN)
            else:
                for column in ex[:4]:
                    column.append(NAN)
            ex.tid.append(s.tid)
            ex.dsts.append(tuple(sorted(set(marks))) if marked else None)

    def finish(self, process_name):
        """Key the records by operation name (pids differ between agents). An MPI_ slice
        without its ENQUEUE_ is a call made before recording began (timeline_start
        while it was in flight; calls of a name run one at a time, so only the first
        can be one): whether it was recorded depends on timing, so it is left out, or
        the k-th call of this agent would be paired with another agent's (k+1)-th."""
        for (pid, kind), arr in self._arrivals.items():
            self.arrivals[(process_name(pid), kind)] = arr
        for (pid, kind), ex in self._exchanges.items():
            extra = len(ex.send) - len(self._arrivals.get((pid, kind), ()))
            if extra > 0:
                ex = Exchanges(*(column[extra:] for column in ex))
            self.exchanges[(process_name(pid), kind)] = ex
            self.pids[process_name(pid)] = pid
        self._arrivals = self._exchanges = self._communicate = self._enqueue_end = self._sends = None
        return self


def _phases(inside, marked, finished):
    """(begin, end, ended, ranks it marked sending to) of each COMMUNICATE slice of a
    call. A slice with no SEND_TO mark in it after one with marks is the wait of a
    fused group split by the stall inspector for its members still missing
    (_neighbor_tasks._one_by_one sends nothing): it waits for the ranks marked
    before it, and the call's receives end there, not at the end of the group's
    slice (the split)."""
    out, ranks = [], frozenset()
    for c in inside:
        here = [rs for ts, rs in marked if c.begin <= ts <= c.end]
        if here:
            ranks = frozenset(r for rs in here for r in rs)
        out.append((c.begin, c.end, c.finished and finished, ranks))
    return tuple(out)

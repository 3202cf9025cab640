"""The stall inspector: what an operation that waits too long is told.

Every INSPECT_EVERY_S the loop looks at its active operations. One that has waited
BLUEFOG_STALL_WARNING_S gets a warning naming the ranks it waits for; with
BLUEFOG_OP_TIMEOUT_S set, one that has waited that long fails with OpTimeout,
and the inputs it did not take are dropped (now, or when they come) so that
they do not feed the next operation of its name. Both messages add hints at the
cause: ranks that sent data of the name that the call does not take (senders
and receivers that disagree), and collectives other agents wait in that this
agent has not started. At shutdown, data that no operation took is reported
(report_untaken). A fused group that has waited SPLIT_AFTER_S with the inputs of
some members all in is split (split_group): those members complete, and the
rest one by one, since a neighbor may send the others only once one of them is
done (agents that order their calls differently).

StallInspector is part of the Engine (its state is the engine's: the active
operations, the inbox, the collective sequence).
"""
import contextlib
import sys
import time

from ._mpi import MPI
from ._waits import Partial, Recv, Requests, Sleep, Turn, Until


class OpTimeout(TimeoutError):
    """An operation waited longer than BLUEFOG_OP_TIMEOUT_S."""


def _receivers_pending(op):
    """The ranks that have not taken the large sends of a finished op (Engine._advance
    keeps only its pending ones; each is (request, (tensor, destination)))."""
    return sorted({dst for _, (_, dst) in op.data_requests})


INSPECT_EVERY_S = 0.1    # (the inspection piggybacks on the loop's passes: it wakes nobody)
SPLIT_AFTER_S = 0.1      # a fused group that waits this long with some members' inputs in is split


def _fused_with(op):
    """' (fused with 'b', 'c')' for the lead of a fused group (messages name every
    member not yet completed)."""
    names = [r.name for r in op.riders if not r.completed and r.name != op.name]
    if not names:
        return ""
    shown = ", ".join(map(repr, names[:4])) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f" (fused with {shown})"


def _negotiation(key, entry):
    """(kind, name) of a collective's negotiation message, under key ("C", seq), whose
    value is (kind, name, payload) (see _tasks.exchange_headers); None for other keys."""
    if key.__class__ is tuple and key[0] == "C" and key[1].__class__ is int:
        v = entry.value
        if v.__class__ is tuple and len(v) == 3:
            return v[0], v[1]
    return None


def mpi_collectives_end(what, why):
    """Engine.collectives_broken's text: what happened, why a later MPI collective
    would mix data."""
    return (f"{what} ({why}); allreduce, broadcast, allgather, win_create and win_free cannot run on this "
            "agent any more in this run (neighbor operations, barrier and window puts, gets and updates still "
            "can)")


def _skip_word(key):
    """True for the key ("S", seq) of another agent's word that its collective seq failed
    before its MPI call (_tasks.skipped_collective): left unread where that call was
    made, which the stall warning or timeout of that call already shows; and for
    ("W", seq), its word that it timed out in collective seq (StallInspector.withdraw),
    unread where this agent never reached it (the timeout showed it there)."""
    return key.__class__ is tuple and key[0] in ("S", "W") and key[1].__class__ is int


def _data_name(key):
    """The operation name of a data key: the name itself, or a (name, part) pair's
    (the hierarchical and machine-local operations' keys); None for the collectives'
    and other words, (kind letter, int) pairs."""
    if key.__class__ is str:
        return key
    if key.__class__ is tuple and len(key) == 2 and key[0].__class__ is str and key[1].__class__ is str:
        return key[0]
    return None


def _other_kinds(inbox, keys):
    """[(src, key)] of the inbox's data under the names of keys (data keys a wait
    takes) in the other form: a (name, part) pair where keys are plain names, or
    the reverse (a neighbor operation against a hierarchical or machine-local one)."""
    names = {}
    for key in keys:
        name = _data_name(key)
        if name is not None:
            names.setdefault(name, set()).add(key.__class__)
    return [(src, key) for (src, key), q in list(inbox.items())
            if q and key not in keys and key.__class__ not in names.get(_data_name(key), (key.__class__,))]


def _name_of(key, entry):
    """The operation name of an inbox key: the name, a (name, part) pair's name, or
    the name a collective's negotiation carries."""
    if key.__class__ is str:
        return key
    call = _negotiation(key, entry)
    return key[0] if call is None else call[1]


class StallInspector:
    """The Engine's stall inspection and the clean-up after a timeout."""

    _blocked = None             # (op, what, since) while the loop is inside a blocking MPI call
    _blocked_warned = None

    @contextlib.contextmanager
    def blocking_call(self, op, what):
        """The loop is inside a blocking MPI collective (a window's allocation or free,
        which MPI has in no nonblocking form) for op: the inspection, which runs on
        the loop, cannot run meanwhile, so callers waiting in synchronize() warn and
        time out for it (blocked_check). An agent that never makes the call (it failed
        just before it) leaves the others there."""
        self._blocked = (op, what, time.monotonic())
        try:
            yield
        finally:
            self._blocked = None

    def blocked_check(self, waiting, timeout=True):
        """Called by a caller that waits for op waiting, now and then: the warning
        and (timeout) the timeout of the loop's blocking call, if it is in one too long."""
        blocked = self._blocked
        if blocked is None:
            return
        op, what, since = blocked
        waited = time.monotonic() - since
        if waited > self.stall_warning_s and self._blocked_warned is not blocked:
            self._blocked_warned = blocked
            sys.stderr.write(f"bluefog_lite WARNING (rank {self.rank}): {op.kind} {op.name!r} has waited "
                             f"{waited:.1f} s inside {what} (the other agents have not all made it: one that failed "
                             "before it, or has not called it, leaves this agent there; nothing else of this "
                             "agent's communication runs meanwhile)\n")
            sys.stderr.flush()
        if timeout and self.op_timeout_s > 0 and waited > self.op_timeout_s and not op.at_shutdown:
            whose = "" if op is waiting else f", for {op.kind} {op.name!r}"
            raise OpTimeout(f"{waiting.kind} {waiting.name!r} timed out on rank {self.rank} "
                            f"(BLUEFOG_OP_TIMEOUT_S={self.op_timeout_s:g}): the communication thread has waited "
                            f"{waited:.1f} s inside {what}{whose} (an agent that failed before it, or has not "
                            "called it, leaves this agent there for good)")

    def waiting_for_data(self):
        """[(op, its wait, ranks it waits for, waiting since)] for the active ops that
        wait to receive (the ranks whose data they lack) or for their large sends to
        be taken (the receivers that have not: a send to an agent that has left never
        completes). Safe to call from another thread: a snapshot that races with the
        loop changing its state comes back empty (ask again later)."""
        found = []
        try:
            for op in list(self._active):
                wait = op.wait
                if op.finished_task:
                    missing = _receivers_pending(op)
                elif isinstance(wait, Recv):
                    missing = self._lacking(wait)
                else:
                    continue
                if missing:
                    found.append((op, wait, missing, op.waiting_since))
        except (RuntimeError, KeyError, IndexError, AttributeError):
            return []
        return found

    def peers_wait_elsewhere(self):
        """Whether an agent that an active operation of this agent waits for is itself
        waiting in an operation this agent has not started: a collective whose
        negotiation it sent, or data it sent under a name no active operation here
        takes (shutdown stops waiting for this agent's own operations then: they
        would wait for good). Safe from another thread: False when the snapshot races
        with the loop."""
        try:
            awaited, wanted = set(), set()
            for op in list(self._active):
                if op.wait.__class__ is Recv:
                    wanted.update(op.wait.keys)
                    awaited.update(self._lacking(op.wait))
            if not awaited:
                return False
            elsewhere = {r for ranks in self._unjoined_collectives().values() for r in ranks}
            for (src, key), q in list(self.stream.inbox.items()):
                if q and (src, key) not in wanted and _negotiation(key, q[0]) is None:
                    elsewhere.add(src)
            return bool(awaited & elsewhere)
        except (RuntimeError, KeyError, IndexError, AttributeError):
            return False

    def split_group(self, op):
        """A fused group (op runs its task) waiting with the inputs of some members all
        in and others' not: a neighbor may wait for this agent to finish one of the
        first before it sends the rest (agents that issue calls in different orders),
        which would deadlock if the group went on waiting as one. Hand the task to
        a runner op that nobody synchronizes, whose riders are all the members,
        resume it with those members' entries (Partial): it completes them and waits
        for the rest one member at a time (_neighbor_tasks._one_by_one). False if no
        member is complete."""
        keys = op.wait.keys
        by_name = {}
        for key in keys:
            by_name.setdefault(key[1], []).append(key)
        has = self.stream.has
        ready = [k for ks in by_name.values() if all(has(*key) for key in ks) for k in ks]
        if not ready:
            return False
        if op.completed:     # already the runner of a split group
            runner = op
        else:
            runner = self._new_op(op.name, op.kind)
            runner.completed, runner.reserved = True, False
            runner.task, runner.wait, runner.riders = op.task, op.wait, (op, *op.riders)
            # the group's sends (a large one of its buffer is tracked until the receiver
            # has taken it): the runner finishes once they are done
            runner.data_requests, op.data_requests = op.data_requests, []
            op.task, op.wait, op.riders = None, None, ()
            self._active.discard(op)
            self._active.add(runner)
        for key in keys:
            if self._waiters.get(key) in (op, runner):
                del self._waiters[key]
        since, warned = op.waiting_since, op.warned
        runner.wait = None
        self._step(runner, Partial(dict(zip(ready, self._take_all(ready)))))
        if runner.wait.__class__ is Recv:   # the rest have waited since the group did
            runner.waiting_since, runner.warned = since, warned
        left = [m.name for m in runner.riders if not m.completed]
        if left:
            runner.name = left[0]      # (what the inspector's messages name, with _fused_with)
        return True

    def _lacking(self, wait):
        """The ranks whose entry a Recv wait still lacks."""
        return sorted({src for src, key in wait.keys if not self.stream.has(src, key)})

    def _strays(self, wait):
        """The ranks that sent this agent entries under the keys a Recv wait takes,
        but not the ones it takes from them: unclaimed, they hint at senders and
        receivers that disagree (or at a sender already on its next call); and
        those that sent data of the same operation name under other keys (another
        kind of operation: the hierarchical one and the machine-local allreduce
        send under (name, part) keys, the other neighbor operations under the name)."""
        keys, expected = {key for _, key in wait.keys}, set(wait.keys)
        same = {src for (src, key), q in self.stream.inbox.items()
                if q and key in keys and (src, key) not in expected}
        return sorted(same), sorted({src for src, _ in self._other_kinds_data(wait)})

    def _other_kinds_data(self, wait):
        """[(src, key)] of the inbox's data of the wait's names under keys of the other
        form (another kind of operation, see _other_kinds), but from the ranks whose
        entries of this wait have all arrived: theirs is their next call's (a name
        used by one kind after another), not a mismatch."""
        lacking = self._lacking(wait)
        delivered = {src for src, _ in wait.keys} - set(lacking)
        return [(src, key) for src, key in _other_kinds(self.stream.inbox, {key for _, key in wait.keys})
                if src not in delivered]

    def _forget_other_kinds(self, wait):
        """At a timeout: the data _other_kinds_data finds is dropped: it belongs to a
        call that did not pair with this one, and would feed this agent's next call of
        that kind (a wrong result without an error; dropped, data of a correct
        program's next call of another kind makes that call stall instead)."""
        for src, key in self._other_kinds_data(wait):
            while self.stream.has(src, key):
                self.stream.take(src, key).release()

    def _unjoined_collectives(self):
        """{(kind, name): ranks} of the collectives that other agents have started
        (their negotiation is in this agent's inbox) and this agent has not."""
        found = {}
        for (src, key), q in self.stream.inbox.items():
            call = _negotiation(key, q[0]) if q else None
            if call is not None and key[1] >= self._coll_seq:
                found.setdefault(call, set()).add(src)
        return found

    def _stray_hint(self, op):
        """For an op waiting for inputs: who sent inputs of its name that it does not
        take, and which collectives others wait in that this agent has not started
        (for its warning or timeout), or ''."""
        hint = ""
        strays, other = self._strays(op.wait) if isinstance(op.wait, Recv) else ([], [])
        if strays:
            hint = (f"; ranks {strays} sent this agent data of that name which it does not take (their "
                    "next call's, or sends that do not match this call's sources: check that the senders' "
                    "dst_weights or pair_gossip target_rank agree with this agent's src_weights or "
                    "target_rank)")
        if other:
            hint += (f"; ranks {other} sent this agent data of that name for another kind of operation "
                     "(hierarchical_neighbor_allreduce, or allreduce(is_hierarchical_local=True), against a "
                     "neighbor operation, or the reverse): every agent must call the same operation under one "
                     "name (a timeout drops that data)")
        for (kind, name), ranks in sorted(self._unjoined_collectives().items()):
            check = (" (a topology check: enable_topo_check=True with dst_weights; every agent must call "
                     "the operation in the same mode)" if kind.startswith("NEIGHBOR") else "")
            hint += (f"; ranks {sorted(ranks)} wait in the collective {kind} {name!r}{check}, which this "
                     "agent has not started")
        return hint

    def _waiting_for(self, op):
        """What op waits for, as it reads after "waited 60.0 s " or "waiting "."""
        w = op.wait
        if op.finished_task:
            return f"for the completion of its own sends (ranks {_receivers_pending(op)} have not taken them)"
        if isinstance(w, Recv):
            return f"for ranks {self._lacking(w)}"
        if isinstance(w, Turn):
            return "for an earlier collective operation of this agent, which must start first"
        if isinstance(w, Requests):
            return f"inside {w.what} (MPI does not say for which ranks)"
        if isinstance(w, (Sleep, Until)):
            return f"for {w.what}"
        return "for the completion of its own sends"

    def _inspect_stalls(self, now):
        for op in list(self._active):
            waited = now - op.waiting_since
            if op.riders and waited > SPLIT_AFTER_S and op.wait.__class__ is Recv and self.split_group(op):
                continue
            if not op.warned and waited > self.stall_warning_s:
                op.warned = True
                what = self._waiting_for(op)
                if not op.finished_task:
                    joined = " that have not joined it" if isinstance(op.wait, Recv) else ""
                    what += joined + self._stray_hint(op)
                sys.stderr.write(
                    f"bluefog_lite WARNING (rank {self.rank}): {op.kind} {op.name!r}{_fused_with(op)} has "
                    f"waited {waited:.1f} s {what}\n")
                sys.stderr.flush()
            if self.op_timeout_s > 0 and waited > self.op_timeout_s and not op.at_shutdown:
                op.error = OpTimeout(
                    f"{op.kind} {op.name!r}{_fused_with(op)} timed out after {waited:.1f} s "
                    f"(BLUEFOG_OP_TIMEOUT_S={self.op_timeout_s:g}) on rank {self.rank}, "
                    f"waiting {self._waiting_for(op)}{'' if op.finished_task else self._stray_hint(op)}")
                if self._negotiating(op):
                    self.withdraw(op)
                if op.collective:
                    # The late agents may still make this collective's MPI call, which
                    # would pair with this agent's next one and mix their data
                    self.collectives_broken = mpi_collectives_end(
                        f"the collective {op.kind} {op.name!r} timed out on this agent (rank {self.rank}), "
                        "so its collectives are out of step with the other agents'",
                        "a late agent may still make that call's MPI collective, which would pair with this "
                        "agent's next one and mix their data")
                if op.finished_task:
                    # only its sends are left: _finish keeps them going (keep_sending). A
                    # fused group's members sent in the same message: they fail with it
                    # (they returned their results while the lead raised)
                    for rider in op.riders:
                        if not rider.completed:
                            rider.error = op.error
                elif isinstance(op.wait, Requests):
                    # A posted MPI call still reads and writes its buffers (an in-place
                    # target included) until it completes: the task, whose frame holds
                    # them, is kept until then (Engine.keep_sending), and closed by the
                    # loop once they are done (its cleanup: window tickets, mutexes)
                    self.keep_sending([(_KeptTask(op.wait.reqs, op.task), None)])
                else:
                    op.task.close()
                if isinstance(op.wait, Recv) and not op.finished_task:    # (a finished op's wait is stale)
                    self._forget_other_kinds(op.wait)     # (first: it reads which inputs are in)
                    self.forget_inputs(op.wait.keys)
                self._finish(op)

    @staticmethod
    def _negotiating(op):
        """op waits for the other agents' headers of its collective (exchange_headers)."""
        w = op.wait
        return (w.__class__ is Recv and not op.finished_task and bool(w.keys)
                and all(k[1].__class__ is tuple and k[1][0] == "C" for k in w.keys))

    def withdraw(self, op):
        """op timed out in its collective's negotiation: some agent has not called it
        (or is late). Every other agent is told (a word ("W", seq)): one that reaches
        its collective #seq later has it refused (_tasks._refuse_withdrawn) instead
        of pairing with this agent's header of the call it gave up. So every agent
        uses up #seq and their later collectives stay in step (else one that never
        calls this one would pair each of its collectives with this agent's previous
        one: silently where kind and name match, a barrier, set_topology)."""
        self.send_to_others(("W", op.wait.keys[0][1][1]), (op.kind, op.name))

    def forget_inputs(self, keys):
        """A timed-out (or failed) op's inputs must not feed the next op of the same
        name: drop the entries that arrived, and the ones still to come when they come."""
        for key in keys:
            entry = self.stream.take(*key)
            if entry is not None:
                entry.release()
            else:
                self._discard[key] += 1

    def report_untaken(self, status):
        """At shutdown, once the loop has stopped: warn about data still in the inbox,
        which no operation of this agent took (after a last look for packets that
        have come). Its senders and this agent disagreed about who receives what;
        a later operation of the same name would have taken it as its own. Best
        effort: data still on its way is not seen."""
        s = self.stream
        s.receive(status)
        arrived, s.arrived = s.arrived, []
        for key in arrived:
            if key in self._discard:
                self._drop_stale(key)      # a timed-out operation's late input
        untaken = {}
        for (src, key), q in s.inbox.items():
            if q and not _skip_word(key):
                label = (src, _name_of(key, q[0]))
                untaken[label] = untaken.get(label, 0) + len(q)
        if not untaken:
            return
        listing = ", ".join(f"{n} from rank {src} under {name!r}" for (src, name), n in sorted(
            untaken.items(), key=repr)[:8]) + (" ..." if len(untaken) > 8 else "")
        sys.stderr.write(
            f"bluefog_lite WARNING (rank {self.rank}): at shutdown, data sent to this agent that no "
            f"operation took: {listing}. Either this agent never made that call (it stopped early, or "
            "failed or timed out elsewhere), or its senders and this agent disagreed about who receives "
            "what (dynamic dst_weights that do not match the receivers' src_weights with enable_topo_check="
            "False, pair_gossip targets that do not pair up, a call in static mode on some agents and "
            "dynamic on others); a later operation of the same name would have taken it as its own\n")
        sys.stderr.flush()

    def _drop_stale(self, key):
        """Drop the inputs of timed-out ops at the head of key's queue, those that are
        in (they come before any later op's: a sender's entries of a name are in order)."""
        while key in self._discard:
            entry = self.stream.take(*key)
            if entry is None:
                return
            entry.release()
            self._discard[key] -= 1
            if self._discard[key] <= 0:
                del self._discard[key]


class _KeptTask:
    """A timed-out task whose posted MPI requests are still running, kept in the
    stream's failed sends (tested by the loop, which drops what passes): closed, on
    the loop's thread, once every request is done."""
    __slots__ = ("reqs", "task")

    def __init__(self, reqs, task):
        self.reqs, self.task = reqs, task

    def Test(self):
        if not MPI.Request.Testall(self.reqs):
            return False
        if self.task is not None:
            task, self.task = self.task, None
            task.close()
        return True

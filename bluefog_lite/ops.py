"""Collective and neighbor operations: validate (_arguments.py), name, enqueue.

Every operation has a ``*_nonblocking`` form that returns a handle; the blocking
form is ``synchronize(<nonblocking form>)``. The MPI part runs on the
communication thread (_engine.py; the tasks of _collective_tasks.py and
_neighbor_tasks.py), or, for a blocking call while the thread sleeps and the
timeline is off, on the caller (Engine._drive_until).
"""
import collections
import itertools
import os
import threading

import numpy as np
import torch

from . import _collective_tasks, _devices, _neighbor_tasks, _quick, _tasks
from ._arguments import (_fits_scaled, _flag, _numeric, _ordered_ranks, _peers, _plan, _rank, _rank_list,
                         _ranks_named, _reducible, _tensor, _weight, _writable)
from ._fusion import Fusable
from ._runtime import plan_key, state
from .timeline._writer import GENERATED_NAME
from ._waits import Requests

_name_counters = collections.defaultdict(itertools.count)   # kind -> the numbers of its unnamed calls
_caller = threading.local()     # .blocking: the op being enqueued is synchronized at once


# Names the library's own collectives run under (their messages are keyed by them,
# like every named operation's): a user operation of the same name in flight would
# make the call fail as "already in flight", or be matched with it.
RESERVED_NAMES = {
    "barrier": "barrier()", "set_topology": "set_topology()", "set_machine_topology": "set_machine_topology()",
    "win_create": "win_create()", "win_free": "win_free()",
    "broadcast_parameters.check": "broadcast_parameters()", "allreduce_parameters.check": "allreduce_parameters()",
    "broadcast.optimizer_state": "broadcast_optimizer_state()",
}


def _op_name(name, kind):
    if name is None:     # (next() of a count is atomic: callers on several threads get distinct numbers)
        return f"{kind.lower()}.noname.{next(_name_counters[kind])}"
    return check_name(name)


def check_name(name, what="name", fix="choose another name"):
    """name as a plain str, if a user may give it to an operation (else
    TypeError/ValueError). A str subclass (numpy.str_) becomes a str: the timeline
    and the stall inspector tell one name from a sequence of them by its class."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"{what} must be a non-empty string, got {name!r}")
    if name in RESERVED_NAMES:
        raise ValueError(f"{what} {name!r} is reserved: bluefog_lite's {RESERVED_NAMES[name]} runs under it; {fix}")
    if ".noname." in name and GENERATED_NAME.fullmatch(name):
        raise ValueError(f"{what} {name!r} has the form '<operation>.noname.<n>', reserved for the names "
                         f"given to calls without one; {fix}")
    return str.__str__(name)


def _submit(kind, name, make_task, fuse=None, deliver=None):
    """Enqueue under name, which the op resolved with _op_name before validating its
    arguments: a generated name is used up even by a call that then fails, so that
    generated names stay the same on every agent when an error on some agents is
    caught and the program goes on. deliver: see _devices.delivery. The copy of a
    device input to the host (_input) is waited for here by a blocking call, by the
    operation's task otherwise."""
    blocking = getattr(_caller, "blocking", False)
    if blocking:
        _devices.finish_copy(name)
        copy = None
    else:
        copy = _devices.take_copy()
    return state().engine.submit(name, kind, make_task, fuse, blocking, deliver=deliver, ready=copy)


def _input(tensor, name):
    """The host tensor operation name sends (_arguments._tensor); for a device
    tensor, its copy is only queued (see _devices.py): _submit hands it over."""
    return _tensor(tensor, name, later=True)


def _target(tensor, x):
    """The tensor an in-place form's task writes its result into: tensor itself, or
    for a tensor on an accelerator its host copy x (delivered to it at synchronize)."""
    return x if _devices.on_device(tensor) else tensor.detach()


def _written(tensor, handle):
    """handle, once an in-place form's call is accepted: its write counted in tensor's
    version (on the caller's thread), as torch's in-place operations do: MPI writes its
    memory unseen, and a graph that saved the old values would back-propagate with the
    new ones instead of refusing. (An inference tensor has no version.)"""
    if not tensor.is_inference():
        torch.autograd.graph.increment_version(tensor)
    return handle


def _in_place(tensor, name):
    """deliver (see _submit) of an in-place form: synchronize returns tensor itself, as
    Bluefog does (a Parameter stays one, with its requires_grad), not the detached
    alias the task writes into; a device tensor first gets its result."""
    deliver = _devices.delivery(tensor, True, name)
    return (lambda _: tensor) if deliver is None else deliver


def _blocking(nonblocking, *args, **kwargs):
    """The blocking form of an operation: synchronize(nonblocking(...)), enqueued
    without waking the communication thread, so that this thread may run it."""
    _caller.blocking = True
    try:
        handle = nonblocking(*args, **kwargs)
    finally:
        _caller.blocking = False
    return state().engine.synchronize_owned(handle)


# ---- handles ---------------------------------------------------------------------

def poll(handle):
    """True when the operation behind handle has finished (result ready). False
    also gives the CPU and the interpreter away for a moment (os.sched_yield), so
    that a `while not poll(h)` loop lets the communication thread run: it waited
    for the switch interval (5 ms) at each step; 300 calls at 4 agents took 6.8 s
    instead of 0.33 s."""
    if state().engine.poll(handle):
        return True
    os.sched_yield()
    return False


def synchronize(handle):
    """Wait for the operation, free the handle, return its result (or raise its error)."""
    return state().engine.synchronize(handle)


wait = synchronize


def _finish_all(items, finish):
    """finish(item) for every item (synchronizing its handle), even after one raised, so
    that no operation is left in flight with its name in use; then the first error."""
    error = None
    for item in items:
        try:
            finish(item)
        except Exception as exc:
            error = error or exc
    if error is not None:
        raise error


# ---- collectives -------------------------------------------------------------------

def _collective(kind, name, prepare, tensor=None, in_place=False):
    """Submit the collective whose task prepare() checks the arguments for and makes.
    With bad input (prepare raises TypeError or ValueError, or anything else: a user's
    state_dict hook, a failed copy to the host, a tensor that cannot be read) this
    agent still takes part in the collective's negotiation, so that the other agents
    raise an error naming it instead of waiting for it; it raises its own error (at
    synchronize, as the others do). tensor: the input, whose result synchronize
    returns (see _devices.delivery); in_place: the result is written into it (its
    write counted once the call is accepted)."""
    state()
    try:
        make_task = prepare()
        deliver = None if tensor is None else (_in_place(tensor, name) if in_place else
                                               _devices.delivery(tensor, False, name))
    except Exception as exc:
        error = exc     # (exc itself is unbound when the except clause ends)
        return _submit(kind, name, lambda e, op: _tasks.bad_input(e, op, error))
    handle = _submit(kind, name, make_task, deliver=deliver)
    return _written(tensor, handle) if in_place else handle


def _untainted(st, name):
    """Raise (inside an operation's argument checks) if name is refused on this agent
    (see _refuse): every later call of it would take queued data as its own."""
    why = st.engine.tainted.get(name)
    if why is not None:
        raise ValueError(f"{why}: use another name")


class _Refused(Exception):
    """neighbor_allreduce's arguments were rejected on this agent: handle is the op
    that tells the agents waiting for it (see _refuse)."""

    def __init__(self, handle):
        super().__init__(handle)
        self.handle = handle


def _refuse(kind, name, exc, tell=(), forget=(), negotiate=False, peers_known=True):
    """The handle of the op of an agent whose arguments to a neighbor operation were
    rejected with exc (bad input, or anything else its checks raised: a tensor
    subclass's or a device's error while reading it). The op raises exc, but first the
    agents that would wait for this agent learn why and raise too: each (rank, key) of
    tell gets a note instead of the data; the inputs this agent would have received,
    forget, are dropped when they come (they must not feed its next call of the name).
    negotiate: the operation starts with a collective topology check, which this
    agent joins with its error (then nobody sends data). peers_known=False (its source
    or destination weights or ranks could not be read): what its senders send for this
    call cannot be told apart from their next call's (they may have sent data, a note,
    or, refused the same way, nothing at all, while it drops one arrival), so the name
    is refused from then on on this agent (_untainted) rather than give a later call
    another call's input."""
    if negotiate:
        return _submit(kind, name, lambda e, op: _tasks.bad_input(e, op, exc))
    if not peers_known:
        state().engine.tainted.setdefault(name, (
            f"an earlier {kind} {name!r} of this agent was refused ({type(exc).__name__}) before it could tell "
            "which agents it receives from and sends to, so its calls of this name no longer pair up with its "
            "neighbors' (this one could take another call's data)"))
    return _submit(kind, name, lambda e, op: _tasks.refused(e, op, exc, list(tell), list(forget)))


def refusal_without_peers(self_weight, src_weights, dst_weights, enable_topo_check, hierarchical=False):
    """The error neighbor_allreduce (hierarchical: hierarchical_neighbor_allreduce,
    with machine weights) would raise for these weights while unable to read which
    agents it receives from or sends to, which refuses its name on this agent from
    then on (_refuse), or None. The optimizer wrappers check a step's weights with it
    before starting anything (their names are the parameters': a step set up wrongly
    on every agent then fails without sending, and the next step can use them)."""
    if dst_weights is None or enable_topo_check:    # (static, or negotiated: the peers are known)
        return None
    st = state()
    if hierarchical:
        topo, size, me, kind, unit = (st.machine_topology, st.machine_size, st.machine_rank,
                                      "hierarchical_neighbor_allreduce", "machine")
    else:
        topo, size, me, kind, unit = st.topology, st.size, st.rank, "neighbor_allreduce", "agent"
    if _peers(topo, False, src_weights, dst_weights, size, me)[2]:
        return None
    try:
        _plan(self_weight, src_weights, dst_weights, topo, size, me, kind, unit)
    except Exception as exc:
        return exc
    return ValueError(f"{kind}: the ranks of the weights {src_weights!r} and {dst_weights!r} cannot be read")


def _local_allreduce(name, tensor, average, in_place):
    """allreduce(is_hierarchical_local=True): not a global collective, only this
    machine's agents wait. With bad input they are told (see _refuse). in_place: the
    result is written into tensor (allreduce_), which must be writable."""
    st = state()
    try:
        average = _flag(average, "average")
        x = _reducible(_input(tensor, name), "ALLREDUCE")
        if in_place:
            _writable(tensor, "allreduce_")
    except Exception as exc:
        peers = [(r, (name, "local")) for r in st.local_ranks if r != st.rank]
        return _refuse("ALLREDUCE", name, exc, peers, peers)
    if not in_place or _devices.on_device(tensor):     # (a device tensor's own copy is x: written at synchronize)
        deliver = _in_place(tensor, name) if in_place else _devices.delivery(tensor, False, name)
        h = _submit("ALLREDUCE", name, lambda e, op: _neighbor_tasks.local_allreduce(
            e, op, x, st.local_ranks, average), deliver=deliver)
        return _written(tensor, h) if in_place else h
    target = tensor.detach()

    def task(e, op):
        out = yield from _neighbor_tasks.local_allreduce(e, op, x, st.local_ranks, average)
        # x may be target's memory, which the sends to the peers still read: a small
        # x sits in packets queued by reference until this pass ends (Engine._flush;
        # the peers' inputs may have been in at once), a large one goes straight from
        # its memory until MPI has taken it. Send the packets now, wait for the large
        # sends, then write.
        e.stream.flush_all()
        if op.data_requests:
            yield Requests([r for r, _ in op.data_requests], "the sends of the input it overwrites")
        target.copy_(out)
    return _written(tensor, _submit("ALLREDUCE", name, task, deliver=_in_place(tensor, name)))


def _local_flag(is_hierarchical_local):
    """(is_hierarchical_local checked, None) or, if it is bad, (False, its error): the
    call then takes part in the global allreduce's negotiation with bad input (the
    default form), so that the other agents raise too instead of waiting for it."""
    try:
        return _flag(is_hierarchical_local, "is_hierarchical_local"), None
    except Exception as exc:    # (not True or False; or an object that raises when read)
        return False, exc


def _checked_or(enable_topo_check, default):
    """enable_topo_check as a bool, or default if it is not True or False: a call refused
    for it joins (or not) the topology check as its peers' default form does (taken by
    its truth value, a 1 given where the default is False joined a check that no peer
    made, and every agent waited)."""
    try:
        return _flag(enable_topo_check, "enable_topo_check")
    except Exception:
        return default


def allreduce_nonblocking(tensor, average=True, is_hierarchical_local=False, name=None):
    name = _op_name(name, "ALLREDUCE")
    local, bad_flag = _local_flag(is_hierarchical_local)
    if local:
        return _local_allreduce(name, tensor, average, False)

    def prepare():
        if bad_flag is not None:
            raise bad_flag
        avg = _flag(average, "average")
        x = _reducible(_input(tensor, name), "ALLREDUCE")
        return lambda e, op: _collective_tasks.allreduce(e, op, x, avg, None)
    return _collective("ALLREDUCE", name, prepare, tensor)


def allreduce(tensor, average=True, is_hierarchical_local=False, name=None):
    return _blocking(allreduce_nonblocking, tensor, average, is_hierarchical_local, name)


def allreduce_nonblocking_(tensor, average=True, is_hierarchical_local=False, name=None):
    """In place: the result is written into tensor."""
    name = _op_name(name, "ALLREDUCE")
    local, bad_flag = _local_flag(is_hierarchical_local)
    if local:
        return _local_allreduce(name, tensor, average, True)

    def prepare():
        if bad_flag is not None:
            raise bad_flag
        avg = _flag(average, "average")
        x = _reducible(_input(tensor, name), "ALLREDUCE")
        _writable(tensor, "allreduce_")
        return lambda e, op: _collective_tasks.allreduce(e, op, x, avg, _target(tensor, x))
    return _collective("ALLREDUCE", name, prepare, tensor, in_place=True)


def allreduce_(tensor, average=True, is_hierarchical_local=False, name=None):
    return _blocking(allreduce_nonblocking_, tensor, average, is_hierarchical_local, name)


def broadcast_nonblocking(tensor, root_rank, name=None):
    name = _op_name(name, "BROADCAST")

    def prepare():
        x = _input(tensor, name)
        root = _rank(root_rank, "root_rank", state().size)
        return lambda e, op: _collective_tasks.broadcast(e, op, x, root, None)
    return _collective("BROADCAST", name, prepare, tensor)


def broadcast(tensor, root_rank, name=None):
    return _blocking(broadcast_nonblocking, tensor, root_rank, name)


def broadcast_nonblocking_(tensor, root_rank, name=None):
    name = _op_name(name, "BROADCAST")

    def prepare():
        x = _input(tensor, name)
        _writable(tensor, "broadcast_")
        root = _rank(root_rank, "root_rank", state().size)
        return lambda e, op: _collective_tasks.broadcast(e, op, x, root, _target(tensor, x))
    return _collective("BROADCAST", name, prepare, tensor, in_place=True)


def broadcast_(tensor, root_rank, name=None):
    return _blocking(broadcast_nonblocking_, tensor, root_rank, name)


def allgather_nonblocking(tensor, name=None):
    name = _op_name(name, "ALLGATHER")

    def prepare():
        x = _input(tensor, name)
        if x.dim() == 0:
            raise ValueError("allgather needs a tensor with at least one dimension (it concatenates on dim 0)")
        return lambda e, op: _collective_tasks.allgather(e, op, x)
    return _collective("ALLGATHER", name, prepare, tensor)


def allgather(tensor, name=None):
    return _blocking(allgather_nonblocking, tensor, name)


def _negotiate(name, validated):
    """validated() -> (value, obj): this agent's value, and every agent's obj (in rank
    order) exchanged under name (collective). If validated() raises, this agent still
    joins the exchange (see _collective), so that every agent raises instead of the
    others waiting for it. name: one of RESERVED_NAMES,
    or None for a generated one."""
    if name is None:
        name = _op_name(None, "ALLGATHER")
    found = []

    def prepare():
        value, obj = validated()
        found.append(value)
        return lambda e, op: _tasks.allgather_object(e, op, obj)
    views = _blocking(_collective, "ALLGATHER", name, prepare)
    return found[0], views


def _allgather_object(obj, name=None):
    """Every agent's obj, in rank order (collective; used for negotiation)."""
    return _negotiate(name, lambda: (None, obj))[1]


def barrier():
    """Block until every agent has reached the barrier (one timeline row, "barrier")."""
    _allgather_object(None, name="barrier")


# ---- neighbor operations -----------------------------------------------------------

def neighbor_allreduce_nonblocking(tensor, *, self_weight=None, src_weights=None, dst_weights=None,
                                   enable_topo_check=True, name=None):
    """Weighted average with neighbors: self_weight*x + sum_j src_weights[j]*x_j.

    Without weights: the static topology (graph weights if it is weighted,
    else uniform 1/(in-degree+1)). dst_weights (list or {rank: weight}) selects
    dynamic mode: send to those ranks (scaled by the weight), receive from the
    keys of src_weights."""
    try:
        call = _neighbor_allreduce_call(tensor, self_weight, src_weights, dst_weights, enable_topo_check, name)
    except _Refused as refused:
        return refused.handle
    return _submit_neighbor_allreduce(*call)


def neighbor_allreduce(tensor, *, self_weight=None, src_weights=None, dst_weights=None,
                       enable_topo_check=True, name=None):
    try:
        call = _neighbor_allreduce_call(tensor, self_weight, src_weights, dst_weights, enable_topo_check, name)
    except _Refused as refused:
        return synchronize(refused.handle)      # raises this agent's error
    name, x, st, sw, srcw, plan, recv_from, check, deliver = call
    if not check:     # a small tensor while the engine idles: see _quick.py
        _devices.finish_copy(name)
        result = _quick.neighbor_allreduce(st.engine, name, x, sw, srcw, plan, recv_from)
        if result is not None:
            return result if deliver is None else deliver(result)
    return _blocking(_submit_neighbor_allreduce, *call)


def _neighbor_allreduce_call(tensor, self_weight, src_weights, dst_weights, enable_topo_check, name):
    """The validated arguments: (name, tensor, state, self_weight, src_weights,
    send_plan, recv_from, check, deliver)."""
    name = _op_name(name, "NEIGHBOR_ALLREDUCE")
    st = state()
    try:
        _untainted(st, name)
        _flag(enable_topo_check, "enable_topo_check")
        x = _numeric(_input(tensor, name), "neighbor_allreduce")
        sw, srcw, plan, recv_from, dynamic = _plan(self_weight, src_weights, dst_weights, st.topology,
                                                   st.size, st.rank, "neighbor_allreduce")
        if not x.is_floating_point():     # (only integers can wrap around: one test on the hot path)
            # a device tensor's host copy x may not have landed yet: its values are read on the device
            _fits_scaled(tensor.detach() if _devices.on_device(tensor) else x, [scale for _, scale in plan],
                         "neighbor_allreduce: dst_weights")
    except Exception as exc:
        sends, recvs, known = _peers(st.topology, dst_weights is None, src_weights, dst_weights, st.size, st.rank)
        raise _Refused(_refuse(
            "NEIGHBOR_ALLREDUCE", name, exc, [(d, name) for d in sends], [(r, name) for r in recvs],
            negotiate=_checked_or(enable_topo_check, True) and dst_weights is not None,
            peers_known=known)) from exc
    return (name, x, st, sw, srcw, plan, recv_from, bool(enable_topo_check) and dynamic,
            None if x is tensor else _devices.delivery(tensor, False, name))    # (a device tensor's x is a copy)


def _submit_neighbor_allreduce(name, x, st, sw, srcw, plan, recv_from, check, deliver):
    fuse = None
    if not check:   # ops of one plan and dtype admitted together run as one (see _fusion.py)
        topo = st.topology
        key = (x.dtype, topo.default_plan_key if plan is topo.default_plan[2] else
               plan_key(sw, srcw, plan, recv_from))
        fuse = Fusable(key, x.numel() * x.element_size(), x, lambda e, lead, members: (
            _neighbor_tasks.neighbor_allreduce_fused(e, lead, members, sw, srcw, plan, recv_from)))
    return _submit("NEIGHBOR_ALLREDUCE", name, lambda e, op: _neighbor_tasks.neighbor_allreduce(
        e, op, x, sw, srcw, plan, recv_from, check), fuse, deliver)


def neighbor_allgather_nonblocking(tensor, *, src_ranks=None, dst_ranks=None, enable_topo_check=True,
                                   name=None):
    """Concatenate (dim 0) the tensors of the in-neighbors (or src_ranks), in that order."""
    name = _op_name(name, "NEIGHBOR_ALLGATHER")
    st = state()
    dynamic = src_ranks is not None or dst_ranks is not None
    check = _checked_or(enable_topo_check, True) and dynamic
    try:
        _untainted(st, name)
        _flag(enable_topo_check, "enable_topo_check")
        x = _input(tensor, name)
        if x.dim() == 0:
            raise ValueError("neighbor_allgather needs a tensor with at least one dimension")
        if (src_ranks is None) != (dst_ranks is None):
            raise ValueError("neighbor_allgather: src_ranks and dst_ranks must be given together (or neither)")
        if src_ranks is None:
            send_to, recv_from = st.topology.out_ranks, st.topology.in_ranks
        else:
            send_to = _rank_list(dst_ranks, "dst_ranks", st.size, st.rank)
            recv_from = _ordered_ranks(src_ranks, "src_ranks", st.size, st.rank)
    except Exception as exc:
        sends, recvs, known = _peers(st.topology, not dynamic, src_ranks, dst_ranks, st.size, st.rank)
        return _refuse("NEIGHBOR_ALLGATHER", name, exc, [(d, name) for d in sends],
                       [(r, name) for r in recvs], negotiate=check,
                       peers_known=known)
    return _submit("NEIGHBOR_ALLGATHER", name, lambda e, op: _neighbor_tasks.neighbor_allgather(
        e, op, x, list(send_to), list(recv_from), check), deliver=_devices.delivery(tensor, False, name))


def neighbor_allgather(tensor, *, src_ranks=None, dst_ranks=None, enable_topo_check=True, name=None):
    return _blocking(neighbor_allgather_nonblocking, tensor, src_ranks=src_ranks, dst_ranks=dst_ranks,
                     enable_topo_check=enable_topo_check, name=name)


def _machine_weights(src_machine_weights, dst_machine_weights, neighbor_machine_weights, send_neighbor_machines):
    """(src, dst, problem): the machine weights given under either name,
    src_/dst_machine_weights or Bluefog's neighbor_machine_weights /
    send_neighbor_machines; problem is the message when one is given under both."""
    problem = None
    for ours, what, theirs, bluefogs in ((src_machine_weights, "src_machine_weights", neighbor_machine_weights,
                                          "neighbor_machine_weights"),
                                         (dst_machine_weights, "dst_machine_weights", send_neighbor_machines,
                                          "send_neighbor_machines")):
        if ours is not None and theirs is not None:
            problem = f"hierarchical_neighbor_allreduce: give {what} or {bluefogs} (Bluefog's name for it), not both"
    return (neighbor_machine_weights if src_machine_weights is None else src_machine_weights,
            send_neighbor_machines if dst_machine_weights is None else dst_machine_weights, problem)


def hierarchical_neighbor_allreduce_nonblocking(tensor, self_weight=None, neighbor_machine_weights=None,
                                                send_neighbor_machines=None, enable_topo_check=False,
                                                name=None, *, src_machine_weights=None, dst_machine_weights=None):
    """Sum within each machine, weighted exchange of machine sums between neighbor
    machines (machine topology or the given machine weights), divide by the agents
    per machine. Bluefog's argument names and order work too."""
    name = _op_name(name, "HIERARCHICAL_NEIGHBOR_ALLREDUCE")
    src_machine_weights, dst_machine_weights, both = _machine_weights(
        src_machine_weights, dst_machine_weights, neighbor_machine_weights, send_neighbor_machines)
    st = state()
    if not st.homogeneous:      # the same on every agent
        sizes = collections.Counter(m for m, _ in st.rank_of)
        emulated = (f" (BLUEFOG_RANKS_PER_MACHINE={os.environ['BLUEFOG_RANKS_PER_MACHINE']} with "
                    f"{st.size} agents)" if os.environ.get("BLUEFOG_RANKS_PER_MACHINE") else "")
        raise ValueError("hierarchical_neighbor_allreduce needs the same number of agents on every machine; "
                         "agents per machine: " + ", ".join(f"machine {m}: {n}" for m, n in sorted(sizes.items()))
                         + emulated)
    to_rank = lambda m: st.rank_of[(m, st.local_rank)]  # noqa: E731
    try:
        _untainted(st, name)
        if both:
            raise TypeError(both)
        _flag(enable_topo_check, "enable_topo_check")
        x = _numeric(_input(tensor, name), "hierarchical_neighbor_allreduce")
        sw, srcw, plan, recv_from, dynamic = _plan(
            self_weight, src_machine_weights, dst_machine_weights, st.machine_topology, st.machine_size,
            st.machine_rank, "hierarchical_neighbor_allreduce", unit="machine")
    except Exception as exc:
        sends, recvs, known = _peers(st.machine_topology, dst_machine_weights is None, src_machine_weights,
                                     dst_machine_weights, st.machine_size, st.machine_rank)
        local = [(r, (name, "local")) for r in st.local_ranks if r != st.rank]
        return _refuse("HIERARCHICAL_NEIGHBOR_ALLREDUCE", name, exc,
                       local + [(to_rank(m), k) for m in sends for k in _neighbor_tasks.machine_keys(name)],
                       local + [(to_rank(m), k) for m in recvs for k in _neighbor_tasks.machine_keys(name)],
                       negotiate=_checked_or(enable_topo_check, False) and dst_machine_weights is not None,
                       peers_known=known)
    plan = [(to_rank(m), w) for m, w in plan]
    srcw = {to_rank(m): w for m, w in srcw.items()}
    recv_from = [to_rank(m) for m in recv_from]
    check = bool(enable_topo_check) and dynamic
    return _submit("HIERARCHICAL_NEIGHBOR_ALLREDUCE", name,
                   lambda e, op: _neighbor_tasks.hierarchical_neighbor_allreduce(
                       e, op, x, st.local_ranks, sw, srcw, plan, recv_from, check),
                   deliver=_devices.delivery(tensor, False, name))


def hierarchical_neighbor_allreduce(tensor, self_weight=None, neighbor_machine_weights=None,
                                    send_neighbor_machines=None, enable_topo_check=False, name=None, *,
                                    src_machine_weights=None, dst_machine_weights=None):
    return _blocking(
        hierarchical_neighbor_allreduce_nonblocking, tensor, self_weight=self_weight,
        neighbor_machine_weights=neighbor_machine_weights, send_neighbor_machines=send_neighbor_machines,
        enable_topo_check=enable_topo_check, name=name, src_machine_weights=src_machine_weights,
        dst_machine_weights=dst_machine_weights)


def pair_gossip_nonblocking(tensor, target_rank, self_weight=None, pair_weight=None, name=None):
    """self_weight*x + pair_weight*x_target with one peer (both call it); default ½, ½."""
    name = _op_name(name, "PAIR_GOSSIP")
    st = state()
    try:
        _untainted(st, name)
        x = _numeric(_input(tensor, name), "pair_gossip")
        target = _rank(target_rank, "target_rank", st.size, st.rank)
        if (self_weight is None) != (pair_weight is None):
            raise ValueError("pair_gossip: self_weight and pair_weight must be given together (or neither)")
        sw = 0.5 if self_weight is None else _weight(self_weight, "self_weight")
        pw = 0.5 if pair_weight is None else _weight(pair_weight, "pair_weight")
    except Exception as exc:
        targets, known = _ranks_named([target_rank], st.size, st.rank)
        pair = [(r, name) for r in targets]
        return _refuse("PAIR_GOSSIP", name, exc, pair, pair, peers_known=known)
    return _submit("PAIR_GOSSIP", name, lambda e, op: _neighbor_tasks.pair_gossip(e, op, x, target, sw, pw),
                   deliver=_devices.delivery(tensor, False, name))


def pair_gossip(tensor, target_rank, self_weight=None, pair_weight=None, name=None):
    return _blocking(pair_gossip_nonblocking, tensor, target_rank, self_weight, pair_weight, name)


# ---- topology inference (collective) ------------------------------------------------

def _adjacency(lists, size, outgoing):
    """Bluefog's matrix of an inferred pattern: W[i, j] > 0 when i sends to j or
    i == j, and each column averages what its agent receives (columns sum to 1),
    the convention of set_topology(nx.from_numpy_array(W, create_using=nx.DiGraph),
    is_weighted=True)."""
    W = np.eye(size)
    for r, ranks in enumerate(lists):
        if outgoing:
            W[r, ranks] = 1.0
        else:
            W[ranks, r] = 1.0
    return W / W.sum(axis=0)


def InferSourceFromDestinationRanks(dst_ranks, construct_adjacency_matrix=False):
    """Collective: from every agent's destinations, the sources of this agent
    (sorted). With construct_adjacency_matrix, also W (see _adjacency): uniform
    weights 1/(in-degree + 1) in column j for agent j and its sources."""
    st = state()

    def validated():
        dsts = _rank_list(dst_ranks, "dst_ranks", st.size, st.rank)
        return dsts, dsts
    _, views = _negotiate(None, validated)
    srcs = sorted(r for r, ds in enumerate(views) if st.rank in ds)
    return (srcs, _adjacency(views, st.size, True)) if construct_adjacency_matrix else srcs


def InferDestinationFromSourceRanks(src_ranks, construct_adjacency_matrix=False):
    """Collective: from every agent's sources, the destinations of this agent
    (sorted). With construct_adjacency_matrix, also W (see _adjacency): uniform
    weights 1/(in-degree + 1) in column j for agent j and its sources."""
    st = state()

    def validated():
        srcs = _rank_list(src_ranks, "src_ranks", st.size, st.rank)
        return srcs, srcs
    _, views = _negotiate(None, validated)
    dsts = sorted(r for r, ss in enumerate(views) if st.rank in ss)
    return (dsts, _adjacency(views, st.size, False)) if construct_adjacency_matrix else dsts


"""Process-wide runtime: init/shutdown, rank and machine layout, the current topology."""
import atexit
import math
import numbers
import os
import sys
import threading
import time
import traceback
import warnings

import networkx as nx
import numpy as np
import torch

import topology as _topo
from topology import _validate as _topo_checks

from . import _leftovers
from ._departures import Departures
from ._mpi import MPI, free_retired, retire


class BluefogError(RuntimeError, ValueError):
    """Raised for misuse of the runtime (e.g. an operation before init()). Also a
    ValueError, which is what Bluefog raised for it."""


class _State:
    def __init__(self):
        self.initialized = False
        self.shut_down = False
        self.shutting_down = False    # shutdown() is running (a nested or concurrent call returns at once)
        self.shutdown_steps = 0       # steps of shutdown() done (one cut short by an exception goes on from there)
        self.forked = False           # this process was forked from an agent after init()
        self.generation = 0           # how many times init() has completed in this process
        self.comm = None          # private duplicate of COMM_WORLD (control, set-up)
        self.rank = 0
        self.size = 1
        self.local_rank = 0
        self.local_size = 1
        self.machine_rank = 0
        self.machine_size = 1
        self.homogeneous = True
        self.engine = None
        self.topology = None
        self.is_weighted = False
        self.machine_topology = None
        self.machine_is_weighted = False
        self.rank_of = {(0, 0): 0}     # (machine rank, local rank) -> rank
        self.local_ranks = [0]         # ranks on this machine
        self.windows = {}         # name -> window object (filled by windows.py)
        self.departures = None    # Departures: which agents have shut down
        self.hooks_before = (sys.__excepthook__, threading.__excepthook__)   # the user's, while initialized
        self.clock_offset_us = 0.0


_state = _State()
_ABORT_DELAY_S = 0.5


def state():
    """The runtime state, after checking that init() was called."""
    if not _state.initialized:
        if _state.forked:
            raise BluefogError("this process was forked (os.fork) from an agent after bf.init(): bluefog_lite "
                               "(MPI, its communication thread) belongs to the parent; a forked child cannot use it")
        if _state.shut_down:
            raise BluefogError("bluefog_lite has been shut down; call bf.init() again before this operation")
        raise BluefogError("bluefog_lite is not initialized: call bf.init() before this operation")
    return _state


def _abort_on_uncaught(exc_type, exc, tb):
    """Unhandled exception on one agent: print it and take the whole MPI job down."""
    traceback.print_exception(exc_type, exc, tb)
    sys.stderr.flush()
    if MPI.Is_initialized() and not MPI.Is_finalized() and _state.size > 1:
        rank = _state.rank
        sys.stderr.write(f"bluefog_lite: uncaught exception on rank {rank}; aborting the job\n")
        sys.stderr.flush()
        _abort_job()


def _abort_job():
    # A moment first: agents that failed at the same point (the same bad input
    # everywhere) get to print their own error before the abort kills them.
    time.sleep(_ABORT_DELAY_S)
    MPI.COMM_WORLD.Abort(1)


def _abort_for_departed(op, departed_rank):
    waits = (f"waits for rank {departed_rank} to take the tensor it sent, but rank {departed_rank}"
             if op.finished_task else f"waits for rank {departed_rank}, which")
    sys.stderr.write(
        f"bluefog_lite: rank {_state.rank}: {op.kind} {op.name!r} {waits} has left the job (its program ended, "
        f"called sys.exit() or bf.shutdown()) without joining this operation; aborting the job\n")
    sys.stderr.flush()
    _abort_job()


def _thread_excepthook(args):
    _abort_on_uncaught(args.exc_type, args.exc_value, args.exc_traceback)


def _machine_layout(comm):
    """local comm and machine numbering; BLUEFOG_RANKS_PER_MACHINE emulates machines on one host."""
    per_machine = os.environ.get("BLUEFOG_RANKS_PER_MACHINE")
    if per_machine:
        try:
            k = int(per_machine)
        except ValueError:
            k = 0
        if k <= 0:
            raise ValueError(f"BLUEFOG_RANKS_PER_MACHINE must be a positive integer, got {per_machine!r}")
        local = comm.Split(color=comm.rank // k, key=comm.rank)
    else:
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    leaders = comm.Split(color=0 if local.rank == 0 else MPI.UNDEFINED, key=comm.rank)
    machine = (leaders.rank, leaders.size) if local.rank == 0 else None
    if leaders != MPI.COMM_NULL:
        leaders.Free()
    machine_rank, machine_size = local.bcast(machine, root=0)
    layout = comm.allgather((machine_rank, local.rank, local.size))
    return local, machine_rank, machine_size, layout


def _set_compute_threads(local_size):
    """Ranks that share cores must not each start a full BLAS/OpenMP pool (../shared/LIMITS.md point 2)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // max(1, local_size)))


_exit_registered = False     # shutdown() is registered to run at exit


def init(topology_fn=None, is_weighted=False):
    """Start MPI (if needed), the communication thread and the default topology.

    topology_fn: callable size -> networkx.DiGraph; default ExponentialGraph(size).
    Every agent must get the same graph (checked: ValueError on every agent if not).
    """
    from . import _engine
    if _state.initialized:
        _check_is_weighted(is_weighted)
        if topology_fn is not None or is_weighted:
            warnings.warn("bf.init() called again while initialized: it does nothing, and its topology_fn/"
                          "is_weighted are ignored; change the topology with bf.set_topology(...)",
                          stacklevel=2)
        return
    if _state.forked:
        state()     # (raises: a forked child cannot start MPI)
    if MPI.Is_finalized():
        raise BluefogError("bf.init(): MPI was finalized in this process (MPI.Finalize() was called) and cannot "
                           "be started again; call bf.shutdown() instead of MPI.Finalize() to stop bluefog_lite")
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        warnings.warn("MPI was initialized without MPI_THREAD_MULTIPLE (e.g. mpi4py.rc.thread_level set before "
                      "importing MPI), but bluefog_lite calls MPI from its communication thread and the caller's: "
                      "results are undefined; leave mpi4py's thread level at its default ('multiple')",
                      RuntimeWarning, stacklevel=2)
    _every_agent_arrived(MPI.COMM_WORLD)
    free_retired()
    _leftovers.remove_names()
    comm = MPI.COMM_WORLD.Dup()
    _state.rank, _state.size = comm.rank, comm.size
    # From here on an uncaught error on one agent (a bad topology_fn, a bad
    # timeline prefix...) takes the job down instead of leaving the others in init.
    if sys.excepthook is not _abort_on_uncaught:    # (restored by shutdown)
        _state.hooks_before = (sys.excepthook, threading.excepthook)
    sys.excepthook = _abort_on_uncaught
    threading.excepthook = _thread_excepthook
    _state.comm = comm
    local, _state.machine_rank, _state.machine_size, layout = _machine_layout(comm)
    _state.homogeneous = len({n for _, _, n in layout}) == 1
    _state.rank_of = {(m, l): r for r, (m, l, _) in enumerate(layout)}
    _state.local_ranks = sorted(r for r, (m, _, _) in enumerate(layout) if m == _state.machine_rank)
    _state.local_rank, _state.local_size = local.rank, local.size
    local.Free()
    topology = _initial_topology(topology_fn, is_weighted, comm)
    _set_compute_threads(_state.local_size)
    _state.engine = _engine.Engine(comm.Dup(), _state.rank, _state.size)
    _state.departures = Departures(comm, _state.engine, _abort_for_departed)
    _state.initialized = True
    _state.shut_down = False
    _install_topology(topology)
    _install_machine_topology(_Topology(_topo.ExponentialGraph(_state.machine_size), _state.machine_rank, False))
    global _exit_registered
    if not _exit_registered:        # (once per process, however often it is initialized)
        atexit.register(shutdown)
        _exit_registered = True
    _state.generation += 1
    MPI.COMM_SELF.Set_attr(_finalize_keyval(), _state.generation)
    _start_timeline_if_requested()


_keyval = None


def _finalize_keyval():
    """The key of an attribute of MPI.COMM_SELF whose deletion, the first thing
    MPI_Finalize does (while MPI still works), shuts bluefog_lite down: a program that
    calls MPI.Finalize() itself while initialized (its communication thread then
    called a finalized MPI and the process died with a segmentation fault)."""
    global _keyval
    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval(delete_fn=_on_finalize)
    return _keyval


def _on_finalize(comm, keyval, generation):
    # the attribute of an earlier init (replaced by the next one's) does nothing
    if generation == _state.generation and _state.initialized and not _state.shutting_down:
        try:
            shutdown()
        except BaseException:      # (an exception cannot leave an MPI callback)
            traceback.print_exc()
            sys.stderr.flush()


def _forked_child():
    """After os.fork() in an agent, in the child: bluefog_lite stays the parent's.
    The child has neither the communication thread nor the timeline's writer, and
    must not take part in the job: its exit must not run shutdown (the others saw
    the agent leave) nor its uncaught exception abort the job."""
    if _state.initialized:
        from .timeline import _control, _recorder
        _recorder.current = None
        _control.forget_in_forked_child()
        _state.initialized = False
        _state.forked = True
        _state.engine = _state.departures = _state.comm = None
        sys.excepthook, threading.excepthook = _state.hooks_before


os.register_at_fork(after_in_child=_forked_child)


def _every_agent_arrived(world):
    """Wait, sleeping, until every agent has called init(). The blocking MPI calls
    that follow spin while they wait (MPICH polls with sched_yield): with MPI started
    before init() (mpi4py imported first) and one agent late, the others burned half a
    core each until it came."""
    request, delay = world.Ibarrier(), 1e-4
    while not request.Test():
        time.sleep(delay)
        delay = min(2 * delay, 2e-3)


def _initial_topology(topology_fn, is_weighted, comm):
    """The _Topology of topology_fn(size), validated, and the same graph on every
    agent (collective). An agent whose arguments fail (or whose topology_fn raises,
    or whose graph's neighbors cannot be read) still joins the exchange, so that
    every agent raises instead of the others waiting for it."""
    from ._tasks import BadInput, failed_everywhere
    error = None
    try:
        _check_is_weighted(is_weighted)
        if topology_fn is None:
            G = _topo.ExponentialGraph(comm.size)
        elif not callable(topology_fn):
            raise TypeError(f"topology_fn must be a callable size -> networkx.DiGraph, got {topology_fn!r}")
        else:
            G = _validate_graph(topology_fn(comm.size), comm.size, "init: the graph returned by topology_fn",
                                is_weighted)
        mine = _fingerprint(G, is_weighted)
        topology = _Topology(G, comm.rank, bool(is_weighted))
    except Exception as exc:
        error, mine = exc, BadInput(f"{type(exc).__name__}: {exc}")
    views = comm.allgather(mine)
    if error is not None:
        raise error
    bad = [(r, v.text) for r, v in enumerate(views) if isinstance(v, BadInput)]
    if bad:
        raise failed_everywhere("init", bad)
    _same_everywhere("init", views, "topology_fn returned different graphs on different agents; it must give "
                     "every agent the same graph")
    return topology


def _start_timeline_if_requested():
    from .timeline import _control
    _control.measure_clock(_state)      # collective: also for a timeline started later
    _control.start_from_environment()


def shutdown():
    """Finish in-flight work, stop the communication thread, free windows, then wait
    until every agent has shut down too (as MPI_Finalize does). Also runs at exit."""
    if not _state.initialized or _state.shutting_down:
        return
    _state.engine.refuse_nested()
    _state.shutting_down = True
    try:
        _shutdown()
    finally:
        _state.shutting_down = False


def _shutdown():
    """shutdown()'s steps, from the first not done yet: a shutdown cut short by an
    exception (a signal handler's sys.exit while it waits) is finished by the next
    call (at exit) without redoing what was done (freeing a communicator twice)."""
    from .timeline import _control
    steps = (_report_exception_in_flight, lambda: _settle(_state.engine),
             _state.departures.start_leaving,    # it calls nothing else now: whoever waits for it can stop
             _free_windows, _state.engine.stop, _control.stop_timeline, _state.departures.leave)
    while _state.shutdown_steps < len(steps):
        steps[_state.shutdown_steps]()
        _state.shutdown_steps += 1
    # Calls on other threads that passed state() before this may still read the
    # engine and the departures: they are kept (stopped: the engine refuses new
    # operations; without its memory) until the next init() replaces them
    _state.engine.drop_memory()
    _state.initialized = False
    _state.shut_down = True
    retire(_state.comm)     # (the departures' messages: see _mpi.retire)
    _state.comm = None
    _state.shutdown_steps = 0
    sys.excepthook, threading.excepthook = _state.hooks_before


def _free_windows():
    from . import windows
    try:
        windows.free_at_shutdown()
    except RuntimeError as exc:     # (win_free is a collective: none runs after one timed out)
        if _state.engine.collectives_broken is None:
            raise
        sys.stderr.write(f"bluefog_lite WARNING (rank {_state.rank}): shutdown could not free the windows "
                         f"{sorted(_state.windows)}: {exc}\n")


def _report_exception_in_flight():
    """shutdown() called while an exception propagates (try: ... finally: bf.shutdown())
    or is being handled: print it now. shutdown waits for the other agents, and if they
    end the job first (this agent left operations they wait for), Python never would."""
    exc = sys.exc_info()[1]
    if exc is None or isinstance(exc, SystemExit):
        return
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    sys.stderr.write(f"bluefog_lite: rank {_state.rank}: shutdown() called during this exception (printed now "
                     f"in case the job ends before Python reports it):\n{text}")
    sys.stderr.flush()


_SETTLE_MAX_S = 60.0


def _settle(engine):
    """Wait (sleeping) until this agent's own operations in flight have finished:
    until then its data may still depend on others (a machine's sum in a
    hierarchical op) and it must not count as leaving. Not longer than the stall
    warning time (at most a minute), and not once an agent they wait for is itself
    waiting in an operation this agent never started (a program that failed here)."""
    deadline, delay = time.monotonic() + min(engine.stall_warning_s, _SETTLE_MAX_S), 1e-4
    while engine.has_pending() and time.monotonic() < deadline and not engine.peers_wait_elsewhere():
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def rank():
    return state().rank


def size():
    return state().size


def local_rank():
    return state().local_rank


def local_size():
    return state().local_size


def machine_rank():
    return state().machine_rank


def machine_size():
    return state().machine_size


def is_homogeneous():
    return state().homogeneous


def mpi_threads_supported():
    state()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def unified_mpi_window_model_supported():
    """Whether this MPI's windows use the unified memory model (a process's own
    window memory and what others put there are one copy)."""
    state()
    win = MPI.Win.Allocate(8, comm=MPI.COMM_SELF)
    try:
        return win.Get_attr(MPI.WIN_MODEL) == MPI.WIN_UNIFIED
    finally:
        win.Free()


def nccl_built():
    """False: bluefog_lite moves GPU tensors through host memory over MPI (no NCCL)."""
    return False


# Bluefog's switch for its negotiation stage. bluefog_lite always negotiates what
# needs it (collectives, topology checks): it keeps the order of collectives and
# turns mismatches into errors. The value is kept and reported, and changes nothing.
_skip_negotiate = False


def set_skip_negotiate_stage(value):
    global _skip_negotiate
    _skip_negotiate = bool(value)


def get_skip_negotiate_stage():
    return _skip_negotiate


def suspend():
    """Nothing to do: the communication thread sleeps whenever it has no work (it
    takes no CPU between operations), which is what Bluefog's suspend was for."""


def resume():
    """See suspend."""


# ---- topology -------------------------------------------------------------

def _check_is_weighted(is_weighted):
    """True or False; also 0 or 1 (Bluefog took any truthy value, but a string such
    as "no" is truthy: refused)."""
    if not (isinstance(is_weighted, (bool, np.bool_))
            or (isinstance(is_weighted, numbers.Integral) and is_weighted in (0, 1))):
        raise TypeError(f"is_weighted must be True or False, got {is_weighted!r}")


def _validate_graph(G, n, what, is_weighted=False, unit="agent"):
    if not isinstance(G, nx.Graph) or G.is_multigraph():
        raise TypeError(f"{what} must be a networkx.DiGraph, got {type(G).__name__}")
    if not _topo_checks.has_rank_nodes(G, n):
        raise ValueError(f"{what} must have nodes 0..{n - 1} (one per {unit}), got {_topo_checks.nodes_shown(G)}")
    if is_weighted:
        for i, j, w in G.edges(data="weight", default=1.0):
            if isinstance(w, bool) or not isinstance(w, numbers.Real) or not _finite(w):
                raise ValueError(f"{what}: edge {i} -> {j} has weight {w!r}; with is_weighted=True "
                                 "every edge weight must be a finite number")
    return G if G.is_directed() else G.to_directed()


def _finite(w):
    try:
        return math.isfinite(w)
    except OverflowError:       # an integer too large for a float
        return False


class _Topology:
    """A graph with the derived per-rank neighbor lists and default weights."""

    def __init__(self, G, me, is_weighted):
        self.graph = G
        self.is_weighted = is_weighted
        self.in_ranks = sorted(r for r in G.predecessors(me) if r != me)
        self.out_ranks = sorted(r for r in G.successors(me) if r != me)
        if is_weighted:
            self.self_weight, self.src_weights = _topo.GetRecvWeights(G, me)
        else:
            w = 1.0 / (len(self.in_ranks) + 1)
            self.self_weight, self.src_weights = w, {r: w for r in self.in_ranks}
        # what a neighbor op without weights uses: (self_weight, src_weights, send plan,
        # receive ranks, dynamic), built once (read-only: tasks never change it)
        self.default_plan = (self.self_weight, dict(self.src_weights), [(d, None) for d in self.out_ranks],
                             list(self.in_ranks), False)
        self.default_plan_key = plan_key(*self.default_plan[:4])


def plan_key(self_weight, src_weights, send_plan, recv_from):
    """A hashable summary of a neighbor op's plan: ops with equal keys (and dtype) may be fused."""
    return (self_weight, tuple(src_weights.items()), tuple(send_plan), tuple(recv_from))


def _install_topology(topology):
    _state.topology = topology
    _state.is_weighted = topology.is_weighted


def _install_machine_topology(topology):
    _state.machine_topology = topology


def _edges(G):
    """The edge list as text; labels as Python ints (numpy 2 shows np.int64(0) otherwise)."""
    return repr(sorted((int(i), int(j)) for i, j in G.edges())).encode()


def _fingerprint(G, is_weighted):
    """What agents must agree on: is_weighted, the edges and the weights of a
    weighted graph."""
    if is_weighted:     # the edges too: an edge of weight 0 still makes a neighbor
        return True, np.round(_topo.mixing_matrix(G), 12).tobytes() + _edges(G)
    return False, _edges(G)


def _identity(G, is_weighted):
    """What makes a graph the one in use: the fingerprint and, for an unweighted
    graph too, its weight attributes as they are (load_topology() hands them out;
    Bluefog compared them; unused, they need not be numbers)."""
    if is_weighted:
        return _fingerprint(G, True), True
    weights = sorted((int(i), int(j), repr(w)) for i, j, w in G.edges(data="weight", default=1.0))
    return _edges(G), repr(weights), False


def _same_everywhere(call, fingerprints, graphs_differ):
    """Raise unless every agent's _fingerprint (in rank order) is the same."""
    flags = [w for w, _ in fingerprints]
    if len(set(flags)) != 1:
        listing = ", ".join(f"rank {r}: {w}" for r, w in enumerate(flags))
        raise ValueError(f"{call}: agents passed different is_weighted ({listing}); every agent must pass the same")
    if len({graph for _, graph in fingerprints}) != 1:
        raise ValueError(f"{call}: {graphs_differ}")


def set_topology(topology=None, is_weighted=False, *, G=None):
    """Replace the static topology (collective). Returns False, with a warning,
    while windows exist or operations are in flight on any agent, unless the graph
    (and is_weighted) is the one in use: then nothing changes and it returns True,
    as Bluefog did. The graph may be passed as ``topology`` (Bluefog's name) or ``G``
    (the specification's); none: the Exponential-2 graph."""
    st = state()
    busy = bool(st.windows) or st.engine.has_pending()

    def validated():
        _check_is_weighted(is_weighted)
        if G is not None and topology is not None:
            raise TypeError("set_topology: pass the graph once, as topology or as G")
        given = topology if G is None else G
        graph = (_topo.ExponentialGraph(st.size) if given is None
                 else _validate_graph(given, st.size, "topology", is_weighted))
        changed = _identity(graph, is_weighted) != _identity(st.topology.graph, st.topology.is_weighted)
        # (made before the agents agree: a graph whose neighbors cannot be read fails everywhere)
        new = _Topology(graph, st.rank, bool(is_weighted)) if changed else None
        return new, (busy and changed, _fingerprint(graph, is_weighted))
    from .ops import _negotiate
    new, views = _negotiate("set_topology", validated)
    if any(b for b, _ in views):
        warnings.warn("set_topology refused: windows exist or operations are in flight "
                      "(free windows with win_free() and synchronize handles first)")
        return False
    _same_everywhere("set_topology", [fp for _, fp in views],
                     "agents passed different graphs; every agent must set the same topology")
    if new is not None:
        _install_topology(new)
    return True


def load_topology():
    return state().topology.graph


def is_topo_weighted():
    return state().topology.is_weighted


def in_neighbor_ranks():
    return list(state().topology.in_ranks)


def out_neighbor_ranks():
    return list(state().topology.out_ranks)


def set_machine_topology(topology, is_weighted=False):
    """Topology among machines, used by hierarchical_neighbor_allreduce (collective)."""
    st = state()

    def validated():
        _check_is_weighted(is_weighted)
        G = _validate_graph(topology, st.machine_size, "machine topology", is_weighted, unit="machine")
        return _Topology(G, st.machine_rank, bool(is_weighted)), _fingerprint(G, is_weighted)
    from .ops import _negotiate
    new, views = _negotiate("set_machine_topology", validated)
    _same_everywhere("set_machine_topology", views, "agents passed different graphs")
    _install_machine_topology(new)
    return True


def load_machine_topology():
    return state().machine_topology.graph


def in_neighbor_machine_ranks():
    return list(state().machine_topology.in_ranks)


def out_neighbor_machine_ranks():
    return list(state().machine_topology.out_ranks)

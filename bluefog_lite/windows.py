"""One-sided window operations: validate, name, enqueue. The MPI RMA part is a task
of the engine's loop (_win_tasks.py), run by the communication thread, or by the
caller of a blocking call made while that thread sleeps.

A window is created collectively from a tensor; each agent then owns one receive
buffer per in-neighbor of the topology the window was created with. Puts,
accumulates and gets complete without the other agent taking part, which is
what asynchronous algorithms (push-sum, asynchronous SGD) are built on.
"""
import contextlib
import functools
import heapq
import sys
import time

from . import _devices, _win_tasks, ops
from ._mpi import MPI
from ._runtime import state
from ._arguments import _dense, _flag, _overlaps, _rank, _tensor, _weight, _weight_dict, _writable

_WINDOW_POKE_S = 0.001      # idle MPI progress poke while windows span hosts (docs/windows.md)
_with_p = False             # push-sum weight carried with window ops (turn_on_win_ops_with_associated_p)
_poke_before = None


# ---- argument checks -------------------------------------------------------------

def _window(name, what):
    st = state()
    if not isinstance(name, str):
        raise TypeError(f"{what}: name must be a window name (str), got {name!r}")
    win = st.windows.get(name)
    if win is None:
        known = sorted(st.windows)
        raise ValueError(f"{what}: no window named {name!r} on rank {st.rank} "
                         f"(existing windows: {known}); create it with win_create first")
    return st, win


def _describe(dtype, shape):
    return f"{str(dtype).replace('torch.', '')}{list(shape)}"


def _check_matching(tensor, win, what):
    """Raise unless tensor is a dense tensor shaped and typed like the window."""
    _dense(tensor, f"{what}: tensor")
    if tensor.dtype != win.dtype or tuple(tensor.shape) != win.shape:
        raise ValueError(f"{what}: tensor {_describe(tensor.dtype, tensor.shape)} does not match window "
                         f"{win.name!r} ({_describe(win.dtype, win.shape)}); pass a tensor of the window's "
                         "shape and dtype")


def _current(win, op_name):
    """For a window of a device tensor, a host copy of that tensor as it is now (the
    value that win_update combines and win_get exposes), else None."""
    return None if win.device_tensor is None else _tensor(win.device_tensor, op_name)


def _written_back(win, clone, op_name):
    """win_update's deliver step (see _devices.delivery) for a window of a device
    tensor: the result written into that tensor, which is returned (as a host window
    returns its tensor), or with clone a new tensor on its device."""
    if win.device_tensor is None:
        return None
    if clone:
        return _devices.delivery(win.device_tensor, False, op_name)
    into = _devices.delivery(win.device_tensor, True, op_name)

    def deliver(host):
        into(host)
        return win.device_tensor
    return deliver


def _no_copy(make_task):
    """The prepare step (see _submit) of an op that copies no tensor."""
    return lambda op_name: (make_task, None)


def _neighbor_weights(weights, allowed, what, direction, st, win):
    """{rank: weight} from a dict or a list of ranks; every rank must be a neighbor."""
    given = _weight_dict(weights, what, st.size, st.rank)
    stray = sorted(set(given) - set(allowed))
    if stray:
        raise ValueError(f"{what} names ranks {stray} that are not {direction}-neighbors of rank "
                         f"{st.rank} ({sorted(allowed)}) in the topology window {win.name!r} was "
                         "created with; windows only move data along its edges")
    return given


_MOST_WINDOWS_MPICH = 2000     # 2040 worked, 2100 crashed in Win.Allocate (MPICH 5.0.2, 2 agents)


def most_windows():
    """How many windows may exist at once: MPICH runs out of communicator context ids
    (and crashes) a little past 2000; other MPIs are not limited here."""
    return _MOST_WINDOWS_MPICH if MPI.get_vendor()[0] == "MPICH" else sys.maxsize


def _create_problem(tensor, name, st, zero_init):
    """(error type name, message) for bad win_create input on this agent, or None."""
    try:
        _flag(zero_init, "zero_init")
    except TypeError as exc:
        return "TypeError", str(exc)
    if not isinstance(name, str) or not name:
        return "TypeError", f"name must be a non-empty string, got {name!r}"
    if name in st.windows:
        return "ValueError", f"a window named {name!r} already exists (win_free it first)"
    if len(st.windows) >= most_windows():
        return "ValueError", (f"{len(st.windows)} windows exist, the most this MPI allows at once (each "
                              "window takes one of MPICH's ~2048 communicator ids; past them MPICH crashes): "
                              "win_free some first")
    try:
        _dense(tensor)
    except TypeError as exc:
        return "TypeError", str(exc)
    if tensor.dtype not in _win_tasks.DTYPES:
        allowed = sorted(str(d).replace("torch.", "") for d in _win_tasks.DTYPES)
        return "TypeError", f"windows support dtypes {allowed}, got {str(tensor.dtype).replace('torch.', '')}"
    if _overlaps(tensor):
        return "ValueError", ("the tensor's elements share memory (stride 0, e.g. from expand()), so "
                              "win_update cannot write into it; pass tensor.clone()")
    return None


# ---- submission and handles ------------------------------------------------------

def _submit(win, kind, prepare, blocking=False):
    """Enqueue a window op under the window's name, or a numbered variant while
    other ops of the window are unsynchronized (so that each has its own name in
    warnings and the timeline): ``name#k`` with the smallest k free. Window ops do
    not reserve their name in the engine (no named messages): a neighbor op may
    share it. Ops of one window run in the order they were issued.
    ``prepare(op_name)`` -> (make_task, deliver) runs once the name is chosen: the
    host copy of a device tensor it takes is recorded in the op's own timeline row;
    deliver: see _devices.delivery. ``blocking``: the caller waits for it at once,
    so it may run the loop itself (Engine.submit's ``inline``) instead of waking
    the communication thread. A number comes back when its handle is synchronized
    (_freed): handles never synchronized keep theirs, without slowing later calls
    (every call polled every one of them: 3.7 ms per call after 6000)."""
    eng = state().engine
    with win.submitting:     # (callers on several threads: one name each, no handle lost)
        k = heapq.heappop(win.free_numbers) if win.free_numbers else len(win.handles)
        op_name = f"{win.name}#{k}" if k else win.name
        try:
            make_task, deliver = prepare(op_name)
            # The engine builds the task under its queue lock: tickets follow queue order.
            h = eng.submit(op_name, kind, lambda eng, op: _win_tasks.in_order(
                win, win.take_ticket(), make_task(eng, op)), inline=blocking, reserve=False, deliver=deliver,
                freed=functools.partial(_freed, win, k))
        except BaseException:
            heapq.heappush(win.free_numbers, k)
            raise
        win.handles[k] = h
    return h


def _freed(win, k):
    """The op numbered k of win was synchronized: its number is free again."""
    with win.submitting:
        del win.handles[k]
        heapq.heappush(win.free_numbers, k)


def win_poll(handle):
    """True when the nonblocking window operation behind handle has finished (a
    False gives the CPU away for a moment, as ops.poll does)."""
    return ops.poll(handle)


def win_wait(handle):
    """Wait for a nonblocking window operation, free its handle, return its result."""
    return state().engine.synchronize(handle)


def _wait_owned(handle):
    """win_wait for a blocking form (see Engine.synchronize_owned)."""
    return state().engine.synchronize_owned(handle)


# ---- create / free -------------------------------------------------------------------

def win_create(tensor, name, zero_init=False):
    """Create window ``name`` from ``tensor`` (collective: every agent calls it with a
    tensor of the same shape and dtype). Each agent gets one buffer per in-neighbor,
    a copy of its own tensor, as in Bluefog (zeros with zero_init). The window keeps
    ``tensor`` itself: win_update writes into it (a tensor on a GPU too: the window
    works on host copies of it, see docs/windows.md). The topology is frozen until the
    window is freed. Bad input on any agent raises the same error on all of them."""
    global _poke_before
    st = state()
    eng = st.engine
    cause = None    # an exception behind problem (raised from it on this agent)
    try:
        problem = _create_problem(tensor, name, st, zero_init)
    except Exception as exc:    # (a tensor that cannot be read: a subclass's or a device's error): told to all
        cause, problem = exc, _win_tasks.failed_doing(exc, "checking the tensor")
    if problem is None:
        name = str.__str__(name)    # (a str subclass: see ops.check_name)
    win = meta = None
    if problem is None:
        on_device = _devices.on_device(tensor)
        try:
            win = _win_tasks.Window(name, _devices.to_host(tensor, name) if on_device else tensor, st.topology,
                                    st.rank, st.size, device_tensor=tensor if on_device else None)
        except Exception as exc:    # (the host copy of a GPU tensor: out of memory): told to every agent
            cause, problem = exc, _win_tasks.failed_doing(exc, "taking a host copy of the tensor")
        meta = (name, str(tensor.dtype).replace("torch.", ""), tuple(tensor.shape))
    h = eng.submit("win_create", "WIN_CREATE", lambda eng, op: _win_tasks.create(
        eng, op, win, problem, meta, bool(zero_init), cause))     # (checked: problem names a bad one)
    multi_host = eng.synchronize_owned(h)
    if multi_host and _poke_before is None:
        # Off-host targets need their own MPI progress for puts to complete; on one
        # host the windows are shared memory and the default poke costs less.
        _poke_before = eng.progress_poke_s
        eng.progress_poke_s = min(_poke_before, _WINDOW_POKE_S)
    st.windows[name] = win
    return True


def _running(eng, win):
    """Whether an op of win has not finished yet."""
    with win.submitting:
        handles = list(win.handles.values())
    for h in handles:
        try:
            if not eng.poll(h):
                return True
        except ValueError:      # (synchronized meanwhile)
            pass
    return False


def _wait_idle(eng, wins):
    """Wait (sleeping) until this agent's operations on wins have finished."""
    delay = 1e-4
    while any(_running(eng, w) for w in wins):
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def win_free(name=None):
    """Free window ``name``, or every window when name is None (collective)."""
    return _free(name)


def free_at_shutdown():
    """bf.shutdown()'s win_free of every window: it waits for late agents however
    long they take (no BLUEFOG_OP_TIMEOUT_S: an agent that gave up would leave the
    late ones in MPI's collective free for good), as shutdown waits for them anyway;
    one that leaves the job without it ends the job (_departures.py)."""
    return _free(None, at_shutdown=True)


def _free(name, at_shutdown=False):
    global _poke_before
    st = state()
    eng = st.engine
    problem = None
    if isinstance(name, str):
        name = str.__str__(name)    # (a str subclass's own hash or == could raise here, on one agent)
    if name is None:
        names = sorted(st.windows)
        if not names:
            return True
    elif not isinstance(name, str) or name not in st.windows:
        names = [name] if isinstance(name, str) else []
        problem = ("ValueError", f"no window named {name!r} (existing windows: {sorted(st.windows)})")
    else:
        names = [name]
    locked = [n for n in names if n in st.windows and st.windows[n].mutex_blocks]
    if problem is None and locked:
        problem = ("ValueError", f"window {locked[0]!r} is freed inside this agent's win_mutex block "
                                 "on it; free it after the block")
    wins = [st.windows[n] for n in names if n in st.windows] if problem is None else []
    _wait_idle(eng, wins)

    def task(eng, op):
        op.at_shutdown = at_shutdown
        return _win_tasks.free(eng, op, wins, names, problem)
    h = eng.submit("win_free", "WIN_FREE", task)
    eng.synchronize_owned(h)
    for n in names:
        del st.windows[n]
    if not st.windows and _poke_before is not None:
        eng.progress_poke_s, _poke_before = _poke_before, None
    return True


def get_current_created_window_names():
    return sorted(state().windows)


# ---- put / accumulate / get ---------------------------------------------------------

def _put(kind, tensor, name, self_weight, dst_weights, require_mutex, blocking):
    """Enqueue a WIN_PUT or WIN_ACCUMULATE; returns its handle."""
    what = kind.lower()
    st, win = _window(name, what)
    _check_matching(tensor, win, what)
    if dst_weights is None:
        dstw = {r: 1.0 for r in win.out_ranks}
    else:
        dstw = _neighbor_weights(dst_weights, win.out_ranks, f"{what}: dst_weights", "out", st, win)
    sw = None if self_weight is None else _weight(self_weight, f"{what}: self_weight")
    if sw is not None:      # the tensor is scaled in place
        _writable(tensor, f"{what} with self_weight")
    mutex = _flag(require_mutex, f"{what}: require_mutex")
    accumulate, with_p = kind == "WIN_ACCUMULATE", _with_p
    on_device = _devices.on_device(tensor)

    def prepare(op_name):
        if on_device:
            x = _tensor(tensor, op_name, f"{what}: tensor")
            if sw is not None:    # x, the copy sent, is made: the tensor itself is scaled now
                _win_tasks.scale_in_place(tensor.detach(), sw)
        else:     # read when the op runs, after the window's earlier ops (their self_weight) ran
            x = _dense(tensor, f"{what}: tensor")
        return (lambda eng, op: _win_tasks.put(eng, op, win, None if on_device else tensor, x, dstw, sw, mutex,
                                               accumulate, with_p)), None
    return _submit(win, kind, prepare, blocking)


def win_put_nonblocking(tensor, name, self_weight=None, dst_weights=None, require_mutex=False):
    """Write dst_weights[j] * tensor into this agent's buffer at each out-neighbor j
    (default: every out-neighbor, weight 1), then multiply ``tensor`` by self_weight
    in place (if given). With require_mutex, the targets' mutexes are held meanwhile.
    Returns a handle for win_poll / win_wait."""
    return _put("WIN_PUT", tensor, name, self_weight, dst_weights, require_mutex, False)


def win_put(tensor, name, self_weight=None, dst_weights=None, require_mutex=False):
    return _wait_owned(_put("WIN_PUT", tensor, name, self_weight, dst_weights, require_mutex, True))


def win_accumulate_nonblocking(tensor, name, self_weight=None, dst_weights=None, require_mutex=False):
    """Like win_put_nonblocking, but adds into the target buffers."""
    return _put("WIN_ACCUMULATE", tensor, name, self_weight, dst_weights, require_mutex, False)


def win_accumulate(tensor, name, self_weight=None, dst_weights=None, require_mutex=False):
    return _wait_owned(_put("WIN_ACCUMULATE", tensor, name, self_weight, dst_weights, require_mutex, True))


def win_get_nonblocking(name, src_weights=None, require_mutex=False):
    """Fetch src_weights[j] * (in-neighbor j's window tensor) into this agent's buffer
    for j (default: every in-neighbor, weight 1). What is fetched is j's exposed
    copy, refreshed by j's own win_create / win_update / win_get."""
    return _get(name, src_weights, require_mutex, False)


def _get(name, src_weights, require_mutex, blocking):
    """Enqueue a WIN_GET; returns its handle."""
    st, win = _window(name, "win_get")
    if src_weights is None:
        srcw = {r: 1.0 for r in win.in_ranks}
    else:
        srcw = _neighbor_weights(src_weights, win.in_ranks, "win_get: src_weights", "in", st, win)
    mutex, with_p = _flag(require_mutex, "win_get: require_mutex"), _with_p

    def prepare(op_name):
        current = _current(win, op_name)
        return (lambda eng, op: _win_tasks.get(eng, op, win, srcw, mutex, with_p, current)), None
    return _submit(win, "WIN_GET", prepare, blocking)


def win_get(name, src_weights=None, require_mutex=False):
    return _wait_owned(_get(name, src_weights, require_mutex, True))


# ---- update ---------------------------------------------------------------------------

def win_update(name, self_weight=None, neighbor_weights=None, reset=False, clone=False,
               require_mutex=False):
    """self <- self_weight * self + sum_j neighbor_weights[j] * buffer_j, written into
    the window's tensor (or a new tensor with clone=True), which is returned.
    Defaults: the topology's weights if it is weighted, else uniform 1/(in-degree+1).
    reset zeroes the buffers used; require_mutex holds this agent's own mutex."""
    st, win = _window(name, "win_update")
    if (self_weight is None) != (neighbor_weights is None):
        raise ValueError("win_update: self_weight and neighbor_weights must be given together (or neither)")
    if self_weight is None:
        sw, nbw = win.self_weight, dict(win.src_weights)
    else:
        sw = _weight(self_weight, "win_update: self_weight")
        nbw = _neighbor_weights(neighbor_weights, win.in_ranks, "win_update: neighbor_weights", "in",
                                st, win)
    flags = (_flag(reset, "win_update: reset"), _flag(clone, "win_update: clone"),
             _flag(require_mutex, "win_update: require_mutex"))
    with_p = _with_p

    def prepare(op_name):
        current = _current(win, op_name)
        return (lambda eng, op: _win_tasks.update(eng, op, win, sw, nbw, *flags, with_p, current),
                _written_back(win, flags[1], op_name))
    return _wait_owned(_submit(win, "WIN_UPDATE", prepare, True))


def win_update_then_collect(name, require_mutex=True):
    """self <- self + sum of all buffers, then zero the buffers: collects everything
    the in-neighbors accumulated since the last collect."""
    _, win = _window(name, "win_update_then_collect")
    return win_update(name, 1.0, {r: 1.0 for r in win.in_ranks}, reset=True,
                      require_mutex=require_mutex)


# ---- mutex, versions, push-sum weight ---------------------------------------------------

@contextlib.contextmanager
def win_mutex(name, for_self=False, ranks=None):
    """Hold the distributed mutex of window ``name`` on ``ranks`` (default: the
    out-neighbors, or this agent with for_self=True) for the body of the with-block.
    Window ops of this agent that require the same mutexes run inside it."""
    st, win = _window(name, "win_mutex")
    for_self = _flag(for_self, "win_mutex: for_self")
    if ranks is None:
        targets = [st.rank] if for_self else list(win.out_ranks)
    else:
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
            raise TypeError(f"win_mutex: ranks must be a list of ranks, got {ranks!r}")
        targets = [_rank(r, "win_mutex: rank", st.size) for r in ranks]
        if for_self:
            targets.append(st.rank)
    targets = sorted(set(targets))
    _wait_owned(_submit(win, "WIN_MUTEX", _no_copy(lambda eng, op: _win_tasks.mutex_acquire(eng, op, win, targets)),
                        True))
    win.mutex_blocks += 1
    try:
        yield
    finally:
        win.mutex_blocks -= 1
        _wait_owned(_submit(win, "WIN_MUTEX", _no_copy(lambda eng, op: _win_tasks.mutex_release(eng, op, win, targets)),
                            True))


def get_win_version(name):
    """{in-neighbor rank: number of puts/accumulates it made into this agent's buffer
    since this agent last read that buffer (win_update / win_get)}. A counted write
    has fully landed: the counter is bumped after the data."""
    _, win = _window(name, "get_win_version")
    with win.memory:
        if win.versions is None:        # (another thread's win_free has run)
            raise ValueError(f"get_win_version: window {name!r} is being freed (win_free)")
        return {r: int(win.versions[i]) for i, r in enumerate(win.in_ranks)}


def turn_on_win_ops_with_associated_p():
    """Carry a push-sum weight p with window ops (see win_associated_p)."""
    global _with_p
    _with_p = True


def turn_off_win_ops_with_associated_p():
    global _with_p
    _with_p = False


def win_associated_p(name):
    """The push-sum weight p of this agent's window: 1.0 at creation; win_put /
    win_accumulate send dst_weight * p and scale p by self_weight; win_update
    combines p with the same weights as the data."""
    _, win = _window(name, "win_associated_p")
    with win.memory:
        if win.p is None:       # (another thread's win_free has run: p was in its MPI memory)
            raise ValueError(f"win_associated_p: window {name!r} is being freed (win_free)")
        return float(win.p[0])

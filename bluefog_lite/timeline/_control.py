"""Turning the timeline on and off: the environment at init, timeline_start/timeline_stop
at run time, and the optimizer-step window.

Environment (read by init()):
  BLUEFOG_TIMELINE=PREFIX            every agent writes PREFIX<rank>.json
  BLUEFOG_TIMELINE_START_STEP=k      record from optimizer step k (counted from 0: the steps of
                                     the optimizer wrappers and of other torch.optim optimizers)
  BLUEFOG_TIMELINE_END_STEP=m        ... through step m, then finish the file
  BLUEFOG_TIMELINE_MARK_CYCLES=1     an instant event per communication-thread cycle
"""
import functools
import os
import socket
import sys
import threading
import time
import warnings
import weakref

from . import _clock, _recorder
from ._writer import COMM_TID, MAIN_TID, Writer

_session = None    # the open _Session, recording or waiting for its step window
_steps = 0         # optimizer steps completed since the timeline was configured
_clock_sync = None  # (offset_us, rtt_us, shared with rank 0) measured at init, or None
_run = (None, None)  # (id, rank 0's wall time at init): the same on every agent of a run (measure_clock)
_followers = weakref.WeakSet()   # objects told when a timeline opens or closes (follow)
_lock = threading.RLock()        # opening and closing files: callers may be on several threads
_torch_hooks = None      # torch's global optimizer step hooks, once a step window was configured
_stepping = threading.local()    # .stack: the optimizers whose step() runs on this thread, outermost first


def _locked(fn):
    @functools.wraps(fn)
    def locked(*args, **kwargs):
        with _lock:
            return fn(*args, **kwargs)
    return locked


def timeline_path(prefix, rank):
    return f"{prefix}{rank}.json"


_FROM_ENV = "check BLUEFOG_TIMELINE / --timeline-filename"


def _open_for_writing(path, check=_FROM_ENV):
    """The file descriptor of path (created/truncated); ValueError naming the path if
    impossible (check: where the prefix came from)."""
    folder = os.path.dirname(path) or "."
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"timeline: cannot write {path!r}: {folder!r} is not a directory "
                         f"({check})")
    if not os.path.isdir(folder):
        raise ValueError(f"timeline: cannot write {path!r}: directory {folder!r} does not exist "
                         f"({check})")
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as exc:
        raise ValueError(f"timeline: cannot write {path!r}: {exc.strerror} "
                         f"({check})") from None


def _check_prefix(prefix):
    if not isinstance(prefix, str) or not prefix:
        raise TypeError(f"prefix must be a non-empty string (files are PREFIX<rank>.json), got {prefix!r}")
    return prefix


class _Session:
    """One timeline file: opened at creation, written by its Writer once recording starts."""

    def __init__(self, prefix, st, start_step=0, end_step=None, fd=None):
        self.path = timeline_path(prefix, st.rank)
        if fd is None:
            fd = _open_for_writing(self.path)
        self.start_step, self.end_step = start_step, end_step
        self.recorder = _recorder.Recorder()
        names = {threading.main_thread().ident: "main"}
        engine_thread = getattr(st.engine, "_thread", None)
        if engine_thread is not None and engine_thread.ident is not None:
            names[engine_thread.ident] = "communication"
        self.recorder.thread_names.update(names)
        self.writer = Writer(fd, self.path, self.recorder, _metadata(prefix, st, start_step, end_step),
                             names)
        self.recording = False
        self.counts_torch_steps = False    # a step window: torch.optim optimizers' steps count
        self.identity = os.fstat(fd)[1:3]  # (inode, device): the file, however its path is written

    def record(self):
        self.writer.start()
        self.recording = True
        _recorder.current = self.recorder

    def close(self, at_shutdown=False):
        if _recorder.current is self.recorder:
            _recorder.current = None
        self.writer.close(time.perf_counter_ns())
        if at_shutdown and self.counts_torch_steps and not self.recording:
            warnings.warn(
                f"timeline {self.path}: the step window (BLUEFOG_TIMELINE_START_STEP={self.start_step}) never "
                f"opened: this agent made {_steps} optimizer steps (step() of an optimizer wrapper or of a "
                "torch.optim optimizer), so the file holds no events. Without an optimizer, record with "
                "bf.timeline_start(prefix) / bf.timeline_stop()", RuntimeWarning, stacklevel=2)

    def is_file(self, path):
        try:
            return os.stat(path)[1:3] == self.identity
        except OSError:
            return False


def _metadata(prefix, st, start_step, end_step):
    perf_ns, wall_ns = time.perf_counter_ns(), time.time_ns()
    offset, rtt, shared = _clock_sync if _clock_sync is not None else (0.0, None, None)
    return {
        "run_id": _run[0], "run_started_s": _run[1],
        "rank": st.rank, "size": st.size, "local_rank": st.local_rank, "local_size": st.local_size,
        "machine_rank": st.machine_rank, "hostname": socket.gethostname(), "os_pid": os.getpid(),
        "prefix": prefix,
        "clock": "perf_counter", "ts_unit": "us",
        "wall_time_of_ts0_us": (wall_ns - perf_ns) / 1000.0,
        "clock_offset_us": offset, "clock_offset_rtt_us": rtt,
        "clock_offset_measured": _clock_sync is not None, "clock_shared_with_rank0": shared,
        "start_step": start_step, "end_step": end_step,
        "main_tid": MAIN_TID, "communication_tid": COMM_TID,
    }


def _env_step(var):
    raw = os.environ.get(var, "")
    if raw.strip() == "":     # (empty or blank: the default, as for the other variables)
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{var} must be a non-negative integer (an optimizer step), got {raw!r}")
    return value


def _window_from_environment():
    start, end = _env_step("BLUEFOG_TIMELINE_START_STEP"), _env_step("BLUEFOG_TIMELINE_END_STEP")
    start = start or 0
    if end is not None and end < start:
        raise ValueError(f"BLUEFOG_TIMELINE_END_STEP ({end}) must be >= BLUEFOG_TIMELINE_START_STEP ({start})")
    return start, end


def measure_clock(st):
    """Called by init() on every agent (collective, ~1 ms at 4-8 agents): the
    clock offset to rank 0 that every timeline file of this run records, whether
    it is opened at init or later by timeline_start."""
    global _clock_sync, _run
    _clock_sync = _clock.measure_offset(st.comm)
    st.clock_offset_us = _clock_sync[0]
    # One id for the run, in every file it writes: the tools refuse to mix files of
    # different runs left under one prefix (a rerun that died before all agents
    # reopened their files)
    now = time.time()
    _run = st.comm.bcast((f"{socket.gethostname()}.{os.getpid()}.{now!r}", now) if st.rank == 0 else None, root=0)


@_locked
def start_from_environment():
    """Called at the end of init(), after measure_clock: opens PREFIX<rank>.json
    when BLUEFOG_TIMELINE is set."""
    global _steps
    start, end = _window_from_environment()     # (bad values refused even with no timeline)
    prefix = os.environ.get("BLUEFOG_TIMELINE", "")
    if not prefix:
        return
    from .._runtime import state
    st = state()
    _switch(prefix, st, _FROM_ENV, start, end)
    _steps = 0
    if start > 0 or end is not None:
        _count_torch_steps()
        _session.counts_torch_steps = True
    if start == 0:
        _session.record()
    _tell_followers()


def _count_torch_steps():
    """Register torch's global optimizer step hooks (once per process: never removed,
    as one may end the window while torch runs them; they count while a session
    with a step window is open). Only the outermost step() of a thread counts: an
    optimizer that steps another inside its step() (Lookahead, SAM) is one step."""
    global _torch_hooks
    if _torch_hooks is None:
        from torch.optim.optimizer import (register_optimizer_step_post_hook,    # (the tools do without torch)
                                           register_optimizer_step_pre_hook)
        _torch_hooks = (register_optimizer_step_pre_hook(_optimizer_steps),
                        register_optimizer_step_post_hook(_optimizer_stepped))


def _frames(skip):
    """The frames from the outermost to the one ``skip`` above this function's."""
    frames, frame = [], sys._getframe(skip)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()
    return frames


def _calls_in_step(frames):
    """This thread's optimizer step() calls in progress, outermost first, as
    (weak reference, depth, frame id, code) of the frame of torch's step wrapper
    that runs the hooks. A call that raised (torch runs no post-hook for it) stays
    on the stack: it is dropped once its frame is no longer at its depth in frames."""
    stack = getattr(_stepping, "stack", None)
    if stack is None:
        stack = _stepping.stack = []
    stack[:] = [c for c in stack if c[1] <= len(frames) and id(frames[c[1] - 1]) == c[2]
                and frames[c[1] - 1].f_code is c[3]]
    return stack


def _optimizer_steps(optimizer, args, kwargs):
    frames = _frames(2)      # (up to torch's step wrapper)
    stack = _calls_in_step(frames)
    while stack and stack[-1][1] >= len(frames):
        stack.pop()
    stack.append((weakref.ref(optimizer), len(frames), id(frames[-1]), frames[-1].f_code))


def _optimizer_stepped(optimizer, args, kwargs):
    frames = _frames(2)
    stack = _calls_in_step(frames)
    while stack and stack[-1][1] >= len(frames):   # this call
        stack.pop()
    session = _session
    # (an optimizer wrapper counts its own steps: wrapper_step; what it wraps steps inside it)
    if (not stack and not getattr(optimizer, "counts_own_timeline_steps", False)
            and session is not None and session.counts_torch_steps):
        step()


def wrapper_step(wrapper):
    """An optimizer wrapper's step() ends: it counts unless it runs inside another
    optimizer's step() (a Lookahead around the wrapper counts that step itself)."""
    if _session is None:
        return
    stack = _calls_in_step(_frames(2)) if _torch_hooks is not None else ()
    if stack and stack[0][0]() is not wrapper:
        return
    step()


@_locked
def timeline_start(prefix, mark_cycles=False):
    """Start writing PREFIX<rank>.json now (this agent only; not collective).

    A timeline already open on this agent is finished first. The clock offset in
    the file's metadata is the one measured at init."""
    _check_prefix(prefix)
    from .._runtime import state
    st = state()
    _switch(prefix, st, "check the prefix given to timeline_start")
    st.engine.mark_cycles = bool(mark_cycles) or st.engine.mark_cycles_env
    _session.record()
    _tell_followers()


@_locked
def timeline_stop():
    """Finish the open timeline file, if any (every open span is ended now)."""
    _close_session()
    _tell_followers()


def forget_in_forked_child():
    """In a child forked from an agent: the open file and its writer are the
    parent's (closing it here would end the parent's file in the middle), and a lock
    another thread held at the fork would stay held."""
    global _session, _lock
    _session, _lock = None, threading.RLock()


def _switch(prefix, st, check, start_step=0, end_step=None):
    """Open PREFIX<rank>.json as the session (check: where the prefix came from)."""
    global _session
    path = timeline_path(prefix, st.rank)
    if _session is not None and _session.is_file(path):
        _close_session()    # the open file itself: finished before it is opened again (truncated)
    session = _Session(prefix, st, start_step, end_step, _open_for_writing(path, check))
    failed = session.writer.failed      # its first lines (a full disk, a file size limit)
    if failed is not None:              # (writing nothing, it would only drop events)
        session.writer.close(time.perf_counter_ns())
        raise ValueError(f"timeline: cannot write {path!r}: {getattr(failed, 'strerror', None) or failed} "
                         f"({check})")
    # only now is the open file finished: a bad prefix leaves it alone, and the new
    # file holds its beginning (it loads) while the old one's backlog is written
    _close_session()
    _session = session


def _close_session(at_shutdown=False):
    global _session
    session, _session = _session, None
    if session is not None:
        session.close(at_shutdown)


@_locked
def stop_timeline():
    """Called by shutdown(), after the communication thread has stopped."""
    _close_session(at_shutdown=True)
    _tell_followers()


def follow(obj):
    """Call obj.timeline_changed() whenever a timeline file opens or closes on this
    agent (timeline_start/stop, the end of the step window, shutdown), for as long
    as obj lives: the optimizer wrappers install their compute hooks that way."""
    _followers.add(obj)


def _tell_followers():
    for obj in list(_followers):
        obj.timeline_changed()


def step():
    """Count one optimizer step; the optimizer wrappers call it at the end of step().

    Step 0 is everything up to and including the first call, step k everything
    after the k-th call up to and including the (k+1)-th. With
    BLUEFOG_TIMELINE_START_STEP=s and BLUEFOG_TIMELINE_END_STEP=e the file holds
    steps s..e and is finished by the call that ends step e."""
    global _steps
    _steps += 1
    if _session is None:
        return
    with _lock:
        session = _session
        if session is None:
            return
        if not session.recording and _steps >= session.start_step:
            session.record()
        elif session.recording and session.end_step is not None and _steps > session.end_step:
            _close_session()
            _tell_followers()


def configured():
    """True while a timeline file is open (recording now or waiting for its step
    window): the optimizer wrappers install compute hooks when this is true."""
    return _session is not None


def recording():
    return _recorder.current is not None

"""Runtime behaviour: size 1, errors before init/after shutdown, stall inspector, abort."""
import os
import re
from types import SimpleNamespace

import pytest

from bluefog_lite._stalls import StallInspector
from bluefog_lite._waits import Recv, Requests, Sleep, Turn
from mpi_helpers import Batch, run_agents, seconds_since

# workers of one agent count without environment of their own share a job (mpi_helpers.Batch)
PLAIN4 = Batch(4, {**{w: (w,) for w in ("runtime_topology.py", "runtime_late_init.py", "runtime_runs.py",
                                        "runtime_idle.py", "runtime_quick_loop.py")},
                   **{f"interrupted-{c}": ("runtime_interrupted.py", c) for c in ("window_small", "window_large")}},
               timeout=450)
WAKEUPS = ("missed_look", "handback", "announced", "many_files")
PLAIN2 = Batch(2, {"runtime_poll_loop.py": ("runtime_poll_loop.py",), "runtime_many_runs.py": ("runtime_many_runs.py",),
                   **{f"wakeups-{c}": ("runtime_wakeups.py", c) for c in WAKEUPS}}, timeout=360)


def test_single_agent_ops_are_self_weighted():
    run_agents(1, "runtime_single.py", timeout=60)


def test_stall_warning_names_op_and_missing_rank():
    _, out = run_agents(4, "runtime_stall.py", "warn", timeout=90, env={"BLUEFOG_STALL_WARNING_S": "1"})
    warned = re.findall(r"rank (\d)\): NEIGHBOR_ALLREDUCE 'late.op' has waited [\d.]+ s for ranks \[1\]", out)
    assert sorted(warned) == ["0", "2", "3"], out


def test_stall_warning_of_an_operation_waiting_for_its_own_sends_counts_from_its_start():
    _, out = run_agents(4, "runtime_stall.py", "sends", timeout=90, env={"BLUEFOG_STALL_WARNING_S": "1"})
    warned = re.findall(r"rank 0\): NEIGHBOR_ALLREDUCE '(oneway\.\w+)' has waited ([\d.]+) s for "
                        r"the completion of its own sends \(ranks \[[\d, ]+\] have not taken them\)", out)
    assert sorted(name for name, _ in warned) == ["oneway.loop", "oneway.quick"], out
    assert all(1.0 <= float(s) < 4.5 for _, s in warned), out     # (shown to 0.1 s; rank 1 takes them at 4 s)


class _Stalled:
    """An operation as the stall inspector sees it."""

    def __init__(self, name, wait, finished_task=False, sent_to=()):
        self.kind, self.name, self.wait, self.finished_task = "ALLREDUCE", name, wait, finished_task
        self.waiting_since, self.warned, self.riders = 0.0, False, ()
        self.data_requests = [(None, (None, dst)) for dst in sent_to]    # (request, (tensor, receiver))


class _Inspector(StallInspector):
    """The engine's state the inspector reads: rank 1's entry under 'a' is in."""

    def __init__(self, ops):
        self._active, self.rank, self._coll_seq = set(ops), 0, 0
        self.stall_warning_s, self.op_timeout_s = 1.0, 0.0
        self.stream = SimpleNamespace(inbox={}, has=lambda src, key: (src, key) == (1, "a"))


def test_stall_warning_says_what_an_operation_waits_for(capsys):
    """Each kind of wait in words: ranks only where the operation waits for ranks (a
    collective inside MPI, or behind an earlier collective, has none to name)."""
    ops = [_Stalled("a", Recv([(1, "a"), (2, "a"), (3, "a")])), _Stalled("b", Turn(4)),
           _Stalled("c", Requests([], "MPI_Iallreduce")), _Stalled("d", Sleep(0.0, "a neighbor's mutex")),
           _Stalled("e", Recv([(2, "e")]), finished_task=True, sent_to=[3, 1, 3])]
    _Inspector(ops)._inspect_stalls(10.0)
    said = dict(re.findall(r"ALLREDUCE '(\w)' has waited 10.0 s (.*)", capsys.readouterr().err))
    assert said == {"a": "for ranks [2, 3] that have not joined it",
                    "b": "for an earlier collective operation of this agent, which must start first",
                    "c": "inside MPI_Iallreduce (MPI does not say for which ranks)",
                    "d": "for a neighbor's mutex",
                    "e": "for the completion of its own sends (ranks [1, 3] have not taken them)"}, said


def test_stall_of_senders_and_receivers_that_disagree_names_the_unexpected_sender():
    _, out = run_agents(4, "runtime_stall.py", "mismatch", timeout=90, untaken_ok=True,
                        env={"BLUEFOG_STALL_WARNING_S": "1", "BLUEFOG_OP_TIMEOUT_S": "2.5"})
    warned = re.findall(r"rank (\d)\): PAIR_GOSSIP 'mismatched.pairs' has waited [\d.]+ s for ranks \[(\d)\] "
                        r"that have not joined it; ranks \[(\d)\] sent this agent data of that name", out)
    assert sorted(warned) == [(str(r), str((r + 1) % 4), str((r - 1) % 4)) for r in range(4)], out
    # the stray tensors are still there at shutdown, and each agent names its sender
    untaken = re.findall(r"rank (\d)\): at shutdown, data sent to this agent that no operation took: "
                         r"1 from rank (\d) under 'mismatched.pairs'\.", out)
    assert sorted(untaken) == [(str(r), str((r - 1) % 4)) for r in range(4)], out


def test_stall_of_an_agent_that_skipped_a_collective_names_the_collective_the_others_wait_in():
    """One agent calls neighbor_allreduce in static mode, the others with dst_weights
    and the topology check (a collective it never joins)."""
    _, out = run_agents(4, "runtime_stall.py", "unjoined", timeout=90, untaken_ok=True,
                        env={"BLUEFOG_STALL_WARNING_S": "1", "BLUEFOG_OP_TIMEOUT_S": "2.5"})
    # at shutdown rank 1 still holds the others' negotiation of the check (a collective's
    # message, named by the operation it belongs to), and they hold rank 1's data
    untaken = dict(re.findall(r"rank (\d)\): at shutdown, data sent to this agent that no operation took: "
                              r"(.*?)\. Either this agent", out))
    assert untaken == {"1": "1 from rank 0 under 'mixed.modes', 1 from rank 2 under 'mixed.modes', "
                            "1 from rank 3 under 'mixed.modes'",
                       **{r: "1 from rank 1 under 'mixed.modes'" for r in "023"}}, out


def test_fatal_timeout_raises_on_waiting_agents():
    run_agents(4, "runtime_stall.py", "fatal", timeout=90, untaken_ok=True, env={"BLUEFOG_OP_TIMEOUT_S": "2"})


def test_uncaught_exception_on_one_agent_ends_the_job():
    rc, out = run_agents(4, "runtime_abort.py", timeout=60, expect_ok=False)
    assert rc != 0, out
    assert "deliberate failure on rank 2" in out and "UNREACHABLE" not in out
    assert seconds_since(r"RAISING AT ([0-9.]+)", out) < 20, out      # (from the raise, not the start-up)


def test_set_topology_checks_and_refusal():
    PLAIN4.check("runtime_topology.py")


def test_after_a_caught_timeout_the_next_op_of_that_name_gets_fresh_data():
    run_agents(4, "runtime_timeout_stale.py", timeout=90, env={"BLUEFOG_OP_TIMEOUT_S": "1.5"})


def test_after_a_collective_times_out_later_collectives_refuse_instead_of_mixing_calls():
    _, out = run_agents(4, "runtime_timeout_collective.py", timeout=90, untaken_ok=True,
                        env={"BLUEFOG_OP_TIMEOUT_S": "2"})
    assert out.count("shutdown could not free the windows ['kept']: WIN_FREE 'win_free' cannot run") == 4, out


def test_a_collective_given_up_by_some_agents_is_refused_by_the_others_and_sequences_stay_in_step():
    """barrier and set_topology called by 2 of 4 agents time out there; the other two's
    next collective is refused naming them (before, it paired with the given-up call:
    barriers stopped waiting, set_topology left two topologies), and then barriers wait
    and set_topology agrees again (tests/workers/runtime_timeout_negotiation.py)."""
    run_agents(4, "runtime_timeout_negotiation.py", timeout=90, env={"BLUEFOG_OP_TIMEOUT_S": "3"})


def test_a_neighbor_and_a_hierarchical_call_under_one_name_are_named_and_leave_no_stale_data():
    """Rank 2's neighbor_allreduce against the others' hierarchical_neighbor_allreduce of one
    name: its timeout says ranks sent data of that name for another kind of operation, and
    no agent keeps data of those calls (tests/workers/runtime_timeout_kinds.py)."""
    run_agents(4, "runtime_timeout_kinds.py", timeout=90,
               env={"BLUEFOG_OP_TIMEOUT_S": "3", "BLUEFOG_RANKS_PER_MACHINE": "2"})


def test_a_fused_group_that_times_out_fails_every_member_and_leaves_no_stale_data():
    run_agents(4, "runtime_timeout_fused.py", timeout=90, env={"BLUEFOG_OP_TIMEOUT_S": "1.5"})


def test_an_operation_timing_out_inside_a_posted_mpi_call_keeps_its_memory_for_mpi():
    run_agents(1, "runtime_timeout_posted.py", timeout=60, env={"BLUEFOG_OP_TIMEOUT_S": "0.5"})


def test_shutdown_waiting_for_an_unfinished_operation_does_not_spin():
    _, out = run_agents(2, "runtime_stop_sleeps.py", timeout=60, untaken_ok=True,
                        env={"BLUEFOG_STALL_WARNING_S": "2"})
    assert "shutdown with operations still in flight: ['lonely']" in out


@pytest.mark.parametrize("mode", ["nested", "nested_lock", "nested_shutdown", "finalize", "fork"])
def test_signal_handlers_mpi_finalize_and_fork_around_an_agent(mode):
    """A bf call from a signal handler inside a blocking call raises (it hung);
    a nested shutdown returns and the one cut short finishes at exit; MPI.Finalize()
    shuts bluefog_lite down first (segmentation fault) and init() after it raises;
    a forked child is not an agent."""
    run_agents(2, "runtime_process_edges.py", mode, timeout=90)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="MPICH keeps its segments in /dev/shm on Linux")
@pytest.mark.parametrize("end", ["kill", "raise"])
def test_a_killed_job_leaves_no_shared_memory_segment_nor_hardware_description(end):
    """MPICH removes its segment's name only in MPI_Finalize, and its process manager
    the hardware description it wrote to /tmp only when no agent called MPI_Abort; a
    job that ends another way (here an agent killed with SIGKILL, or an uncaught
    exception's MPI_Abort) left 2-4 MB of RAM in /dev/shm (both ways) and a 5 KB file
    in /tmp (the abort; hydra removes it after a SIGKILL itself, so "kill" checks the
    segment only in effect) for good."""
    rc, out = run_agents(2, "runtime_killed_segment.py", end, timeout=60, expect_ok=False)
    assert rc != 0, out
    for what in ("SEGMENTS", "DESCRIPTIONS"):
        lines = [line.split()[2:] for line in out.splitlines() if line.startswith(what + " ")]
        paths = {p for line in lines for p in line}
        assert len(lines) == 2 and paths, out      # (the pip MPICH has one of each per host)
        assert not [p for p in paths if os.path.exists(p)], (paths, out)


def test_init_waiting_for_a_late_agent_does_not_spin():
    PLAIN4.check("runtime_late_init.py")


def test_a_send_never_taken_times_out_and_the_receiver_still_gets_it():
    run_agents(2, "runtime_send_waits.py", "timeout", timeout=60, env={"BLUEFOG_OP_TIMEOUT_S": "1.5"})


def test_a_timeout_on_its_sends_alone_does_not_drop_the_next_calls_input():
    run_agents(2, "runtime_send_waits.py", "stale", timeout=60, untaken_ok=True, env={"BLUEFOG_OP_TIMEOUT_S": "1.5"})


def test_a_send_to_an_agent_that_left_without_taking_it_ends_the_job():
    rc, out = run_agents(2, "runtime_send_waits.py", "departed", timeout=60, expect_ok=False)
    assert rc != 0
    assert ("rank 0: NEIGHBOR_ALLREDUCE 'oneway' waits for rank 1 to take the tensor it sent, but rank 1 has "
            "left the job") in out, out


def test_a_busy_poll_loop_lets_the_communication_thread_run():
    PLAIN2.check("runtime_poll_loop.py")


def test_an_operation_interrupted_in_synchronize_stays_done(tmp_path):
    """Ctrl-C caught around synchronize (tests/workers/runtime_interrupted.py): the
    operation is done, its handle synchronizes again, and nothing counts as in flight."""
    _, out = run_agents(4, "runtime_interrupted.py", "synchronize", str(tmp_path), timeout=90)
    assert "INTERRUPTED DONE" in out, "the KeyboardInterrupt did not come after the wait: the test tested nothing"


@pytest.mark.parametrize("caller_progress", ["1", "0"])
def test_an_interrupted_blocking_call_frees_its_name_once_done(caller_progress):
    """Ctrl-C caught around a blocking call (tests/workers/runtime_interrupted.py):
    the operation whose only handle the call held frees its name when it is done,
    whether the call waited running the loop itself (the quick path's) or on the thread."""
    _, out = run_agents(4, "runtime_interrupted.py", "blocking", timeout=90,
                        env={"BLUEFOG_CALLER_PROGRESS": caller_progress})
    assert "INTERRUPTED" in out


def test_a_run_s_late_messages_never_reach_the_next_run():
    """init() again after shutdown() (tests/workers/runtime_runs.py): notices sent at the
    end of one run and received after it ended are not taken by a later run."""
    PLAIN4.check("runtime_runs.py")


def test_many_runs_in_one_process_do_not_run_out_of_communicators():
    """tests/workers/runtime_many_runs.py: 1200 init()/shutdown() runs (MPICH has ~2000
    communicators; each run keeps its two only until the init() after next)."""
    PLAIN2.check("runtime_many_runs.py")


@pytest.mark.parametrize("case", ["window_small", "window_large"])
def test_a_blocking_call_interrupted_on_the_quick_path_leaves_no_inputs_behind(case):
    """tests/workers/runtime_interrupted.py: a blocking call interrupted while it
    waits on the quick path (small or large tensor) becomes an operation that takes
    its inputs; the name's next call averages its own round, exactly."""
    PLAIN4.check(f"interrupted-{case}")     # (rank 0 checks that the call was interrupted on the quick path)


@pytest.mark.parametrize("case", WAKEUPS)
def test_the_communication_thread_wakes_for_its_work(case):
    """tests/workers/runtime_wakeups.py: with the MPI pokes at 1 s, no operation
    waits for one (a lost wake-up) and a doorbell descriptor >= 1024 works."""
    PLAIN2.check(f"wakeups-{case}")


def test_idle_thread_sleeps_long_and_still_takes_operations():
    PLAIN4.check("runtime_idle.py")


def test_a_loop_of_quick_calls_lets_the_communication_thread_sleep():
    PLAIN4.check("runtime_quick_loop.py")


def test_byte_and_switch_variables_are_checked(monkeypatch):
    """Numbers of bytes are integers >= 0; switches 1/0 (true/false, yes/no, on/off,
    any case), empty as documented; anything else names the variable."""
    from bluefog_lite._engine import _env_flag, _env_int
    for raw, want in (("0", 0), ("65536", 65536), ("", 7)):
        monkeypatch.setenv("BLUEFOG_INLINE_LIMIT", raw)
        assert _env_int("BLUEFOG_INLINE_LIMIT", 7) == want
    for raw in ("-1", "1.5", "lots"):
        monkeypatch.setenv("BLUEFOG_INLINE_LIMIT", raw)
        with pytest.raises(ValueError, match=f"BLUEFOG_INLINE_LIMIT must be a number of bytes "
                                             rf"\(an integer >= 0\), got '{raw}'"):
            _env_int("BLUEFOG_INLINE_LIMIT", 7)
    for raw, want in (("1", True), ("On", True), ("yes", True), ("0", False), ("false", False), (" off ", False),
                      ("", False)):
        monkeypatch.setenv("BLUEFOG_CALLER_PROGRESS", raw)
        assert _env_flag("BLUEFOG_CALLER_PROGRESS", True, empty=False) is want, raw
    monkeypatch.delenv("BLUEFOG_CALLER_PROGRESS")
    assert _env_flag("BLUEFOG_CALLER_PROGRESS", True, empty=False) is True
    for raw in ("2", "abc"):
        monkeypatch.setenv("BLUEFOG_CALLER_PROGRESS", raw)
        with pytest.raises(ValueError, match=rf"BLUEFOG_CALLER_PROGRESS must be 1 or 0 \(on or off\), got '{raw}'"):
            _env_flag("BLUEFOG_CALLER_PROGRESS", True, empty=False)


@pytest.mark.parametrize("name,value,words", [
    ("BLUEFOG_CALLER_PROGRESS", "false-ish", "BLUEFOG_CALLER_PROGRESS must be 1 or 0 (on or off), got 'false-ish'"),
    ("BLUEFOG_TIMELINE_MARK_CYCLES", "2", "BLUEFOG_TIMELINE_MARK_CYCLES must be 1 or 0 (on or off), got '2'"),
    ("BLUEFOG_BUFFER_POOL_BYTES", "-5", "BLUEFOG_BUFFER_POOL_BYTES must be a number of bytes (an integer >= 0)"),
    # (without BLUEFOG_TIMELINE too: it was read only with a timeline)
    ("BLUEFOG_TIMELINE_START_STEP", "abc", "BLUEFOG_TIMELINE_START_STEP must be a non-negative integer"),
])
def test_init_refuses_a_bad_setting(name, value, words):
    rc, out = run_agents(1, "rel_init_fails.py", timeout=60, expect_ok=False, env={name: value})
    assert rc != 0 and words in out and "PAST INIT" not in out, out[-3000:]


def test_init_warns_when_mpi_runs_below_thread_multiple():
    run_agents(1, "runtime_thread_level.py", timeout=60)

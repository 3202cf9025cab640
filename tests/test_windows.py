"""One-sided windows (SPEC section 4): numerics against numpy models, asynchrony
while the target computes, mutual exclusion, asynchronous push-sum, errors.

Each test runs a worker from tests/workers on several agents under mpiexec with a
hard timeout, so a deadlock fails the test instead of hanging the suite."""
import pytest

from mpi_helpers import Batch, run_agents

# workers of one agent count without arguments or environment share a job (mpi_helpers.Batch)
PLAIN = {4: Batch(4, {w: (w,) for w in ("win_ops.py", "win_many.py", "win_errors.py", "win_mutex_sleeps.py")},
                  timeout=450),
         8: Batch(8, {w: (w,) for w in ("win_ops.py", "win_mutex.py")}, timeout=300)}

@pytest.mark.parametrize("nprocs", [4, 8])
def test_window_ops_match_numpy_model(nprocs):
    """put / accumulate (default, list and dict dst_weights, self_weight), get with
    src_weights, update (default / explicit weights, reset, clone), then_collect,
    versions, nonblocking forms, associated p, weighted topology, int windows."""
    PLAIN[nprocs].check("win_ops.py")


def test_single_agent_windows_are_well_defined():
    run_agents(1, "win_single.py", timeout=60)


def test_puts_complete_while_target_computes(tmp_path):
    """A 1 MB put / accumulate (with the target's mutex) / get finishes while the
    target computes without calling bluefog (it computes until they are done, at
    most 30 s); the target then sees the data."""
    _, out = run_agents(4, "win_async.py", tmp_path, timeout=120)
    assert "put on a busy target took" in out
    assert "the target computed for" in out


def test_mutex_excludes_and_accumulation_is_exact():
    PLAIN[8].check("win_mutex.py")


@pytest.mark.parametrize("nprocs, graph", [(4, "ring"), (8, "exp")])
def test_async_push_sum_reaches_exact_average(nprocs, graph):
    _, out = run_agents(nprocs, "win_pushsum.py", graph, timeout=150)
    assert "iterations per agent" in out


def test_windows_up_to_mpich_limit_then_a_clear_error():
    PLAIN[4].check("win_many.py")


def test_window_errors_are_raised_everywhere_without_hanging():
    PLAIN[4].check("win_errors.py")


def test_window_calls_failing_on_one_agent_fail_everywhere_or_leave_nothing_behind():
    """win_create failing on one agent before or after the allocation raises on every
    agent and leaves no window; a win_accumulate that cannot allocate sends nothing; a
    failed win_update gives the version counts back (tests/workers/win_failures.py)."""
    run_agents(4, "win_failures.py", "steps", timeout=120, env={"BLUEFOG_OP_TIMEOUT_S": "20"})


def test_an_agent_stuck_in_a_blocking_window_allocation_warns_and_times_out():
    """MPI_Win_allocate failing on one agent: the others, blocked inside it, warn and raise
    OpTimeout naming it (the stall inspector cannot run on their blocked thread)."""
    _, out = run_agents(4, "win_failures.py", "blocked", timeout=90,
                        env={"BLUEFOG_STALL_WARNING_S": "1", "BLUEFOG_OP_TIMEOUT_S": "4"})
    for r in (0, 2, 3):
        assert (f"WARNING (rank {r}): WIN_CREATE 'win_create' has waited" in out
                and "inside MPI_Win_allocate of window 'w'" in out), out


def test_mutex_wait_warns_then_times_out():
    _, out = run_agents(2, "win_timeout.py", timeout=60,
                        env={"BLUEFOG_STALL_WARNING_S": "1", "BLUEFOG_OP_TIMEOUT_S": "3"})
    assert "waited" in out and "for the mutex of window 'held' on rank 0 (held by rank 0)" in out


def test_waiting_for_a_held_mutex_sleeps():
    PLAIN[4].check("win_mutex_sleeps.py")

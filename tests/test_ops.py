"""Multi-agent tests of the operations of SPEC section 3 (workers in tests/workers/)."""
import pytest

from mpi_helpers import Batch, run_agents

# workers of one agent count and environment share a job (mpi_helpers.Batch: a launch
# costs ~4.5 s at 4 agents and ~8.5 s at 8 here, more than most workers' own work)
PLAIN = {n: Batch(n, {w: (w,) for w in ("ops_neighbor.py", "ops_collective.py", "ops_fused_groups.py", "ops_quick.py")
                      + (("ops_fusion.py",) if n == 4 else ())}, timeout=600) for n in (4, 8)}
MACHINES_OF_2 = Batch(4, {w: (w,) for w in ("ops_hierarchical.py", "ops_integer_ranges.py", "ops_extremes.py")},
                      timeout=300, env={"BLUEFOG_RANKS_PER_MACHINE": "2"})


@pytest.mark.parametrize("n", [4, 8])
def test_neighbor_ops_match_mixing_matrix(n):
    PLAIN[n].check("ops_neighbor.py")


@pytest.mark.parametrize("n", [4, 8])
def test_collectives_match_numpy(n):
    PLAIN[n].check("ops_collective.py")


@pytest.mark.parametrize("n,per", [(4, 2), (8, 2), (8, 4)])
def test_hierarchical_with_emulated_machines(n, per):
    if (n, per) == (4, 2):
        MACHINES_OF_2.check("ops_hierarchical.py")
    else:
        run_agents(n, "ops_hierarchical.py", timeout=120, env={"BLUEFOG_RANKS_PER_MACHINE": str(per)})


def test_integer_averages_at_the_ends_of_the_range_and_a_bad_topology_check_flag_on_one_agent():
    """No wrapped machine sums or casts (int64 near 2**62 and 2**63, uint64 2**64 - 1); receiving
    weights beyond an integer dtype raise; a refused enable_topo_check raises everywhere at once."""
    MACHINES_OF_2.check("ops_integer_ranges.py")


def test_uneven_emulated_machines_refuse_hierarchical_naming_the_layout():
    run_agents(3, "ops_uneven_machines.py", timeout=90, env={"BLUEFOG_RANKS_PER_MACHINE": "2"})


def test_fusion_small_ops_share_messages():
    PLAIN[4].check("ops_fusion.py")


def test_fusion_disabled_still_correct():
    run_agents(4, "ops_fusion.py", "nofusion", timeout=120, env={"BLUEFOG_FUSION_THRESHOLD": "0"})


def test_input_may_change_as_soon_as_the_op_returns():
    run_agents(2, "ops_input_reuse.py", timeout=90)


def test_data_of_operations_not_started_stays_with_the_sender():
    run_agents(2, "ops_running_ahead.py", timeout=90)


def test_data_of_the_next_round_of_a_name_stays_with_the_sender():
    run_agents(3, "ops_running_ahead_same_name.py", timeout=90)


@pytest.mark.parametrize("n", [4, 8])
def test_fused_groups_match_numpy_when_agents_group_differently(n):
    PLAIN[n].check("ops_fused_groups.py")


def test_a_fused_group_completes_its_members_one_by_one_when_agents_order_calls_differently():
    """Rank 0 fuses a and b and waits for a before calling c; the others call a, c, b,
    blocking: without splitting the group (after SPLIT_AFTER_S) this deadlocks."""
    _, out = run_agents(4, "ops_fusion_order.py", timeout=60)
    assert "FUSED ROUNDS 6" in out, out[-2000:]      # (the scenario needs its calls in one group)


def test_a_member_of_a_fused_group_that_nobody_sends_times_out_alone():
    """Rank 0 fuses a and b; the others never call b: a completes, b times out (named)."""
    _, out = run_agents(4, "ops_fusion_order.py", "never-b", timeout=60, untaken_ok=True,
                        env={"BLUEFOG_OP_TIMEOUT_S": "2"})
    assert "B TIMED OUT" in out


def test_a_split_group_keeps_its_large_send_until_a_late_receiver_takes_it():
    run_agents(4, "ops_fusion_order.py", "large", timeout=60)


def test_shutdown_names_a_split_group_whose_large_send_nobody_takes():
    _, out = run_agents(4, "ops_fusion_order.py", "shut", timeout=60, untaken_ok=True,
                        env={"BLUEFOG_STALL_WARNING_S": "2"})
    assert "still in flight: [] (and the sends of the split fused group ['a', 'b', 'c'])" in out, out[-3000:]


def test_a_fused_group_waiting_only_for_its_send_is_not_split():
    """Its task finished at once (inputs already in); its slab waits for a slow
    receiver: it was split, took the next round's inputs and crashed the thread."""
    run_agents(3, "ops_fused_sends.py", "late", timeout=90)


def test_a_fused_group_whose_send_times_out_fails_every_member():
    run_agents(3, "ops_fused_sends.py", "timeout", timeout=60, env={"BLUEFOG_OP_TIMEOUT_S": "2"})


def test_a_failed_call_still_sends_what_it_sent_to_a_late_receiver():
    # (the receiver that never comes is told at shutdown)
    run_agents(4, "ops_failed_sends.py", timeout=90, untaken_ok=True, env={"BLUEFOG_STALL_WARNING_S": "30"})


def test_a_call_that_fails_before_sending_fails_its_receivers_at_once():
    """An agent whose call fails after its arguments were accepted, before it sent its
    data (packing, allocation), tells the agents waiting for it: each neighbor op kind
    (alone, fused, large, scaled, run by the caller, machine-local, hierarchical) fails
    on them naming the agent and its error instead of waiting (BLUEFOG_OP_TIMEOUT_S turns
    a wait into a failure), and the next call of each name matches numpy; the agents
    that got its data before it failed take no note. A collective that fails there after
    the agents agreed on it: on every agent, the next ones run; on one, its next MPI
    collective waits instead of pairing with the others' pending call."""
    run_agents(4, "ops_failed_packing.py", timeout=120,
               env={"BLUEFOG_OP_TIMEOUT_S": "5", "BLUEFOG_RANKS_PER_MACHINE": "2"})


@pytest.mark.parametrize("mode", ["on", "off"])
def test_blocking_calls_run_by_their_caller_match_numpy_and_mix_with_nonblocking_agents(mode):
    env = {"BLUEFOG_CALLER_PROGRESS": "1" if mode == "on" else "0"}
    run_agents(4, "ops_caller_progress.py", mode, timeout=120, env=env)


@pytest.mark.parametrize("n", [4, 8])
def test_quick_blocking_calls_match_numpy_late_neighbors_threads_and_errors(n):
    PLAIN[n].check("ops_quick.py")


@pytest.mark.parametrize("n", [4, 8])
def test_quick_blocking_calls_of_large_tensors_match_numpy_late_neighbors_threads_and_errors(n):
    run_agents(n, "ops_quick.py", "large", timeout=150, env={"BLUEFOG_INLINE_LIMIT": "256"})


def test_unnamed_calls_on_several_threads_get_distinct_names():
    """The generated names of unnamed calls come from one counter per kind: callers on
    several threads must never get the same number (with a read-then-store counter and
    thread switches every microsecond, ~7% of them did)."""
    import sys
    import threading
    from bluefog_lite import ops
    names, per_thread = [], 20000

    def generate():
        mine = [ops._op_name(None, "THREAD_TEST") for _ in range(per_thread)]
        names.extend(mine)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=generate) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert len(names) == 4 * per_thread
    assert len(set(names)) == len(names), f"{len(names) - len(set(names))} names given twice"


def test_values_near_the_dtype_limit_stay_finite():
    MACHINES_OF_2.check("ops_extremes.py")


def test_a_name_whose_call_was_refused_without_its_sources_is_refused_after():
    run_agents(4, "ops_refused_name.py", timeout=90, untaken_ok=True, env={"BLUEFOG_RANKS_PER_MACHINE": "2"})

"""Shutdown: it waits for every agent, says whom it waits for, frees windows with late agents;
the timing variables it reads."""
import re
import types

import pytest

from bluefog_lite import _departures
from mpi_helpers import run_agents, seconds_since


def test_shutdown_names_the_agent_it_waits_for():
    _, out = run_agents(3, "late_shutdown.py", timeout=60, env={"BLUEFOG_STALL_WARNING_S": "1"})
    warned = re.findall(r"rank (\d)\): shutdown has waited \d+ s for ranks \[(.*?)\] to shut down too", out)
    assert sorted(warned) == [("0", "1"), ("2", "1")], out


def test_shutdown_frees_windows_with_a_late_agent_past_the_op_timeout():
    _, out = run_agents(3, "late_shutdown.py", "window", timeout=60,
                        env={"BLUEFOG_STALL_WARNING_S": "1", "BLUEFOG_OP_TIMEOUT_S": "1"})
    assert "timed out" not in out, out
    warned = re.findall(r"rank (\d)\): WIN_FREE 'win_free' has waited [\d.]+ s for ranks \[(.*?)\]", out)
    assert sorted(warned) == [("0", "1"), ("2", "1")], out


class _Notice:
    """A notice request that is done once asked (it came in after Testall looked)."""
    def __init__(self, done):
        self.done = done

    def Test(self):
        return self.done


def test_no_warning_names_nobody_when_the_last_notice_lands_meanwhile(monkeypatch, capsys):
    looks = iter([False, False, True])     # Testall: two misses, then everything is in
    stub = types.SimpleNamespace(Request=types.SimpleNamespace(Testall=lambda reqs: next(looks)))
    monkeypatch.setattr(_departures, "MPI", stub)
    waiter = types.SimpleNamespace(engine=types.SimpleNamespace(stall_warning_s=0.0))
    _departures.Departures._wait(waiter, [], {1: [_Notice(True)], 2: [_Notice(True), _Notice(True)]}, 0)
    assert "shut down too" not in capsys.readouterr().err

    looks = iter([False, True])
    _departures.Departures._wait(waiter, [], {1: [_Notice(True)], 2: [_Notice(True), _Notice(False)]}, 0)
    assert "for ranks [2] to shut down too" in capsys.readouterr().err


def test_an_agent_is_not_leaving_while_its_own_operation_is_in_flight():
    run_agents(4, "leave_in_flight.py", timeout=60, env={"BLUEFOG_RANKS_PER_MACHINE": "2"})


@pytest.mark.parametrize("warning_s", ["60", "inf"])
def test_an_agent_whose_operation_nobody_joins_leaves_at_once(warning_s):
    rc, out = run_agents(2, "leave_unjoined.py", timeout=60, expect_ok=False,
                         env={"BLUEFOG_STALL_WARNING_S": warning_s})
    assert rc != 0 and "rank 1: ALLREDUCE 'b' waits for rank 0, which has left the job" in out, out
    elapsed = seconds_since(r"rank 0 leaves at ([0-9.]+)", out)     # (from the leaving, not the start-up)
    assert elapsed < 20, f"took {elapsed:.0f} s:\n{out}"


def test_timing_variables_are_checked_and_inf_means_never(monkeypatch):
    from bluefog_lite._engine import _env_float
    monkeypatch.setenv("BLUEFOG_STALL_WARNING_S", "inf")
    assert _env_float("BLUEFOG_STALL_WARNING_S", 60.0, infinite_ok=True) == float("inf")
    for raw, infinite_ok in (("nan", True), ("-1", True), ("inf", False), ("soon", True)):
        monkeypatch.setenv("BLUEFOG_STALL_WARNING_S", raw)
        with pytest.raises(ValueError, match=f"BLUEFOG_STALL_WARNING_S must be a number of seconds, got '{raw}'"):
            _env_float("BLUEFOG_STALL_WARNING_S", 60.0, infinite_ok)


def test_a_stall_warning_of_inf_shuts_down_cleanly():
    # the shutdown's wait for the communication thread took it as a timeout: OverflowError
    run_agents(3, "late_shutdown.py", timeout=60, env={"BLUEFOG_STALL_WARNING_S": "inf"})


def test_an_exception_passing_through_shutdown_is_printed():
    """try/finally: bf.shutdown() on the agent that raised; the others end the job."""
    rc, out = run_agents(3, "leave_in_finally.py", timeout=60, expect_ok=False)
    assert rc != 0 and "waits for rank 1, which has left the job" in out, out
    assert "bluefog_lite: rank 1: shutdown() called during this exception" in out, out
    assert "ValueError: bad batch on rank 1" in out, out


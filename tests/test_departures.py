"""Shutdown waits for every agent to shut down too, and says whom it waits for."""
import re
import types

from bluefog_lite import _departures
from mpi_helpers import run_agents


def test_shutdown_names_the_agent_it_waits_for():
    _, out = run_agents(3, "late_shutdown.py", timeout=60, env={"BLUEFOG_STALL_WARNING_S": "1"})
    warned = re.findall(r"rank (\d)\): shutdown has waited \d+ s for ranks \[(.*?)\] to shut down too", out)
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
    _departures.Departures._wait(waiter, [], {1: _Notice(True), 2: _Notice(True)}, 0)
    assert "shut down too" not in capsys.readouterr().err

    looks = iter([False, True])
    _departures.Departures._wait(waiter, [], {1: _Notice(True), 2: _Notice(False)}, 0)
    assert "for ranks [2] to shut down too" in capsys.readouterr().err

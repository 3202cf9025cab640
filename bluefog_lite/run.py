"""The launcher behind ``bfrun``: find the MPI launcher, build its command line, run the job.

This module imports only the standard library, on purpose: each MPICH rank runs
it (by file path, see ``_rank_guard``) in front of the user's program, and that
must neither pull in torch nor initialise MPI.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Mapping, NamedTuple, Optional

NO_LAUNCHER_HINT = (
    "install the mpich wheel (pip install mpich) or put mpiexec/mpirun on PATH")
USAGE_ERROR = 2
SHUTDOWN_GRACE_S = 10.0     # the default of BLUEFOG_SHUTDOWN_GRACE_S
_RANK_GUARD_FLAG = "--_rank-guard"
_NO_STATUS_DIR = "-"
_PR_SET_PDEATHSIG = 1   # prctl(2)
_RELAYED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_RELAY_AS = {signal.SIGHUP: signal.SIGTERM}     # (Hydra's mpiexec dies of SIGHUP without passing it on)
# Open MPI does not forward the environment to remote ranks: bfrun names every variable
# with -x (as Bluefog's bfrun and horovodrun do), but exported shell functions, the
# shell's OLDPWD and names Open MPI cannot take.
_OPENMPI_UNFORWARDED = re.compile(r"BASH_FUNC_.*|OLDPWD|.*[^A-Za-z0-9_].*|[0-9].*")
_OPTIONS_WITH_VALUE = ("-np", "-n", "--num-proc", "-H", "--hosts", "--hostfile", "-hostfile", "--timeline-filename")
_HYDRA_MARKERS = ("HYDRA", "MPICH", "Intel(R) MPI")
_OPENMPI_MARKERS = ("Open MPI", "OpenRTE", "PRRTE", "prterun")


class Launcher(NamedTuple):
    """An MPI launcher executable and the command-line dialect it speaks."""

    path: str
    flavor: str  # "mpich" (Hydra: MPICH, Intel MPI, MVAPICH) or "openmpi"


class LauncherNotFound(RuntimeError):
    """No usable ``mpiexec``/``mpirun`` could be found."""


# --------------------------------------------------------------------------
# Finding the launcher

def find_launcher() -> Launcher:
    """Return the MPI launcher to use and its flavor.

    Order: ``$BLUEFOG_MPIEXEC`` if set (and then nothing else), else the
    installed ``mpich`` wheel's own (in a virtual environment next to
    ``sys.executable``; a ``pip install --user`` puts it in ~/.local/bin), else
    ``mpiexec`` next to ``sys.executable``, else ``mpiexec`` then ``mpirun`` on
    ``PATH``.
    Raises :class:`LauncherNotFound` with a message saying what to install.
    """
    override = os.environ.get("BLUEFOG_MPIEXEC")
    if override:
        path = shutil.which(override)
        if path is None:
            raise LauncherNotFound(
                f"no MPI launcher found: BLUEFOG_MPIEXEC={override!r} is not an "
                f"executable file; fix it or unset it, or {NO_LAUNCHER_HINT}")
        return Launcher(path, detect_flavor(path))
    path = default_mpiexec()
    if path is None:
        raise LauncherNotFound(f"no MPI launcher found: {NO_LAUNCHER_HINT}")
    return Launcher(path, detect_flavor(path))


def default_mpiexec() -> Optional[str]:
    """The launcher found without ``$BLUEFOG_MPIEXEC`` (see find_launcher), or None;
    nothing is run (the test helpers and run_all.py launch with it)."""
    for path in _default_candidates():
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def _default_candidates():
    """The paths find_launcher tries, in order (found lazily)."""
    wheel = _mpich_wheel_mpiexec()
    if wheel:
        yield wheel
    if sys.executable:
        yield os.path.join(os.path.dirname(sys.executable), "mpiexec")
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found:
            yield found


def _mpich_wheel_mpiexec() -> Optional[str]:
    """The mpiexec that the installed mpich wheel brought, or None."""
    import importlib.metadata     # (~1 ms: only bfrun and the launching helpers look)
    try:
        files = importlib.metadata.distribution("mpich").files or ()
    except Exception:       # (not installed, or its metadata unreadable: look elsewhere)
        return None
    for f in files:
        if f.name == "mpiexec" and len(f.parts) > 1 and f.parts[-2] == "bin":
            return os.path.normpath(str(f.locate()))
    return None


def detect_flavor(path: str) -> str:
    """Tell MPICH/Hydra from Open MPI by what ``<path> --version`` prints."""
    try:
        result = subprocess.run([path, "--version"], stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LauncherNotFound(
            f"MPI launcher {path!r} does not run ('{path} --version' failed: {exc}); "
            f"set BLUEFOG_MPIEXEC to a working one, or {NO_LAUNCHER_HINT}") from exc
    text = result.stdout + result.stderr
    if result.returncode != 0 and not any(word in text for word in ("mpiexec", "mpirun", "MPI")):
        # (Hydra and Open MPI print their version and exit 0; MPICH's gforker prints its usage, naming
        # mpiexec, and exits 255: it runs as MPICH, with the warning below)
        raise LauncherNotFound(
            f"MPI launcher {path!r} does not run ('{path} --version' failed: exit code {result.returncode}"
            + (f", {text.strip().splitlines()[-1][:200]!r}" if text.strip() else "")
            + f"); set BLUEFOG_MPIEXEC to a working one, or {NO_LAUNCHER_HINT}")
    # Hydra's output lists its configure options, which could name anything;
    # its banner is unambiguous, so look for it first.
    if "HYDRA build details" in text:
        return "mpich"
    if any(marker in text for marker in _OPENMPI_MARKERS):
        return "openmpi"
    if any(marker in text for marker in _HYDRA_MARKERS):
        return "mpich"
    print(f"bfrun: warning: cannot tell which MPI {path!r} belongs to from its "
          "--version output; assuming MPICH (Hydra) options", file=sys.stderr)
    return "mpich"


# --------------------------------------------------------------------------
# Arguments

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _count(text: str) -> bool:
    """True if text is a positive process count in ASCII digits (str.isdigit() takes
    "²", which int() refuses, and int() takes "٢", on which Hydra crashed)."""
    return re.fullmatch(r"[0-9]+", text) is not None and int(text) > 0


def _host_list(text: str) -> str:
    for entry in text.split(","):
        host, colon, slots = entry.partition(":")
        if not host or host != host.strip() or (colon and not _count(slots)):
            raise argparse.ArgumentTypeError(
                f"expected host1:n1,host2:n2,... (n a positive integer), got {text!r}")
    return text


def _make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bfrun", allow_abbrev=False,
        description="Launch a bluefog_lite job: run COMMAND as N MPI ranks.",
        epilog="Example: bfrun -np 4 python examples/cnn_patterns.py --epochs 2")
    parser.add_argument("-np", "-n", "--num-proc", dest="np", type=_positive_int, metavar="N",
                        help="number of ranks (processes) to start")
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", dest="hosts", type=_host_list,
                       metavar="HOST:N,...", help="hosts and ranks per host")
    hosts.add_argument("--hostfile", "-hostfile", dest="hostfile", metavar="FILE",
                       help="file listing the hosts: host:n (MPICH) or host slots=n (Open MPI) per line; "
                            "either works with either launcher")
    parser.add_argument("--timeline-filename", metavar="PREFIX",
                        help="record a timeline: rank r writes PREFIX<r>.json")
    parser.add_argument("--timeline-mark-cycles", action="store_true",
                        help="mark each communication-thread cycle in the timeline")
    parser.add_argument("--extra-mpi-flags", default="", metavar="FLAGS",
                        help="more launcher flags, one shell-quoted string")
    parser.add_argument("--no-rank-guard", dest="rank_guard", action="store_false",
                        help="MPICH only: do not run the guard that stops the job "
                             "when one rank exits with an error")
    parser.add_argument("--verbose", action="store_true",
                        help="print the launcher command line before running it")
    parser.add_argument("-v", "--version", action="store_true",
                        help="print the bluefog_lite version and the MPI launcher found")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the program to run on every rank, and its arguments")
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse bfrun's arguments; exits with code 2 and a message on bad ones."""
    parser = _make_parser()
    args = parser.parse_args(_attach_extra_mpi_flags(sys.argv[1:] if argv is None else argv))
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if args.version:
        return args
    if args.np is None:
        parser.error("the following arguments are required: -np "
                     "(the number of ranks, e.g. bfrun -np 4 python train.py)")
    if not args.command:
        parser.error("missing command: give the program to run on every rank, "
                     "e.g. bfrun -np 4 python train.py")
    try:
        shlex.split(args.extra_mpi_flags or "")
    except ValueError as exc:
        parser.error(f"--extra-mpi-flags {args.extra_mpi_flags!r}: {exc} (one shell-quoted string)")
    return args


def _attach_extra_mpi_flags(argv: List[str]) -> List[str]:
    """Turn ``--extra-mpi-flags -v`` into ``--extra-mpi-flags=-v``.

    argparse refuses an option value that looks like an option, and MPI flags
    always do; only bfrun's own options (before the command) are touched.
    """
    argv = list(argv)
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        if argv[i] == "--extra-mpi-flags" and i + 1 < len(argv):
            argv[i:i + 2] = [f"--extra-mpi-flags={argv[i + 1]}"]
        elif argv[i] in _OPTIONS_WITH_VALUE:
            i += 1
        i += 1
    return argv


def _check_paths(args: argparse.Namespace) -> Optional[str]:
    """Return what is wrong with the files named in ``args``, or None."""
    if args.hostfile and not os.path.isfile(args.hostfile):
        return f"--hostfile: {args.hostfile!r} is not a file"
    if args.hostfile:
        problem = _hostfile_problem(args.hostfile)
        if problem:
            return f"--hostfile {args.hostfile!r}: {problem}"
    if args.timeline_filename is not None:
        if not args.timeline_filename:
            return "--timeline-filename: the prefix is empty"
        directory = os.path.dirname(_absolute_prefix(args.timeline_filename))
        if os.path.exists(directory) and not os.path.isdir(directory):
            return f"--timeline-filename: {directory!r} is not a directory"
        if not os.path.isdir(directory):
            return (f"--timeline-filename: directory {directory!r} does not exist "
                    "(create it first)")
        problem = _cannot_create_files_in(directory)
        if problem:
            return f"--timeline-filename: directory {directory!r} is not writable ({problem})"
    return None


def _hostfile_problem(path: str) -> Optional[str]:
    """What is wrong with a hostfile's host entries, or None. A line names a host,
    first, optionally with its process count (MPICH: ``host:n``; Open MPI's
    ``host slots=n`` has no colon); a count that is not a positive integer made
    MPICH's launcher die of a floating-point exception, with no message."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot read it ({exc})"
    hosts = 0
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        host, colon, count = words[0].partition(":")
        if "=" in words[0]:     # (a keyword first: " slots=2" was taken for a host name)
            return f"line {number} {line.strip()!r}: names no host (a line starts with the host name: host slots=4)"
        # (two colons or more: an IPv6 address (Open MPI), or MPICH's host:n:interface: not checked)
        if ":" not in count and (not host or (colon and not _count(count))):
            return (f"line {number} {line.strip()!r}: expected a host name, optionally with a positive process "
                    "count (host:4)")
        slots = _slots(words)
        if slots is not None and not _count(slots):
            return f"line {number} {line.strip()!r}: slots must be a positive integer (host slots=4)"
        hosts += 1
    return None if hosts else "it names no host"


def _slots(words: List[str]) -> Optional[str]:
    """The value of an Open MPI hostfile line's slots=n (also slots = n), or None."""
    found = re.search(r"(?:^|\s)slots\s*=\s*(\S*)", " ".join(words[1:]))
    return found.group(1) if found else None


_OPENMPI_KEYWORD = re.compile(r"(?:^|\s)(?:slots|max_slots|max-slots)\s*=")


def _mpich_hostfile(path: str) -> Optional[str]:
    """The text of Open MPI's hostfile ``path`` (``host slots=n``, Bluefog's documented
    format) in MPICH's format (``host:n``), or None if it needs no change: Hydra failed
    on Open MPI's keywords with a screenful of its own parse errors. Keywords with no
    MPICH counterpart (max_slots=) are dropped, and so are comments after a host (Hydra
    takes whole-line comments only); a second host on a line is refused (Hydra refused
    it after starting). Hydra's own key=value words (user=, binding=) are kept."""
    def rewrite(line: str, words: List[str]) -> Optional[str]:
        if not _OPENMPI_KEYWORD.search(" ".join(words[1:])):
            bare = [w for w in words[1:] if "=" not in w]
            if bare:
                raise ValueError(f"line {line.strip()!r}: MPICH's launcher takes one host per line (host or "
                                 f"host:n, then only key=value words such as user=...), not {' '.join(bare)!r}")
            return " ".join(words) if "#" in line else None
        slots = _slots(words)
        if words[0].count(":") >= 2 and slots is not None:
            raise ValueError(f"line {line.strip()!r}: MPICH's launcher takes host:n, which cannot hold the IPv6 "
                             f"address {words[0]}: name the host, or use host:n lines")
        if ":" in words[0] and slots is not None:
            raise ValueError(f"line {line.strip()!r}: gives its count twice, as host:n and as slots=n: keep one")
        return words[0] if slots is None else f"{words[0]}:{slots}"
    return _rewritten_hostfile(path, rewrite)


def _openmpi_hostfile(path: str) -> Optional[str]:
    """The text of MPICH's hostfile ``path`` (``host:n``) in Open MPI's format
    (``host slots=n``), or None if it has no host:n line: Open MPI read "a:2" as a
    host name. (Two colons or more: an IPv6 address, left as it is.)"""
    def rewrite(line: str, words: List[str]) -> Optional[str]:
        host, colon, count = words[0].partition(":")
        if colon and ":" not in count and _count(count):
            return " ".join([host, f"slots={count}"] + words[1:])
        return None
    return _rewritten_hostfile(path, rewrite)


def _rewritten_hostfile(path: str, rewrite) -> Optional[str]:
    """The text of hostfile ``path`` with each line that names a host replaced by
    rewrite(line, its words before any comment) unless that is None; None if no
    line was."""
    with open(path) as f:
        lines = f.read().splitlines()
    out, translated = [], False
    for line in lines:
        words = line.split("#", 1)[0].split()
        new = rewrite(line, words) if words else None
        out.append(line if new is None else new)
        translated |= new is not None
    return "\n".join(out) + "\n" if translated else None


def _cannot_create_files_in(directory: str) -> Optional[str]:
    """Why no file can be created in directory, or None. Tried for real:
    os.access says yes to root even where the file system refuses."""
    try:
        fd, path = tempfile.mkstemp(prefix=".bfrun-probe-", dir=directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(path)
    return None


def _absolute_prefix(prefix: str) -> str:
    """prefix from the root: ranks may start in another working directory. Not
    normalized: the files are PREFIX<rank>.json as text ("out/." must write
    "out/.0.json", as BLUEFOG_TIMELINE=out/. does, not "out0.json" beside out/)."""
    prefix = os.path.expanduser(prefix)
    return prefix if os.path.isabs(prefix) else os.path.join(os.getcwd(), prefix)


# --------------------------------------------------------------------------
# Command line

def bluefog_env(args: argparse.Namespace) -> Dict[str, str]:
    """The BLUEFOG_* variables that bfrun sets for every rank."""
    env = {}
    if args.timeline_filename:
        env["BLUEFOG_TIMELINE"] = _absolute_prefix(args.timeline_filename)
    if args.timeline_mark_cycles:
        env["BLUEFOG_TIMELINE_MARK_CYCLES"] = "1"
    return env


def build_command(args: argparse.Namespace, launcher: Launcher,
                  environ: Optional[Mapping[str, str]] = None,
                  status_dir: Optional[str] = None) -> List[str]:
    """Return the launcher command line that runs ``args.command`` on ``args.np`` ranks.

    ``environ`` (default ``os.environ``) is the environment the launcher will
    get: Open MPI is told to forward its variables (but _OPENMPI_UNFORWARDED ones)
    and not to bind ranks. With MPICH every rank runs behind the rank guard unless
    ``args.rank_guard`` is false; ``status_dir`` is where the guards record a
    failing rank's exit code.
    """
    environ = os.environ if environ is None else environ
    extra_flags = shlex.split(args.extra_mpi_flags or "")
    dashed = args.command[0].startswith("-")     # (bfrun -np 2 -- -prog: the launcher must not read it)
    if launcher.flavor == "openmpi":
        # Open MPI binds each rank to a core (np <= 2) or a socket unless told otherwise: the
        # communication thread and torch's threads would share it (Hydra does not bind)
        unbound = [] if _binds(extra_flags, environ) else ["--bind-to", "none"]
        return (_openmpi_options(args, launcher.path, environ) + unbound + extra_flags + ["--"] * dashed
                + args.command)
    if launcher.flavor == "mpich":
        rank_command = list(args.command)
        if getattr(args, "rank_guard", True):
            rank_command = [sys.executable, "-I", os.path.abspath(__file__), _RANK_GUARD_FLAG,
                            status_dir or _NO_STATUS_DIR, *rank_command]
        elif dashed:    # (Hydra takes no "--": env runs it)
            rank_command = ["env", "--", *rank_command]
        return _mpich_options(args, launcher.path) + extra_flags + rank_command
    raise ValueError(f"launcher flavor must be 'mpich' or 'openmpi', got {launcher.flavor!r}")


_BINDING_FLAGS = ("bind-to", "bind-to-core", "bind-to-socket", "cpus-per-proc", "cpus-per-rank", "rankfile",
                  "cpu-set", "cpu-list")
_BINDING_VARS = ("OMPI_MCA_hwloc_base_binding_policy", "PRTE_MCA_hwloc_default_binding_policy")


def _binds(extra_flags: List[str], environ: Mapping[str, str]) -> bool:
    """The user chose Open MPI's binding (extra flags or its environment): bfrun adds none."""
    for f in extra_flags:
        name = f.lstrip("-").split("=", 1)[0]
        if name in _BINDING_FLAGS or "pe=" in f.lower() or "binding_policy" in f:
            return True
    return any(environ.get(v) for v in _BINDING_VARS)


def _mpich_options(args: argparse.Namespace, path: str) -> List[str]:
    options = [path, "-n", str(args.np)]
    if args.hosts:
        options += ["-hosts", args.hosts]
    elif args.hostfile:
        options += ["-f", args.hostfile]
    # Hydra forwards the whole environment by default; -genv makes the
    # variables bfrun sets visible in --verbose and survives a -genvnone.
    for name, value in bluefog_env(args).items():
        options += ["-genv", name, value]
    return options


def _openmpi_options(args: argparse.Namespace, path: str,
                     environ: Mapping[str, str]) -> List[str]:
    options = [path, "-np", str(args.np), "--oversubscribe"]
    if os.geteuid() == 0:
        options.append("--allow-run-as-root")
    if args.hosts:
        options += ["-H", args.hosts]
    elif args.hostfile:
        options += ["--hostfile", args.hostfile]
    set_env = bluefog_env(args)
    for name, value in set_env.items():
        options += ["-x", f"{name}={value}"]
    for name in sorted(environ):
        if name and name not in set_env and not _OPENMPI_UNFORWARDED.fullmatch(name):
            options += ["-x", name]
    return options


# --------------------------------------------------------------------------
# Running the job

def main(argv: Optional[List[str]] = None) -> int:
    """Run bfrun with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [_RANK_GUARD_FLAG]:
        return _rank_guard(argv[1], argv[2:])
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse: bad arguments (2) or --help (0)
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR
    if args.version:
        _print_version()
        return 0
    problem = _check_paths(args)
    if problem:
        return _fail(problem)
    try:
        grace = shutdown_grace(os.environ)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        launcher = find_launcher()
    except LauncherNotFound as exc:
        return _fail(str(exc))
    status_dir = translated_hostfile = None
    if launcher.flavor == "mpich" and args.rank_guard:
        status_dir = tempfile.mkdtemp(prefix="bfrun-status-")
    try:
        if args.hostfile:
            try:
                text = (_mpich_hostfile if launcher.flavor == "mpich" else _openmpi_hostfile)(args.hostfile)
            except ValueError as exc:
                return _fail(f"--hostfile {args.hostfile!r}: {exc}")
            if text is not None:
                fd, translated_hostfile = tempfile.mkstemp(prefix="bfrun-hosts-", text=True)
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                args.hostfile = translated_hostfile
        command = build_command(args, launcher, os.environ, status_dir)
        if args.verbose:
            print(f"bfrun: {shlex.join(command)}", file=sys.stderr, flush=True)
        env = dict(os.environ, **bluefog_env(args))
        code = _run_job(command, env, grace)
        failed_rank_code = _first_failure(status_dir)
        if code != 0 and failed_rank_code is not None:
            code = failed_rank_code
        return code
    finally:
        if status_dir:
            shutil.rmtree(status_dir, ignore_errors=True)
        if translated_hostfile:
            os.unlink(translated_hostfile)


def shutdown_grace(environ: Mapping[str, str]) -> float:
    """Seconds the job has to end after a signal to bfrun before it is killed:
    $BLUEFOG_SHUTDOWN_GRACE_S (a checkpoint written on SIGTERM may need longer than
    the default; SLURM waits 30 s between SIGTERM and SIGKILL by default)."""
    text = environ.get("BLUEFOG_SHUTDOWN_GRACE_S", "").strip()
    if not text:
        return SHUTDOWN_GRACE_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"BLUEFOG_SHUTDOWN_GRACE_S must be a number of seconds > 0, got {text!r}")
    return value


def _fail(message: str) -> int:
    print(f"bfrun: error: {message}", file=sys.stderr)
    return USAGE_ERROR


def _print_version() -> None:
    import importlib.metadata  # here, not at the top: the rank guard skips its cost

    try:
        bluefog_version = importlib.metadata.version("bluefog_lite")
    except importlib.metadata.PackageNotFoundError:
        bluefog_version = "unknown"
    print(f"bfrun (bluefog_lite {bluefog_version})")
    try:
        launcher = find_launcher()
        print(f"MPI launcher: {launcher.path} ({launcher.flavor})")
    except LauncherNotFound as exc:
        print(f"MPI launcher: none ({exc})")


def _run_job(command: List[str], env: Mapping[str, str], grace: float = SHUTDOWN_GRACE_S) -> int:
    """Run the launcher in its own process group; relay SIGINT/SIGTERM/SIGHUP/SIGQUIT
    to it (and, on Linux, the kernel sends it SIGTERM if bfrun is killed outright).
    SIGHUP goes on as SIGTERM: Hydra passes SIGTERM to the ranks, while SIGHUP kills
    it at once. A SIGHUP ignored when bfrun starts (nohup) stays ignored, and the
    launcher inherits that, as it would run without bfrun; SIGINT and SIGQUIT, which
    a shell script's background jobs start with ignored, are relayed all the same
    (Hydra takes them whatever it inherits).

    After the first signal the launcher has ``grace`` seconds to stop
    the ranks (Hydra forwards the signal to every rank's process group, and a
    second one makes it abort at once), then its group gets SIGKILL, which
    makes Hydra's proxies kill the ranks.
    """
    received: List[int] = []
    process: List[subprocess.Popen] = []

    def relay(signum, _frame):
        received.append(signum)
        if process:
            _signal_group(process[0], _RELAY_AS.get(signum, signum))

    previous = {}
    try:
        for signum in _RELAYED_SIGNALS:
            if signum != signal.SIGHUP or signal.getsignal(signum) != signal.SIG_IGN:
                previous[signum] = signal.signal(signum, relay)
    except ValueError:  # not the main thread: no relaying possible
        pass
    terminal = _is_terminal(0)
    try:
        try:
            process.append(subprocess.Popen(command, env=env, start_new_session=True,
                                            stdin=subprocess.PIPE if terminal else None,
                                            preexec_fn=_stop_with(os.getpid())))
        except OSError as exc:
            return _fail(f"cannot start the MPI launcher {command[0]!r}: {exc}")
        if terminal:
            threading.Thread(target=_relay_typing, args=(0, process[0].stdin, _in_foreground),
                             name="bfrun-stdin", daemon=True).start()
        if received:  # a signal came before the launcher existed
            _signal_group(process[0], _RELAY_AS.get(received[0], received[0]))
        code = _wait_with_deadline(process[0], received, grace)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:
        return 128 + received[0]
    if code < 0:
        print(f"bfrun: the MPI launcher {command[0]!r} was killed by signal {_signal_name(-code)}",
              file=sys.stderr, flush=True)
    return code if code >= 0 else 128 - code


def _is_terminal(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _in_foreground() -> bool:
    """True while bfrun's process group is its terminal's foreground job, or if the
    terminal is not bfrun's controlling one (no job control: reading it is safe)."""
    try:
        return os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return True


def _relay_typing(fd: int, pipe, foreground) -> None:
    """Copy what is typed on the terminal fd to the launcher (rank 0's stdin) while
    foreground() says bfrun is the terminal's foreground job. The launcher runs in a
    session of its own (so that the terminal's signals reach it only through bfrun);
    given the terminal itself, Hydra read it also while bfrun ran in the background
    (bfrun ... &, or stopped with Ctrl-Z), taking the shell's input."""
    try:
        while True:
            if not foreground():
                time.sleep(0.1)
                continue
            ready, _, _ = select.select([fd], [], [], 0.1)
            if not ready or not foreground():
                continue
            data = os.read(fd, 65536)
            if not data:
                break           # end of input (Ctrl-D)
            pipe.write(data)
            pipe.flush()
    except (OSError, ValueError):     # the launcher has ended (a broken pipe), or the terminal has gone
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _signal_name(number: int) -> str:
    """SIGFPE, ... or the number (a real-time signal has no name)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _stop_with(parent: int):
    """For the launcher's process, before it runs: on Linux, have the kernel send it
    SIGTERM when bfrun dies, whatever kills bfrun (SIGKILL cannot be relayed), so
    that the job does not go on alone in its own session."""
    def preexec():
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):     # not Linux: nothing to do
            return
        if os.getppid() != parent:            # bfrun died before the prctl
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec


def _wait_with_deadline(proc: subprocess.Popen, received: List[int], grace: float) -> int:
    deadline = None
    while True:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if received and deadline is None:
            deadline = time.monotonic() + grace
        elif deadline is not None and time.monotonic() > deadline:
            print(f"bfrun: the job did not stop within {grace:g} s of the signal; killing it "
                  "(BLUEFOG_SHUTDOWN_GRACE_S gives it longer)", file=sys.stderr, flush=True)
            _signal_group(proc, signal.SIGKILL)
            return proc.wait()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _first_failure(status_dir: Optional[str]) -> Optional[int]:
    """The exit code recorded by the first rank guard that saw its rank fail."""
    if not status_dir or not os.path.isdir(status_dir):
        return None
    records = []
    for name in os.listdir(status_dir):
        path = os.path.join(status_dir, name)
        try:
            with open(path) as record:
                records.append((os.stat(path).st_mtime_ns, int(record.read())))
        except (OSError, ValueError):
            continue
    return min(records)[1] if records else None


# --------------------------------------------------------------------------
# The rank guard (runs on every MPICH rank, in front of the user's program)

def _rank_guard(status_dir: str, command: List[str]) -> int:
    """Run ``command`` as this rank; if it fails, take the whole job down.

    Hydra stops the other ranks only when a rank dies by a signal or exits
    after MPI_Init without MPI_Finalize; a rank that exits non-zero before
    MPI_Init (or without MPI at all) leaves the others running. So the guard,
    seeing a failure, records the exit code for bfrun and kills itself with
    SIGTERM, which Hydra treats as a bad termination. The child stays in the
    guard's process group, where Hydra sends its signals and its SIGKILL.
    (A rank that reaches MPI_Finalize waits there for the others: only
    MPI_Abort, which bluefog_lite's abort-on-exception calls, helps then.)
    """
    received: List[int] = []
    for signum in _RELAYED_SIGNALS:
        signal.signal(signum, lambda s, _f: received.append(s))
    rank = os.environ.get("PMI_RANK", "?")
    try:
        # close_fds=False: the child must inherit Hydra's PMI_FD socket.
        child = subprocess.Popen(command, close_fds=False)
        code = child.wait()
    except OSError as exc:
        print(f"bfrun: rank {rank}: cannot run {command[0]!r}: {exc}",
              file=sys.stderr, flush=True)
        code = 127
    if code == 0:
        return 0
    exit_code = code if code > 0 else 128 - code
    if received:  # the job is being stopped anyway: just report the status
        return exit_code
    if code > 0:
        what = f"exited with code {code}"
    else:
        what = f"was killed by signal {_signal_name(-code)}"
    print(f"bfrun: rank {rank} {what}; stopping the job", file=sys.stderr, flush=True)
    _record_failure(status_dir, rank, exit_code)
    for signum in _RELAYED_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    return exit_code


def _record_failure(status_dir: str, rank: str, exit_code: int) -> None:
    # The directory exists only on the host that runs bfrun; elsewhere the
    # code is lost and bfrun reports the launcher's own exit code.
    if status_dir == _NO_STATUS_DIR or not os.path.isdir(status_dir):
        return
    try:
        with open(os.path.join(status_dir, f"rank{rank}"), "w") as record:
            record.write(str(exit_code))
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())

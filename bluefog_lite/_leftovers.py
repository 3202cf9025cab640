"""Names of files that MPICH removes only in a clean finish, removed as soon as
every agent has started, so that a job ending any other way (an exception's
MPI_Abort, a killed or departed agent, SIGTERM) leaves nothing behind.

Both are used only while the agents start: once all have arrived in init()
(bf.init waits for that first), the names can go and what they name lives on
while it is open or mapped. Only files this process maps, or its launcher holds,
are touched; without MPICH (or without /proc) nothing is."""
import os

_SEGMENT = "/dev/shm/mpich_shm_"
_TOPOLOGY_FILE = "/tmp/hydra_hwloc_xmlfile_"
_PROXY = "hydra_pmi_proxy"


def remove_names():
    for path in _shared_memory_segments() | _topology_files():
        try:
            os.unlink(path)
        except OSError:     # (another agent of the host was first)
            pass


def _shared_memory_segments():
    """MPICH's shared-memory segment (/dev/shm/mpich_shm_*, 2-4 MB of RAM per host
    and job): a test machine had gathered 1400 of them, 4.7 GB."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[5].rstrip("\n") for line in maps if _SEGMENT in line}
    except OSError:      # (no /proc)
        return set()
    return _still_named(paths, _SEGMENT)


def _topology_files():
    """The hardware description (/tmp/hydra_hwloc_xmlfile_*, ~5 KB) that MPICH's
    process manager on each host writes for its agents' MPI_Init and holds open;
    every aborted job left one in /tmp. It is found among the files of the
    nearest ancestor that is that process manager (the agent's parent, unless a
    wrapper such as a shell runs in between)."""
    pid = os.getppid()
    for _ in range(4):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            return set()
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if name == _PROXY:
            return _open_files(pid, _TOPOLOGY_FILE)
        pid = int(rest[1])      # (the field after the state: the parent's pid)
        if pid <= 1:
            return set()
    return set()


def _open_files(pid, prefix):
    paths = set()
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return paths
    for fd in descriptors:
        try:
            paths.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:     # (closed meanwhile)
            pass
    return _still_named(paths, prefix)


def _still_named(paths, prefix):
    """Those of paths (as /proc shows them) under prefix whose name was not removed yet."""
    return {p for p in paths if p.startswith(prefix) and not p.endswith(" (deleted)")}

"""A job that ends without MPI_Finalize anywhere (an agent killed or aborting) must not leave
MPICH's shared-memory segment in /dev/shm nor its process manager's hardware
description in /tmp: each agent prints the segments it maps and the description
its parent (MPICH's hydra_pmi_proxy) holds open, rank 1 ends, rank 0
waits in a barrier until the job is taken down. argv: "kill" (rank 1 is killed
with SIGKILL) or "raise" (an uncaught exception on rank 1: bluefog_lite calls
MPI_Abort). tests/test_runtime.py checks that none of the printed paths exists
afterwards."""
import os
import signal
import sys

import bluefog_lite as bf

bf.init()
with open("/proc/self/maps") as maps:
    paths = sorted({line.split(maxsplit=5)[5].rstrip("\n").removesuffix(" (deleted)")
                    for line in maps if "/dev/shm/mpich_shm_" in line})
descriptions = set()
for fd in os.listdir(f"/proc/{os.getppid()}/fd"):
    try:
        descriptions.add(os.readlink(f"/proc/{os.getppid()}/fd/{fd}").removesuffix(" (deleted)"))
    except OSError:
        pass
descriptions = sorted(p for p in descriptions if p.startswith("/tmp/hydra_hwloc_xmlfile_"))
sys.stdout.write(f"SEGMENTS {bf.rank()} {' '.join(paths)}\n"      # (one write: print's newline is another,
                 f"DESCRIPTIONS {bf.rank()} {' '.join(descriptions)}\n")   # and the agents' lines interleaved)
sys.stdout.flush()
bf.barrier()
if bf.rank() == 1:
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("rank 1 fails")
bf.barrier()

"""A job whose agent is killed (SIGKILL: no MPI_Finalize anywhere) must not leave
MPICH's shared-memory segment in /dev/shm: each agent prints the segments it maps,
rank 1 kills itself, rank 0 waits in a barrier until the job is taken down.
tests/test_runtime.py checks that none of the printed paths exists afterwards."""
import os
import signal
import sys

import bluefog_lite as bf

bf.init()
with open("/proc/self/maps") as maps:
    paths = sorted({line.split(maxsplit=5)[5].rstrip("\n").removesuffix(" (deleted)")
                    for line in maps if "/dev/shm/mpich_shm_" in line})
sys.stdout.write(f"SEGMENTS {bf.rank()} {' '.join(paths)}\n")     # (one write: print's newline is another,
sys.stdout.flush()                                                   # and the agents' lines interleaved)
bf.barrier()
if bf.rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
bf.barrier()

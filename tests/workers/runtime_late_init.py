"""init() waiting for a late agent sleeps: with MPI started before init() (mpi4py
imported first, as a script that uses it may do) and rank 0 calling init() 2 s after
the others, the others' init() took 2 s of CPU spinning in MPI's blocking calls
(MPICH polls with sched_yield); it now waits in a sleeping rendezvous."""
import sys
import time

from mpi4py import MPI    # MPI_Init here, on every agent

import bluefog_lite as bf
import bluefog_lite._runtime  # noqa: F401  (torch and the library's modules imported before
import bluefog_lite.ops  # noqa: F401       the measure: 3 agents importing torch at once on 2 cores
#                                           took more CPU than the late one importing it alone)

r = MPI.COMM_WORLD.rank
MPI.COMM_WORLD.Barrier()      # (a start together: rank 0 is late by its sleep only)
if r == 0:
    time.sleep(2.0)
cpu0, t0 = time.process_time(), time.monotonic()
bf.init()
cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
# init()'s own work (imports, the communication thread...) is what the late agent's took
own_cpu, own_wall = MPI.COMM_WORLD.bcast((cpu, wall) if r == 0 else None, root=0)
if r != 0:
    assert wall - own_wall > 1.5, f"init() returned after {wall:.2f} s, before the late agent came"
    assert cpu - own_cpu < 0.3 * (wall - own_wall), \
        f"init() used {cpu - own_cpu:.2f} s of CPU more than the late agent's, waiting {wall - own_wall:.2f} s for it"
bf.shutdown()
sys.stdout.write(f"AGENT OK {r}\n")

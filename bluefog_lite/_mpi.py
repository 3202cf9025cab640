"""Deferred MPI import: importing bluefog_lite (e.g. for bfrun) must not start MPI."""
import mpi4py

# MPI starts in init(), not at import time. Respect a user who imported
# mpi4py.MPI first (then MPI is already running and these flags are moot).
if "mpi4py.MPI" not in __import__("sys").modules:
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = True
    mpi4py.rc.thread_level = "multiple"

from mpi4py import MPI  # noqa: E402  (after the rc settings on purpose)

__all__ = ["MPI", "retire", "free_retired"]

# The communicators of ended runs (shutdown). A message sent to an agent that it had
# not received when its run ended (a refusal notice, a large send nobody took) stays
# in MPI's queue under its communicator's context id; freed at once, that id went to
# the next init()'s communicator, and the message was taken as that run's data. So a
# run's communicators are freed only at the init() after next, once drained: by then
# (a whole run later, whose init and shutdown waited for every agent) everything
# the run's peers sent has arrived.
_retired = []     # [(comm, the number of the run that ended with it)]
_runs = 0


def retire(comm):
    """Keep comm, the ending run's, unfreed until free_retired."""
    _retired.append((comm, _runs))


def free_retired():
    """At init(): drain and free the communicators of the runs before the last (see
    _retired), then count this run."""
    global _runs
    status = MPI.Status()
    while _retired and _retired[0][1] < _runs:
        comm = _retired.pop(0)[0]
        looks = 3        # (an MPICH probe may only move a message into MPI's queue)
        while looks:
            msg = comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if msg is None:
                looks -= 1
            else:
                msg.Recv([bytearray(status.Get_count(MPI.BYTE)), MPI.BYTE])
        comm.Free()
    _runs += 1

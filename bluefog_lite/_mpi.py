"""Deferred MPI import: importing bluefog_lite (e.g. for bfrun) must not start MPI."""
import mpi4py

# MPI starts in init(), not at import time. Respect a user who imported
# mpi4py.MPI first (then MPI is already running and these flags are moot).
if "mpi4py.MPI" not in __import__("sys").modules:
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = True
    mpi4py.rc.thread_level = "multiple"

from mpi4py import MPI  # noqa: E402  (after the rc settings on purpose)

__all__ = ["MPI"]

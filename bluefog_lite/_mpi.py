"""Deferred MPI import: importing bluefog_lite (e.g. for bfrun) must not start MPI."""
import mpi4py

# MPI starts in init(), not at import time. Respect a user who imported
# mpi4py.MPI first (then MPI is already running and these flags are moot).
if "mpi4py.MPI" not in __import__("sys").modules:
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = True
    mpi4py.rc.thread_level = "multiple"

from mpi4py import MPI  # noqa: E402  (after the rc settings on purpose)

__all__ = ["MPI", "retire"]

# The communicators of ended runs (shutdown), kept and never freed: a message sent to
# an agent that it had not received when its run ended (a refusal notice, a large
# send nobody took) would otherwise reach the next init()'s communicator, which MPICH
# gives the freed one's context id, and be taken as that run's data. Two per run, of
# MPICH's ~2000 context ids.
_retired = []


def retire(comm):
    """Keep comm, unfreed, for the life of the process (see _retired)."""
    _retired.append(comm)

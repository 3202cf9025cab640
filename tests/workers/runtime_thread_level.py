"""MPI initialized by the program below MPI_THREAD_MULTIPLE: bf.init() warns, naming
the fix (the library calls MPI from two threads)."""
import warnings

import mpi4py

mpi4py.rc.thread_level = "serialized"
from mpi4py import MPI  # noqa: E402,F401  (initializes MPI at that level)

import bluefog_lite as bf  # noqa: E402

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    bf.init()
texts = [str(w.message) for w in caught if w.category is RuntimeWarning]
assert any("MPI was initialized without MPI_THREAD_MULTIPLE" in t and "thread level" in t for t in texts), texts
assert bf.mpi_threads_supported() is False
bf.shutdown()
print("AGENT OK 0", flush=True)

"""An operation that times out while an MPI call it posted is still running (here a
receive nothing has matched yet; in real use a nonblocking collective or an RMA
call) fails with OpTimeout, but the memory MPI writes into stays alive, and is
written, when the call completes later, instead of being freed under MPI.
One agent; BLUEFOG_OP_TIMEOUT_S is set by the test."""
import gc
import weakref

import numpy as np

import bluefog_lite as bf
from bluefog_lite._mpi import MPI
from bluefog_lite._runtime import state
from bluefog_lite._stalls import OpTimeout
from bluefog_lite._waits import Requests

bf.init()
eng = state().engine
comm = MPI.COMM_WORLD.Dup()
buffers = []


def task(e, op):
    buf = np.zeros(4)                     # nothing but the task's frame (and MPI) holds it
    buffers.append(weakref.ref(buf))
    req = comm.Irecv(buf, source=0, tag=77)
    yield Requests([req], "a receive nothing has sent yet")
    return buf


try:
    bf.synchronize(eng.submit("posted", "TEST", task))
    raise AssertionError("the operation should have timed out")
except OpTimeout as exc:
    assert "a receive nothing has sent yet" in str(exc), exc
gc.collect()
buf = buffers[0]()
assert buf is not None, "the buffer of the posted receive was freed while MPI may still write into it"
comm.Send(np.arange(4.0), dest=0, tag=77)   # the receive completes now, into that buffer
np.testing.assert_array_equal(buf, np.arange(4.0))
print("AGENT OK 0", flush=True)
bf.shutdown()

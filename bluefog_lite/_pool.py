"""A bounded pool of receive buffers, so that repeated large receives reuse memory
instead of faulting in fresh pages every time."""
import threading

import numpy as np


class BufferPool:
    def __init__(self, max_bytes):
        self.max_bytes = max_bytes
        self._free = {}     # nbytes -> [array], the size given back least recently first
        self._held = 0
        self._lock = threading.Lock()

    def take(self, nbytes):
        """A uint8 array of nbytes and the function that gives it back."""
        buf = None
        with self._lock:
            bucket = self._free.get(nbytes)
            if bucket:
                buf = bucket.pop()
                self._held -= nbytes
                if not bucket:
                    del self._free[nbytes]
        if buf is None:
            buf = np.empty(nbytes, dtype=np.uint8)
        return buf, lambda: self._give(buf)

    def free_count(self, nbytes):
        """How many buffers of nbytes are free (take() allocates when none is)."""
        return len(self._free.get(nbytes, ()))

    def _give(self, buf):
        n = buf.nbytes
        with self._lock:
            if n > self.max_bytes:
                return
            # The sizes given back least recently make room: sizes no longer received
            # (a neighbor_allgather's varying rows) filled the pool for good, and every
            # size that came after them was allocated afresh on each receive.
            while self._held + n > self.max_bytes:
                size, bucket = next(iter(self._free.items()))
                bucket.pop()
                self._held -= size
                if not bucket:
                    del self._free[size]
            bucket = self._free.pop(n, [])      # (put back last: the most recently given)
            bucket.append(buf)
            self._free[n] = bucket
            self._held += n

    def clear(self):
        with self._lock:
            self._free.clear()
            self._held = 0

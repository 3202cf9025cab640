"""A bounded pool of receive buffers, so that repeated large receives reuse memory
instead of faulting in fresh pages every time."""
import collections
import threading

import numpy as np


class BufferPool:
    def __init__(self, max_bytes):
        self.max_bytes = max_bytes
        self._free = collections.defaultdict(list)   # nbytes -> [array]
        self._held = 0
        self._lock = threading.Lock()

    def take(self, nbytes):
        """A uint8 array of nbytes and the function that gives it back."""
        with self._lock:
            bucket = self._free.get(nbytes)
            buf = bucket.pop() if bucket else None
            if buf is not None:
                self._held -= nbytes
        if buf is None:
            buf = np.empty(nbytes, dtype=np.uint8)
        return buf, lambda: self._give(buf)

    def free_count(self, nbytes):
        """How many buffers of nbytes are free (take() allocates when none is)."""
        return len(self._free.get(nbytes, ()))

    def _give(self, buf):
        n = buf.nbytes
        with self._lock:
            if self._held + n > self.max_bytes:
                return
            self._free[n].append(buf)
            self._held += n

    def clear(self):
        with self._lock:
            self._free.clear()
            self._held = 0

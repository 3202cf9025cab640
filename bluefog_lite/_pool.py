"""A bounded pool of receive buffers, so that repeated large receives reuse memory
instead of faulting in fresh pages every time."""
import threading

import numpy as np

_STALE_TAKES = 4096     # a size not taken or given back for this many takes may make room


class BufferPool:
    """Buffers given back are kept, by size, up to max_bytes in all. When one does not
    fit, sizes not used for stale_takes takes make room, least recently used first
    (sizes that never come back, e.g. a neighbor_allgather's varying rows, filled the
    pool for good, and every size after them was allocated afresh on each receive);
    sizes in use are left alone and the buffer is dropped instead (evicting them
    would empty a pool that a step's receives cycle through: all misses)."""

    def __init__(self, max_bytes, stale_takes=_STALE_TAKES):
        self.max_bytes = max_bytes
        self.stale_takes = stale_takes
        self._free = {}     # nbytes -> [array], the size used least recently first
        self._used = {}     # nbytes -> self._takes at its last take or give (sizes in _free)
        self._takes = 0
        self._held = 0
        self._lock = threading.Lock()

    def take(self, nbytes):
        """A uint8 array of nbytes and the function that gives it back."""
        buf = None
        with self._lock:
            self._takes += 1
            bucket = self._free.pop(nbytes, None)
            if bucket:
                buf = bucket.pop()
                self._held -= nbytes
            if bucket:
                self._free[nbytes] = bucket     # (put back last: the most recently used)
                self._used[nbytes] = self._takes
            else:
                self._used.pop(nbytes, None)
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
            while self._held + n > self.max_bytes:
                size, bucket = next(iter(self._free.items()))
                if self._takes - self._used[size] < self.stale_takes:
                    return      # (every size is in use: this buffer goes)
                bucket.pop()
                self._held -= size
                if not bucket:
                    del self._free[size], self._used[size]
            bucket = self._free.pop(n, [])
            bucket.append(buf)
            self._free[n] = bucket
            self._used[n] = self._takes
            self._held += n

    def clear(self):
        with self._lock:
            self._free.clear()
            self._used.clear()
            self._held = 0

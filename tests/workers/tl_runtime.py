"""timeline_start/timeline_stop while running (no BLUEFOG_TIMELINE): only the window is recorded."""
import sys

import torch

import bluefog_lite as bf
from bluefog_lite.timeline import _recorder

prefix = sys.argv[1]
bf.init()
x = torch.ones(32)
bf.neighbor_allreduce(x, name="before")
inflight = bf.neighbor_allreduce_nonblocking(x, name="started_before")
assert bf.timeline_start_activity("u", "A") is False

bf.timeline_start(prefix, mark_cycles=True)
assert _recorder.current is not None
bf.synchronize(inflight)     # its ends arrive without begins: dropped, the file still nests
bf.neighbor_allreduce(x, name="during")
assert bf.timeline_start_activity("u", "OPEN_AT_STOP") is True
open_op = bf.neighbor_allreduce_nonblocking(x, name="open_at_stop")
bf.timeline_stop()           # ends every open span now
assert _recorder.current is None
bf.synchronize(open_op)
bf.neighbor_allreduce(x, name="after")
assert bf.timeline_start_activity("u", "B") is False
bf.timeline_stop()           # stopping twice is harmless
bf.shutdown()
print(f"AGENT OK {bf._runtime._state.rank}", flush=True)

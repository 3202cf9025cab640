"""Timeline off: nothing is recorded, the user API answers False, no file appears."""
import os
import sys

import torch

import bluefog_lite as bf
from bluefog_lite.timeline import _control, _recorder

os.chdir(sys.argv[1])     # a fresh directory the test then checks stays empty
bf.init()
assert _recorder.current is None and not _control.configured()
x = torch.ones(16)
bf.neighbor_allreduce(x, name="x")
bf.allreduce(x, name="y")
assert bf.timeline_start_activity("x", "WORK") is False
assert bf.timeline_end_activity("x") is False
with bf.timeline_context("x", "WORK") as on:
    assert on is False
_control.step()
assert _recorder.current is None
bf.shutdown()
print(f"AGENT OK {bf._runtime._state.rank}", flush=True)

"""A full disk, as a file size limit: timeline_start of a file that cannot take its
first lines raises; one that fills up while recording ends with whole lines."""
import resource
import signal
import sys

import torch

import bluefog_lite as bf

prefix = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)    # (writes past the limit fail with EFBIG instead)
bf.init()
_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
try:
    bf.timeline_start(prefix + "_first")
    raise AssertionError("a file that took no line was accepted")
except ValueError as exc:
    assert "cannot write" in str(exc), exc
assert bf.timeline_start_activity("x", "A") is False, "recording although the file failed"
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, hard))
bf.timeline_start(prefix)
for k in range(2000):
    with bf.timeline_context(f"row.{k % 5}", "STEP_" + "x" * (k % 50)):
        bf.allreduce(torch.ones(2), name="ar")
bf.timeline_stop()
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
bf.shutdown()
print("AGENT OK 0", flush=True)

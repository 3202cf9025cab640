"""BLUEFOG_TIMELINE_START_STEP/END_STEP: only the ops of the window's steps are recorded,
and the file is finished as soon as the window ends."""
import json
import os

import torch

import bluefog_lite as bf
from bluefog_lite.timeline import _control, _recorder

bf.init()
start = int(os.environ["BLUEFOG_TIMELINE_START_STEP"])
end = int(os.environ["BLUEFOG_TIMELINE_END_STEP"])
r = bf.rank()
path = os.environ["BLUEFOG_TIMELINE"] + f"{r}.json"
x = torch.ones(32)
for k in range(end + 3):
    assert (_recorder.current is not None) == (start <= k <= end), k
    bf.neighbor_allreduce(x, name=f"step{k}")
    _control.step()
    if k == end:
        with open(path) as f:
            json.load(f)       # finished: a complete JSON array before shutdown
bf.shutdown()
print(f"AGENT OK {r}", flush=True)

"""timeline_start/timeline_stop while running (no BLUEFOG_TIMELINE): only the window is recorded.

Two models trained with AWC wrappers created before the timeline starts: model A
gets its FORWARD/BACKWARD hooks from its wrapper at timeline_start (and loses
them at timeline_stop); model B has hooks installed by hand, so its wrapper adds
none (no span recorded twice). Two steps of each are recorded."""
import collections
import gc
import os
import sys

import torch

import bluefog_lite as bf
from bluefog_lite.timeline import _recorder

prefix = sys.argv[1]
bf.init()
x = torch.ones(32)
model_a = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
model_b = torch.nn.Sequential(collections.OrderedDict(b1=torch.nn.Linear(4, 3), b2=torch.nn.Linear(3, 2)))
opts = [bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m)
        for m in (model_a, model_b)]


def train_steps(k):
    for _ in range(k):
        for model, opt in zip((model_a, model_b), opts):
            opt.zero_grad()
            model(torch.randn(5, 4)).sum().backward()
            opt.step()


def hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


train_steps(1)
hooks_before = hook_count(model_a)
manual = bf.timeline_install_hooks(model_b)
bf.neighbor_allreduce(x, name="before")
inflight = bf.neighbor_allreduce_nonblocking(x, name="started_before")
assert bf.timeline_start_activity("u", "A") is False

bf.timeline_start(prefix, mark_cycles=True)
assert _recorder.current is not None
assert opts[0]._timeline_hooks is not None and hook_count(model_a) > hooks_before
assert opts[1]._timeline_hooks is None, "model B has hooks already"
train_steps(2)
bf.synchronize(inflight)     # its ends arrive without begins: dropped, the file still nests
bf.neighbor_allreduce(x, name="during")
assert bf.timeline_start_activity("u", "OPEN_AT_STOP") is True
open_op = bf.neighbor_allreduce_nonblocking(x, name="open_at_stop")
bf.timeline_stop()           # ends every open span now
assert _recorder.current is None
assert opts[0]._timeline_hooks is None and hook_count(model_a) == hooks_before, "hooks left after stop"
manual.remove()
train_steps(1)
bf.synchronize(open_op)
bf.neighbor_allreduce(x, name="after")
assert bf.timeline_start_activity("u", "B") is False
bf.timeline_stop()           # stopping twice is harmless
bf.timeline_start(prefix + "again_")     # mark_cycles=False: this file has no cycle markers
assert bf.timeline_end_activity("u") is False    # OPEN_AT_STOP ended with its own file
try:                                     # a bad prefix: named, and the open file goes on
    bf.timeline_start("/no/such/dir/tl_")
    raise AssertionError("timeline_start into a missing directory was accepted")
except ValueError as e:
    assert "directory '/no/such/dir' does not exist (check the prefix given to timeline_start)" in str(e), e
bf.neighbor_allreduce(x, name="again")
bf.timeline_stop()
# a job that rotates files and leaves an activity to be ended by each file's close
# keeps nothing of the closed files
for i in range(5):
    bf.timeline_start(f"{prefix}rotate{i}_")
    assert bf.timeline_start_activity("u", "EPOCH") is True
    bf.timeline_stop()
# the open file's own prefix again (e.g. once per epoch without timeline_stop): the open file
# is finished, then started over (the old writer wrote on into the truncated file: invalid JSON)
for name, calls in (("first", 100), ("second", 30), ("third", 1)):     # each file shorter than the last
    bf.timeline_start(prefix + "same_")
    for _ in range(calls):
        bf.neighbor_allreduce(x, name=name)
bf.timeline_stop()
# the open file named by a relative path, then another working directory: starting a file
# that exists already compared it with the open one's path from the new directory (FileNotFoundError)
here = os.getcwd()
os.chdir(os.path.dirname(prefix))
bf.timeline_start("relative_")
os.chdir("/")
with open(f"{prefix}other_{bf.rank()}.json", "w") as f:
    f.write("an older file\n")
bf.timeline_start(prefix + "other_")
bf.timeline_stop()
os.chdir(here)
gc.collect()
kept = [o for o in gc.get_objects() if isinstance(o, _recorder.Recorder)]
assert not kept, f"{len(kept)} recorders of closed files are kept"
bf.shutdown()
print(f"AGENT OK {bf._runtime._state.rank}", flush=True)

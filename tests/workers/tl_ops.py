"""Every kind of operation, user activities and a hooked model, with the timeline on
(BLUEFOG_TIMELINE set by the test, which then checks the files)."""
import threading
import time

import networkx as nx
import numpy as np
import torch

import bluefog_lite as bf
from bluefog_lite.timeline import _recorder
import bluefog_lite._devices
from _devices import SlowCopy, to_device

bf.init()
assert _recorder.current is not None, "BLUEFOG_TIMELINE is set: the timeline must be recording"
r = bf.rank()
x = torch.full((64,), float(r))
for _ in range(3):
    bf.neighbor_allreduce(x, name="nar")
bf.allreduce(x, name="ar")
bf.broadcast(x, 0, name="bc")
bf.allgather(x.view(8, 8), name="ag")
bf.neighbor_allgather(x.view(8, 8), name="nag")
bf.pair_gossip(x, r ^ 1, name="gossip")
bf.hierarchical_neighbor_allreduce(x, name="hier")      # 2 machines of 2 (the test's env)
bf.allreduce(x, is_hierarchical_local=True, name="ar.local")
bf.set_machine_topology(nx.DiGraph([(0, 1)]))     # machine 0 sends to machine 1, 1 to nobody
bf.hierarchical_neighbor_allreduce(x, name="hier.ring")
handles = [bf.neighbor_allreduce_nonblocking(x * i, name=f"nb.{i}") for i in range(4)]
handles.append(bf.allreduce_nonblocking(x, name="ar.nb"))
for h in handles:
    bf.synchronize(h)

# device tensors (a stand-in: tests/workers/_devices.py): copies on the caller's thread
bf.neighbor_allreduce(to_device(x), name="dev.nar")
y = to_device(x)
h = bf.allreduce_nonblocking_(y, name="dev.ar")
bf.synchronize(h)
bf.win_create(to_device(x), "dev.win")
h = bf.win_put_nonblocking(to_device(x), "dev.win")
bf.win_update("dev.win")        # runs as "dev.win#1": the put is not yet synchronized
bf.win_wait(h)
bf.win_free("dev.win")
copy_now = bluefog_lite._devices._copy_later
SlowCopy.delay_s = 0.3
bluefog_lite._devices._copy_later = SlowCopy     # this call's copy lands 0.3 s late, as on a busy GPU
h = bf.neighbor_allreduce_nonblocking(to_device(x), name="dev.later")
bf.synchronize(h)
bf.neighbor_allreduce(to_device(x), name="dev.later.blocking")      # waits for its copy at the call
bluefog_lite._devices._copy_later = copy_now

# names that are a str subclass (numpy.str_, from an array of names): one row each
bf.neighbor_allreduce(x, name=np.str_("np.name"))
bf.win_create(x, np.str_("np.win"))
bf.win_put(x, np.str_("np.win"))
bf.win_free("np.win")

# a window and a neighbor operation of one name in flight together: rank 0's put
# ends at once, its neighbor_allreduce when the others call it 1 s later; each
# MPI_ span must end with its own operation
bf.win_create(x, "both")
if r:
    time.sleep(1.0)
put = bf.win_put_nonblocking(x, "both")
h = bf.neighbor_allreduce_nonblocking(x, name="both")
bf.win_wait(put)
bf.synchronize(h)
bf.win_free("both")

assert bf.timeline_start_activity("user", "LOAD_DATA") is True
assert bf.timeline_end_activity("user") is True
with bf.timeline_context("user", "EVALUATE") as on:
    assert on is True

# a user activity on an operation's row, ended while the operation waits for its
# neighbors (ranks 1.. start 1 s later): the end closes the activity, and the
# operation's ENQUEUE_ still ends when the operation does
if r:
    time.sleep(1.0)
assert bf.timeline_start_activity("shared.row", "PREPARE") is True
h = bf.neighbor_allreduce_nonblocking(x, name="shared.row")
assert bf.timeline_end_activity("shared.row") is True
assert bf.timeline_end_activity("shared.row") is False     # none of the user's left open there
bf.synchronize(h)


def load():
    with bf.timeline_context("loader.row", "READ"):
        pass


# a thread that records and ends before the writer next formats keeps its name
loader = threading.Thread(target=load, name="data-loader")
loader.start()
loader.join()

torch.manual_seed(r)
model = torch.nn.Sequential(
    torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(inplace=True),
    torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
hooks = bf.timeline_install_hooks(model)
assert len(hooks) > 0
for step in range(3):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    grads = [bf.neighbor_allreduce_nonblocking(p.grad, name=n) for n, p in model.named_parameters()]
    for h in grads:
        bf.synchronize(h)
    model.zero_grad()

# A module whose own forward hook (registered first, as by an optimizer wrapper
# created before the timeline was configured) launches communication: FORWARD
# must end before that hook runs.
late = torch.nn.Linear(4, 4)
launched = []
late.register_forward_hook(
    lambda m, i, o: launched.append(bf.neighbor_allreduce_nonblocking(m.weight.detach(), name="late.weight")))
late_hooks = bf.timeline_install_hooks(late, prefix="late.")
late(torch.randn(2, 4))
for h in launched:
    bf.synchronize(h)
late_hooks.remove()
# a thread whose only events are the hooks' FORWARD and BACKWARD keeps its name
trainer = threading.Thread(target=lambda: model(torch.randn(4, 8)).pow(2).mean().backward(), name="trainer")
trainer.start()
trainer.join()
hooks.remove()


class Net(torch.nn.Module):
    """Distinct parameter names per wrapper, so each optimizer gets its own rows."""

    def __init__(self, tag):
        super().__init__()
        setattr(self, f"{tag}1", torch.nn.Linear(8, 16))
        setattr(self, f"{tag}2", torch.nn.Linear(16, 1))
        self.tag = tag

    def forward(self, x):
        return getattr(self, f"{self.tag}2")(torch.relu(getattr(self, f"{self.tag}1")(x)))


# the optimizer wrappers install the timeline hooks themselves when a timeline is on:
# AWC sends each parameter right after its module's forward (in flight during
# BACKWARD), ATC right after its gradient is ready
for tag, wrapper in (("awc", bf.DistributedAdaptWithCombineOptimizer),
                     ("atc", bf.DistributedAdaptThenCombineOptimizer)):
    net = Net(tag)
    opt = wrapper(torch.optim.SGD(net.parameters(), lr=0.01), net)
    for step in range(3):
        opt.zero_grad()
        net(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
# WinPut communicates under its window prefix ("wp.<name>"): so do its compute spans
net = Net("winput")
opt = bf.DistributedWinPutOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), net, window_prefix="wp")
for step in range(3):
    opt.zero_grad()
    net(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
opt.free_windows()
# a list of models (Bluefog's other form): named as in each model (the names do not clash),
# the compute spans on the same rows as the communication
gen, disc = Net("gen"), Net("disc")
opt = bf.DistributedAdaptWithCombineOptimizer(
    torch.optim.SGD(list(gen.parameters()) + list(disc.parameters()), lr=0.01), [gen, disc], name_prefix="pair")
for step in range(3):
    opt.zero_grad()
    disc(gen(torch.randn(4, 8)).expand(4, 8)).pow(2).mean().backward()
    opt.step()
opt.remove_hooks()
bf.shutdown()
print(f"AGENT OK {r}", flush=True)

"""One agent: every neighbor op is a well-defined no-op (self-weighted), nothing divides by zero."""
import atexit
import sys

import torch

import bluefog_lite as bf

try:
    bf.rank()
    raise AssertionError("rank() before init() must raise")
except bf.BluefogError as e:
    assert "bf.init()" in str(e)
try:
    bf.neighbor_allreduce(torch.ones(2))
    raise AssertionError("an op before init() must raise")
except bf.BluefogError as e:
    assert "not initialized" in str(e)
try:
    bf.size()
    raise AssertionError("size() before init() must raise")
except ValueError as e:      # what Bluefog raised: scripts may catch it
    assert "bf.init()" in str(e)


def own_hook(*args):        # the program's own excepthook: shutdown() gives it back
    return sys.__excepthook__(*args)


sys.excepthook = own_hook
bf.init()
assert sys.excepthook is not own_hook       # (an uncaught error ends the whole job while initialized)
assert (bf.rank(), bf.size(), bf.local_rank(), bf.local_size(), bf.machine_size()) == (0, 1, 0, 1, 1)
assert bf.in_neighbor_ranks() == [] and bf.out_neighbor_ranks() == []
x = torch.arange(4, dtype=torch.float32)
assert torch.equal(bf.neighbor_allreduce(x), x)
assert torch.equal(bf.neighbor_allreduce(x, self_weight=0.5, src_weights={}), x * 0.5)
assert bf.neighbor_allgather(x.view(2, 2)).shape == (0, 2)
assert torch.equal(bf.hierarchical_neighbor_allreduce(x), x)
assert torch.equal(bf.allreduce(x), x) and torch.equal(bf.broadcast(x, 0), x)
assert torch.equal(bf.allgather(x.view(2, 2)), x.view(2, 2))
bf.barrier()
assert bf.set_topology(bf.load_topology())
# Bluefog's runtime queries and switches (docs/getting_started.md, "Coming from Bluefog")
assert bf.nccl_built() is False and bf.unified_mpi_window_model_supported() in (True, False)
assert bf.get_skip_negotiate_stage() is False
bf.set_skip_negotiate_stage(True)
assert bf.get_skip_negotiate_stage() is True
bf.suspend()
bf.resume()
assert torch.equal(bf.allreduce(x), x)
bf.shutdown()
assert sys.excepthook is own_hook, sys.excepthook
bf.init()      # (a first re-init: modules imported late register their own exit functions)
bf.shutdown()
callbacks = atexit._ncallbacks()     # shutdown is registered once, however often init runs
for _ in range(3):
    bf.init()
    bf.shutdown()
assert atexit._ncallbacks() == callbacks, (callbacks, atexit._ncallbacks())
try:
    bf.allreduce(x)
    raise AssertionError("an op after shutdown() must raise")
except bf.BluefogError as e:
    assert "shut down" in str(e)
print("AGENT OK 0", flush=True)

"""Blocking calls run by their caller (Engine._drive_until) give the same results
as the communication thread and interoperate with agents that use it.

argv[1] == "on": BLUEFOG_CALLER_PROGRESS on (the default); "off": switched off.
1. A loop of blocking 4 KB neighbor_allreduce calls (x <- W x, static Exp-2)
   matches numpy's W^k x0; with caller progress on, most calls were run by the
   caller (the thread sleeps between blocking calls), with it off none.
2. Odd ranks use the blocking forms and even ranks nonblocking + synchronize on
   the same names, in a different order on each, for small (inline) and
   256 KB (own message, descriptor) tensors: every result matches numpy.
3. Blocking window calls (win_accumulate with the targets' mutexes, win_put,
   win_update) are run by their caller the same way (with caller progress on,
   most of a loop of win_put calls; off, none), and the buffers hold what numpy
   says they should.
"""
import sys

import numpy as np
import torch

import bluefog_lite as bf
import topology
from _engine_state import thread_asleep
from _reference import uniform_mixing
from bluefog_lite._runtime import state

mode = sys.argv[1]
bf.init(topology_fn=topology.ExponentialTwoGraph)
n, r = bf.size(), bf.rank()
mix = uniform_mixing(topology.ExponentialTwoGraph(n))     # new x = mix @ x
eng = state().engine
rng = np.random.default_rng(7)

# 1. the blocking loop
x0 = rng.standard_normal((n, 1024))
x = torch.tensor(x0[r], dtype=torch.float64)
before, steps = eng.driven_by_callers, 200
for _ in range(steps):
    x = bf.neighbor_allreduce(x, name="loop")
driven = eng.driven_by_callers - before
expected = np.linalg.matrix_power(mix, steps) @ x0
assert np.allclose(x.numpy(), expected[r], rtol=1e-9, atol=1e-12), f"rank {r}: blocking loop diverged from W^k x0"
if mode == "on":
    assert driven >= steps // 2, f"rank {r}: only {driven} of {steps} blocking calls were run by their caller"
else:
    assert driven == 0, f"rank {r}: {driven} calls were run by the caller with BLUEFOG_CALLER_PROGRESS=0"

# 2. blocking on odd ranks, nonblocking on even ranks, same names, different orders
sizes = {"small": 1024, "large": 1 << 16}    # float32: 4 KB inline, 256 KB by descriptor
names = [f"{kind}.{i}" for kind in sizes for i in range(3)]
inputs = {nm: rng.standard_normal((n, sizes[nm.split(".")[0]])).astype(np.float32) for nm in names}
order = names if r % 2 else list(reversed(names))
results = {}
if r % 2:
    for nm in order:
        results[nm] = bf.neighbor_allreduce(torch.from_numpy(inputs[nm][r].copy()), name=nm)
else:
    handles = {nm: bf.neighbor_allreduce_nonblocking(torch.from_numpy(inputs[nm][r].copy()), name=nm)
               for nm in order}
    for nm in names:
        results[nm] = bf.synchronize(handles[nm])
for nm in names:
    want = (mix @ inputs[nm].astype(np.float64))[r]
    assert np.allclose(results[nm].numpy(), want, rtol=1e-5, atol=1e-5), f"rank {r}: {nm} is wrong"

# 3. blocking window calls
ins = bf.in_neighbor_ranks()
vals = rng.standard_normal((20, n, 64))     # vals[k, s]: what agent s accumulates in call k
bf.win_create(torch.zeros(64, dtype=torch.float64), "cp", zero_init=True)
for k in range(20):     # contended mutexes: the thread may take some of these (timed waits)
    bf.win_accumulate(torch.from_numpy(vals[k, r].copy()), "cp", require_mutex=True)
bf.barrier()
collected = bf.win_update_then_collect("cp")     # zeros + everything the in-neighbors accumulated
want = sum(vals[:, s].sum(axis=0) for s in ins)
assert np.allclose(collected.numpy(), want, rtol=1e-12, atol=1e-12), f"rank {r}: accumulated buffers are wrong"
bf.barrier()          # every agent has collected before the puts overwrite the buffers
puts = rng.standard_normal((10, n, 64))


before = eng.driven_by_callers
for k in range(10):
    thread_asleep(eng)
    bf.win_put(torch.from_numpy(puts[k, r].copy()), "cp")
win_driven = eng.driven_by_callers - before
bf.barrier()
mixed = bf.win_update("cp", self_weight=0.5, neighbor_weights={s: 0.5 / len(ins) for s in ins})
want = 0.5 * want + sum(0.5 / len(ins) * puts[-1, s] for s in ins)     # the last put is in the buffers
assert np.allclose(mixed.numpy(), want, rtol=1e-12, atol=1e-12), f"rank {r}: puts then update is wrong"
bf.win_free("cp")
if mode == "on":
    assert win_driven >= 5, f"rank {r}: only {win_driven} of 10 blocking win_put calls were run by their caller"
else:
    assert win_driven == 0, \
        f"rank {r}: {win_driven} win_put calls were run by the caller with BLUEFOG_CALLER_PROGRESS=0"

bf.barrier()
print(f"AGENT OK {r} (caller ran {driven} of {steps} blocking calls, {win_driven} of 10 win_put calls)", flush=True)
bf.shutdown()

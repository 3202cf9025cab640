"""Window operations that fail on one agent after their arguments were accepted
(an allocation, a step inside the call). argv[1]:

- "steps": win_create failing on rank 1 before the agents agree (the copy that
  fills its buffers) or after the window was allocated (filling its memory): every
  agent raises naming rank 1's error, no window is left, later collectives and a
  new window compute what numpy does (before, the others waited in MPI for good);
  a DistributedWinPutOptimizer whose third window fails so frees its first two;
  an integer win_accumulate failing at its second target's scaled copy sends
  nothing (before, the first target had it: versions not bumped, push-sum mass
  created); a win_update whose sum fails gives the version counts back.
- "blocked": rank 1's MPI_Win_allocate fails (an MPI error there): the others,
  inside that blocking call, warn after BLUEFOG_STALL_WARNING_S and time out after
  BLUEFOG_OP_TIMEOUT_S naming it (before, nothing was printed and they waited for
  good). Their communication thread stays in MPI: every agent leaves with os._exit.
"""
import os
import sys

import numpy as np
import torch

import bluefog_lite as bf
from bluefog_lite import _win_tasks

bf.init()
rank, size = bf.rank(), bf.size()


def raises(exc, texts, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc as e:
        for text in texts:
            assert text in str(e), f"{exc.__name__} without {text!r}: {e}"
        return e
    raise AssertionError(f"{fn.__name__} did not raise {exc.__name__}")


def patched(attr, replacement, where=(1,)):
    """_win_tasks.attr replaced on the ranks in where, for the block."""
    class Patch:
        def __enter__(self):
            self.orig = getattr(_win_tasks, attr)
            if rank in where:
                setattr(_win_tasks, attr, replacement(self.orig))

        def __exit__(self, *exc):
            setattr(_win_tasks, attr, self.orig)
    return Patch()


def no_memory(orig):
    def fail(*args, **kwargs):
        raise MemoryError("injected")
    return fail


def allreduce_is_right(name):
    got = bf.allreduce(torch.full((3,), float(rank + 1)), average=False, name=name)
    assert torch.equal(got, torch.full((3,), size * (size + 1) / 2)), (name, got)


if sys.argv[1] == "blocked":
    real = _win_tasks.MPI

    class Win:
        def __getattr__(self, attr):
            return getattr(real.Win, attr)

        @staticmethod
        def Allocate(*args, **kwargs):
            raise real.Exception(real.ERR_NO_MEM)

    class MPI:
        Win = Win()

        def __getattr__(self, attr):
            return getattr(real, attr)

    if rank == 1:
        _win_tasks.MPI = MPI()
        raises(real.Exception, [], bf.win_create, torch.zeros(3), "w")
    else:
        raises(TimeoutError, ["WIN_CREATE 'win_create' timed out", "the communication thread has waited",
                               "inside MPI_Win_allocate of window 'w'"], bf.win_create, torch.zeros(3), "w")
    print(f"AGENT OK {rank}", flush=True)
    sys.stderr.flush()
    real.COMM_WORLD.Barrier()       # (another communicator than the one the others' thread is stuck in)
    os._exit(0)

x = torch.arange(6, dtype=torch.float64).reshape(3, 2) + rank

# -- win_create failing before the agents agree: negotiated, raised everywhere ------------------
with patched("plain", no_memory):
    raises(RuntimeError, ["win_create failed on every agent because of a failure on some of them",
                          "rank 1: MemoryError while copying the tensor into the buffers"], bf.win_create, x, "w")
assert bf.get_current_created_window_names() == []
allreduce_is_right("after.before")

# -- win_create failing after the allocation: every agent drops the window and raises -----------
# (the failing agent names its exception; the others know that it failed)
FILLING = "rank 1: MemoryError while filling the window's memory" if rank == 1 else "rank 1: it failed filling"
with patched("_publish", no_memory):
    e = raises(RuntimeError, ["because of a failure on some of them (the window was dropped",
                              FILLING], bf.win_create, x, "w")
    assert (rank == 1) == isinstance(e.__cause__, MemoryError), repr(e.__cause__)
assert bf.get_current_created_window_names() == []
allreduce_is_right("after.filling")

# the name is free again, the window works: one round of averaging with the neighbors
assert bf.win_create(x, "w")
bf.win_put(x, "w")
bf.barrier()
bf.win_update("w")
values = [np.arange(6, dtype=np.float64).reshape(3, 2) + r for r in range(size)]
ins = bf.in_neighbor_ranks()      # the default weights: uniform over self and in-neighbors
want = (values[rank] + sum(values[r] for r in ins)) / (len(ins) + 1)
assert np.allclose(x.numpy(), want), (x, want)
bf.win_free("w")

# -- DistributedWinPutOptimizer whose third window fails: the first two are freed everywhere ------
made = [0]


def third_fails(orig):
    def publish(win):
        made[0] += 1
        if made[0] == 3:
            raise MemoryError("injected")
        return orig(win)
    return publish


model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
with patched("_publish", third_fails):
    raises(RuntimeError, [FILLING], bf.DistributedWinPutOptimizer, torch.optim.SGD(model.parameters(), lr=0.1), model)
assert bf.get_current_created_window_names() == [], bf.get_current_created_window_names()
opt = bf.DistributedWinPutOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)   # made again
assert len(bf.get_current_created_window_names()) == 4
opt.free_windows()

# -- an integer win_accumulate failing at its second target's scaled copy sends nothing -----------
out = bf.out_neighbor_ranks()
n = torch.full((4,), 100 * (rank + 1), dtype=torch.int64)
assert bf.win_create(n, "n", zero_init=True)
calls = [0]


def second_fails(orig):
    def scaled(t, w):
        calls[0] += 1
        if calls[0] == 2:
            raise MemoryError("injected")
        return orig(t, w)
    return scaled


if len(out) >= 2:
    with patched("scaled", second_fails):
        if rank == 1:
            raises(MemoryError, ["injected"], bf.win_accumulate, n, "n", self_weight=0.25,
                   dst_weights={out[0]: 0.5, out[1]: 0.25})
            assert torch.equal(n, torch.full((4,), 200, dtype=torch.int64)), n     # self_weight not applied
bf.barrier()
versions = bf.get_win_version("n")
assert all(v == 0 for v in versions.values()), versions      # nothing landed, nothing counted
landed = bf.win_update("n", self_weight=0.0, neighbor_weights={r: 1.0 for r in bf.in_neighbor_ranks()}, clone=True)
assert not landed.any(), landed      # (zero_init: the buffers' sum)
bf.win_free("n")

# -- a win_update whose sum fails gives the version counts back -----------------------------------
y = torch.full((5,), float(rank))
assert bf.win_create(y, "u", zero_init=True)
bf.win_put(y, "u")
bf.barrier()
before = bf.get_win_version("u")
assert all(v == 1 for v in before.values()), before
with patched("weighted_sum", no_memory, where=range(size)):
    raises(MemoryError, ["injected"], bf.win_update, "u")
assert bf.get_win_version("u") == before, (bf.get_win_version("u"), before)
assert torch.equal(y, torch.full((5,), float(rank))), y
bf.win_update("u")
assert all(v == 0 for v in bf.get_win_version("u").values())
bf.win_free("u")
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

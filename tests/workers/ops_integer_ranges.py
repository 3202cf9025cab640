"""Integer averages at the ends of their dtype's range, and a bad enable_topo_check on one
agent; 4 agents as 2 machines of 2 (BLUEFOG_RANKS_PER_MACHINE=2).

- hierarchical_neighbor_allreduce of int64 values near 2**62 on every agent: the machine
  sum (2**63 and more) wrapped around in int64 and the average came back negative;
- an average of int64 values within float64's spacing of 2**63 - 1, and of uint64 ones of
  2**64 - 1, rounds to 2**63 (2**64) in float64 and wrapped to the dtype's minimum (0): the
  largest float64 below the bound now, also where float64 rounding of weights that sum to 1
  takes them a little past it;
- receiving weights that take the result out of the dtype (int8 100 with self_weight 2):
  a ValueError where it happens (it wrapped to -56), the name usable again, in a fused group
  for the member whose average does not fit only (every member failed); win_update of
  an int8 window with such weights raises and leaves the window as it was, as does a
  win_get whose weight scales the fetched copy out of the range (it wrapped in the buffer),
  and a collect that does not fit says it is one;
- enable_topo_check=1 on one agent where the default is False (hierarchical), =0 where it is
  True (dynamic neighbor_allreduce): refused on that agent, and the others raise at once
  (the first joined a topology check no other agent made: every agent waited for good)."""
import time

import torch

import bluefog_lite as bf
from bluefog_lite._runtime import state

bf.init()
r, n = bf.rank(), bf.size()
assert n == 4 and bf.local_size() == 2
M, m = bf.machine_size(), bf.machine_rank()


def same(got, want, what):
    assert got.dtype == want.dtype and torch.equal(got, want), f"rank {r} {what}: {got.tolist()} != {want.tolist()}"


def raises(exc, text, fn, *args, **kwargs):
    t0 = time.monotonic()
    try:
        fn(*args, **kwargs)
    except exc as e:
        assert text in str(e), f"rank {r}: {type(e).__name__} without {text!r}: {e}"
        assert time.monotonic() - t0 < 10, f"rank {r}: raised only after {time.monotonic() - t0:.1f} s"
        return
    raise AssertionError(f"rank {r}: {fn.__name__} did not raise {exc.__name__} ({text!r})")


# -- the ends of the range: every agent holds the same values, so every average is them ------
near = torch.tensor([2**62 + 4096, -2**62 - 4096, 2**62], dtype=torch.int64)
same(bf.hierarchical_neighbor_allreduce(near, name="h.near"), near, "hierarchical int64 near 2**62")
same(bf.neighbor_allreduce(near, name="n.near"), near, "neighbor int64 near 2**62")
top = torch.tensor([2**63 - 1, 2**63 - 512, -2**63], dtype=torch.int64)
clamped = torch.tensor([2**63 - 1024, 2**63 - 1024, -2**63], dtype=torch.int64)
same(bf.neighbor_allreduce(top, name="n.top"), clamped, "neighbor int64 at the top")
same(bf.hierarchical_neighbor_allreduce(top, name="h.top"), clamped, "hierarchical int64 at the top")
if hasattr(torch, "uint64"):
    u = torch.tensor([2**64 - 1, 0, 2**63], dtype=torch.uint64)
    uc = torch.tensor([2**64 - 2048, 0, 2**63], dtype=torch.uint64)
    same(bf.neighbor_allreduce(u, name="n.u64"), uc, "neighbor uint64 at the top")
    same(bf.hierarchical_neighbor_allreduce(u, name="h.u64"), uc, "hierarchical uint64 at the top")

# weights that sum to 1 as decimals but to 1 + 2**-52 in float64 ((0.33 + 0.56) + 0.11) take the
# ends of int64 past them by float64 rounding: clamped, not refused (it raised on some agents,
# depending on the order of the terms)
ins = sorted(bf.in_neighbor_ranks())
ends = torch.tensor([2**63 - 1, -2**63], dtype=torch.int64)
same(bf.neighbor_allreduce(ends, self_weight=0.33, src_weights={ins[0]: 0.56, ins[1]: 0.11}, name="n.ends"),
     torch.tensor([2**63 - 1024, -2**63], dtype=torch.int64), "int64 ends with weights summing to 1 + 2**-52")

# -- receiving weights beyond the range: an error, not a wrapped value ----------------------
src = {s: 0.0 for s in bf.in_neighbor_ranks()}
x8 = torch.full((3,), 100, dtype=torch.int8)
raises(ValueError, "does not fit in int8 (-128 .. 127)", bf.neighbor_allreduce, x8, self_weight=2.0,
       src_weights=src, name="n.i8")
same(bf.neighbor_allreduce(x8, name="n.i8"), x8, "the name after the error")
# ... per call in a fused group: only the member whose average leaves the range fails
with state().engine._drive:            # (holding the loop: the five are admitted together, as one group)
    hs = [bf.neighbor_allreduce_nonblocking(torch.full((3,), 100 if i == 2 else 10, dtype=torch.int8),
                                            self_weight=2.0, src_weights=src, name=f"n.fused.{i}") for i in range(5)]
for i, h in enumerate(hs):
    if i == 2:
        raises(ValueError, "from 200 to 200, which does not fit in int8", bf.synchronize, h)
    else:
        same(bf.synchronize(h), torch.full((3,), 20, dtype=torch.int8), f"fused member {i}")
neg = torch.full((2,), 3, dtype=torch.uint8)
raises(ValueError, "does not fit in uint8", bf.neighbor_allreduce, neg, self_weight=-1.0, src_weights=src,
       name="n.u8")
w = torch.full((4,), 100, dtype=torch.int8)
bf.win_create(w, "w.i8")
bf.barrier()
raises(ValueError, "does not fit in int8", bf.win_update, "w.i8", self_weight=2.0,
       neighbor_weights={s: 0.0 for s in bf.in_neighbor_ranks()})
same(bf.win_update("w.i8", self_weight=1.0, neighbor_weights={s: 0.0 for s in bf.in_neighbor_ranks()}),
     torch.full((4,), 100, dtype=torch.int8), "the window after the refused update")
bf.barrier()
bf.win_free("w.i8")
# win_get scales what it fetches: beyond the range it raises, the buffer left as it was
bf.win_create(w, "w.get", zero_init=True)
bf.barrier()
src0 = bf.in_neighbor_ranks()[0]
raises(ValueError, "win_get of window 'w.get' from rank", bf.win_get, "w.get", src_weights={src0: 2.0})
same(bf.win_update("w.get", self_weight=0.0, neighbor_weights={src0: 1.0}, clone=True),
     torch.zeros(4, dtype=torch.int8), "the buffer after the refused win_get")
# ... from several sources, one out of range: no buffer written (the first source's was)
raises(ValueError, f"win_get of window 'w.get' from rank {ins[1]}", bf.win_get, "w.get",
       src_weights={ins[0]: 1.0, ins[1]: 2.0})
same(bf.win_update("w.get", self_weight=0.0, neighbor_weights={ins[0]: 1.0}, clone=True),
     torch.zeros(4, dtype=torch.int8), "the first source's buffer after the refused win_get")
bf.win_get("w.get", src_weights={src0: 0.5})
same(bf.win_update("w.get", self_weight=0.0, neighbor_weights={src0: 1.0}, clone=True),
     torch.full((4,), 50, dtype=torch.int8), "the buffer after win_get with weight 0.5")
bf.barrier()
bf.win_free("w.get")
# a collect whose sum leaves the range names itself, and keeps the window and what arrived
bf.win_create(w, "w.col", zero_init=True)
bf.barrier()
bf.win_accumulate(torch.full((4,), 50, dtype=torch.int8), "w.col")
bf.barrier()
raises(ValueError, "win_update_then_collect of window 'w.col'", bf.win_update_then_collect, "w.col")
assert torch.equal(w, torch.full((4,), 100, dtype=torch.int8)), w
bf.barrier()
bf.win_free("w.col")

# -- a bad enable_topo_check on one agent: every agent raises within seconds -----------------
flag = 1 if r == n - 1 else False
if r == n - 1:
    raises(TypeError, "enable_topo_check must be True or False, got 1", bf.hierarchical_neighbor_allreduce,
           torch.ones(3), self_weight=0.5, src_machine_weights={(m - 1) % M: 0.5},
           dst_machine_weights=[(m + 1) % M], enable_topo_check=flag, name="h.flag")
else:
    raises(ValueError, "enable_topo_check must be True or False, got 1", bf.hierarchical_neighbor_allreduce,
           torch.ones(3), self_weight=0.5, src_machine_weights={(m - 1) % M: 0.5},
           dst_machine_weights=[(m + 1) % M], enable_topo_check=flag, name="h.flag")
kw = {"enable_topo_check": 0} if r == n - 1 else {}
raises(TypeError if r == n - 1 else ValueError, "enable_topo_check must be True or False, got 0",
       bf.neighbor_allreduce, torch.ones(3), self_weight=0.5, src_weights={(r - 1) % n: 0.5},
       dst_weights=[(r + 1) % n], name="n.flag", **kw)
bf.barrier()
print(f"AGENT OK {r}", flush=True)
bf.shutdown()

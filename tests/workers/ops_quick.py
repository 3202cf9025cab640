"""The quick path of blocking neighbor_allreduce calls (_quick.py): the caller
sends, receives and averages without the loop's machinery, and a call whose
inputs are late becomes an ordinary operation.

Argument "large" (the test sets BLUEFOG_INLINE_LIMIT=256): the tensors of 1-5 are
made larger than that, so they travel as large tensors (a descriptor, then the
data on a private tag) on the large quick path; 4's background operations stay
small, so small and large ones interleave.

1. A loop of blocking float32 4 KB calls (x <- W x, static Exp-2) matches numpy's
   W^k x0, and most calls finished on the quick path (stream stats); large ones
   received their inputs without inbox entries ("quick_received").
2. Dynamic one-peer Exp-2 with scaled sends (dst_weights 0.5) and no topology
   check: every step matches numpy; quick path taken.
3. A late neighbor: rank 0 sleeps 200 ms before each of 3 calls, so its
   out-neighbors' calls outlast the yield window and continue as operations of
   the loop ("quick_continued"); results still right. Large: the receives they
   posted meanwhile for their other in-neighbors usually go to the loop with them
   ("quick_put_back"; test_stream.py checks what it leaves).
4. A second thread of every agent runs nonblocking operations under other names
   while the main thread makes blocking calls: every result right.
5. A neighbor passing another shape: the receivers raise ValueError naming it,
   and the name is free again for the next call.
6. A lazily negated view (the neg bit of conj().imag) sends its values, not its
   stored bytes, on either path.
7. Inputs that came before the call: rank 0's in-neighbors send their next round of
   a name (nonblocking) before a call under another name that rank 0 joins first,
   so rank 0 finds them in its inbox when it makes that round's blocking call
   ("quick_ahead"); results right on every agent.
8. The user's numpy error state set to raise: underflow and overflow on the quick
   path give what torch gives (inf, subnormals), on every call.
"""
import sys
import threading
import time
import warnings

import numpy as np
import torch

import bluefog_lite as bf
import topology
from _engine_state import thread_asleep
from _reference import uniform_mixing
from bluefog_lite._runtime import state

bf.init(topology_fn=topology.ExponentialTwoGraph)
n, r = bf.size(), bf.rank()
G = topology.ExponentialTwoGraph(n)
mix = uniform_mixing(G)     # new x = mix @ x
stats = state().engine.stream.stats
rng = np.random.default_rng(11)
LARGE = sys.argv[1:] == ["large"]
m = 10 if LARGE else 1      # widens the tensors of 2 and 5 past the inline limit
if LARGE:
    assert state().engine.stream.inline_limit == 256, "run with BLUEFOG_INLINE_LIMIT=256"

# 1. static loop
x0 = rng.standard_normal((n, 1024)).astype(np.float32)
x = torch.from_numpy(x0[r].copy())


def taken():
    """Calls that took the quick path, finished on it or continued in the loop (on a
    loaded host a neighbor is often late by more than the yield window)."""
    return stats["quick"] + stats["quick_continued"]


taken0, steps = taken(), 100
finished0 = stats["quick"]
for _ in range(steps):
    x = bf.neighbor_allreduce(x, name="loop")
want = np.linalg.matrix_power(mix, steps) @ x0.astype(np.float64)
assert np.allclose(x.numpy(), want[r], rtol=1e-4, atol=1e-5), f"rank {r}: static loop diverged from W^k x0"
quick = taken() - taken0
assert quick >= steps // 2, f"rank {r}: only {quick} of {steps} calls took the quick path"
if LARGE:     # most received their inputs without inbox entries (_quick._received)
    finished = stats["quick"] - finished0
    assert stats["quick_received"] >= max(1, finished // 2), \
        f"rank {r}: {stats['quick_received']} of {finished} calls finished on the quick path received directly"

# 2. dynamic one-peer schedule with scaled sends
schedules = [topology.GetDynamicOnePeerSendRecvRanks(G, i) for i in range(n)]
x0 = rng.standard_normal((n, 7, 3 * m)).astype(np.float32)
x = torch.from_numpy(x0[r].copy())
ref = x0.astype(np.float64)
taken0 = taken()
for step in range(12):
    plans = [next(sch) for sch in schedules]      # (send_to, recv_from) of every agent
    send, recv = plans[r]
    x = bf.neighbor_allreduce(x, self_weight=0.5, src_weights={s: 1.0 for s in recv},
                              dst_weights={d: 0.5 for d in send}, enable_topo_check=False, name="dyn")
    ref = np.stack([0.5 * ref[i] + sum(0.5 * ref[s] for s in plans[i][1]) for i in range(n)])
    assert np.allclose(x.numpy(), ref[r], rtol=1e-4, atol=1e-5), f"rank {r}: dynamic step {step} is wrong"
assert taken() > taken0, f"rank {r}: no dynamic call took the quick path"

# 3. a late neighbor
late = rng.standard_normal((n, 256)).astype(np.float32)
continued0 = stats["quick_continued"]
for k in range(3):
    if r == 0:
        time.sleep(0.2)     # far past the yield window (0.3 ms), even on a loaded host
    got = bf.neighbor_allreduce(torch.from_numpy(late[r] * (k + 1)), name="late")
    assert np.allclose(got.numpy(), (mix @ late.astype(np.float64))[r] * (k + 1), rtol=1e-5, atol=1e-5), \
        f"rank {r}: late call {k} is wrong"
if 0 in bf.in_neighbor_ranks():
    assert stats["quick_continued"] > continued0, f"rank {r}: waiting for rank 0 never continued in the loop"

# 4. a second thread with nonblocking operations
bg_in = rng.standard_normal((20, n, 64)).astype(np.float32)
bg_out = {}


def background():
    torch.set_num_threads(1)
    for i in range(20):
        h = bf.neighbor_allreduce_nonblocking(torch.from_numpy(bg_in[i, r].copy()), name=f"bg.{i}")
        bg_out[i] = bf.synchronize(h)


t = threading.Thread(target=background)
t.start()
fg0 = rng.standard_normal((n, 100)).astype(np.float32)
fg = torch.from_numpy(fg0[r].copy())
for _ in range(30):
    fg = bf.neighbor_allreduce(fg, name="fg")
t.join()
want = np.linalg.matrix_power(mix, 30) @ fg0.astype(np.float64)
assert np.allclose(fg.numpy(), want[r], rtol=1e-4, atol=1e-5), f"rank {r}: foreground loop is wrong"
for i in range(20):
    assert np.allclose(bg_out[i].numpy(), (mix @ bg_in[i].astype(np.float64))[r], rtol=1e-5, atol=1e-5), \
        f"rank {r}: background op {i} is wrong"

# 5. another shape from a neighbor, then the same name again
try:
    bf.neighbor_allreduce(torch.ones(4 * m if r == 0 else 5 * m), name="shape")
    error = None
except ValueError as e:
    error = str(e)
if r == 0:
    assert error and f"sent float32[{5 * m}] but this agent has float32[{4 * m}]" in error, error
elif 0 in bf.in_neighbor_ranks():
    assert error and f"rank 0 sent float32[{4 * m}]" in error and "same shape" in error, error
else:
    assert error is None, error
bf.barrier()
again = bf.neighbor_allreduce(torch.full((5 * m,), float(r)), name="shape")
assert np.allclose(again.numpy(), (mix @ np.arange(n, dtype=np.float64))[r]), f"rank {r}: name not reusable"

# 6. a lazily negated view whose values are not its bytes: conj().imag of a one-element
#    complex tensor is contiguous and carries the neg bit (larger ones are copied anyway)
neg = rng.standard_normal(n).astype(np.float32)
z = torch.complex(torch.zeros(1), torch.tensor([neg[r]]))
assert z.conj().imag.is_neg() and z.conj().imag.is_contiguous()
want = (mix @ -neg.astype(np.float64))[r]
got = bf.neighbor_allreduce(z.conj().imag, name="neg")
assert np.allclose(got.numpy(), [want], rtol=1e-5, atol=1e-6), f"rank {r}: negated view, blocking"
got = bf.synchronize(bf.neighbor_allreduce_nonblocking(z.conj().imag, name="neg"))
assert np.allclose(got.numpy(), [want], rtol=1e-5, atol=1e-6), f"rank {r}: negated view, nonblocking"

# 7. a neighbor's next round received before the call. Rank 0 takes it on the quick
# path if its communication thread sleeps at that moment: after a "b" that went on in
# the loop the thread is handed the loop back and may still be awake, so rank 0 waits
# for it to sleep (bounded); three rounds, at least one of them quick.
ahead0 = stats["quick_ahead"]
for rnd in range(3):
    ahead = rng.standard_normal((2, n, 64 * m)).astype(np.float32)
    ahead_wants = [(mix @ a.astype(np.float64))[r] for a in ahead]
    first = bf.neighbor_allreduce(torch.from_numpy(ahead[0, r].copy()), name="ahead")
    before_b = torch.full((3,), float(r + rnd), dtype=torch.float64)    # another dtype: not fused with "ahead"
    if r == 0:      # its call "b" receives the neighbors' second round of "ahead" (sent before their "b")
        b = bf.neighbor_allreduce(before_b, name="b")
        thread_asleep(state().engine)
        second = bf.neighbor_allreduce(torch.from_numpy(ahead[1, r].copy()), name="ahead")
    else:
        h = bf.neighbor_allreduce_nonblocking(torch.from_numpy(ahead[1, r].copy()), name="ahead")
        b = bf.neighbor_allreduce(before_b, name="b")
        second = bf.synchronize(h)
    for k, got in enumerate((first, second)):
        assert np.allclose(got.numpy(), ahead_wants[k], rtol=1e-5, atol=1e-5), \
            f"rank {r}: round {k} of 'ahead' is wrong"
    assert np.allclose(b.numpy(), (mix @ (np.arange(n, dtype=np.float64) + rnd))[r]), f"rank {r}: 'b' is wrong"
if r == 0 and not LARGE:
    assert stats["quick_ahead"] > ahead0, "rank 0: the second round's inputs were never taken from the inbox"

# 8. the user's numpy error state (np.seterr(all="raise"), warnings as errors) does not
# reach the quick path's arithmetic: underflow in a scaled send (rank 0 to 2, x0 = 1e-40
# times 0.3), overflow in an average (rank 0 takes 2 * 3e38) give what torch gives on the
# general path. It raised, on rank 0 between its two sends: its next calls then
# averaged with rank 1's previous round, and rank 2 waited for good.
plans = {0: (0.5, {1: 2.0}, {1: 1.0, 2: 0.3}), 1: (0.5, {0: 0.5}, {0: 1.0}), 2: (0.5, {0: 1.0}, {})}
sw, srcw, dstw = plans.get(r, (1.0, {}, {}))
scale = {s: plans[s][2][r] for s in srcw}
values = {0: (1e-40, 1.0, 2.0, 3.0), 1: (1.0, 3e38, 5.0, 6.0)}
taken0 = taken()
with np.errstate(all="raise"), warnings.catch_warnings():
    warnings.simplefilter("error")
    for call in range(4):
        v = {q: torch.full((4,), values[q][call] if q in values else 10.0 * q + call) for q in range(n)}
        want = sw * v[r] + sum(w * (v[s] * scale[s]) for s, w in srcw.items())
        thread_asleep(state().engine)
        got = bf.neighbor_allreduce(v[r], self_weight=sw, src_weights=srcw, dst_weights=dstw,
                                    enable_topo_check=False, name="errstate")
        assert torch.equal(got, want), f"rank {r}: call {call} under np.seterr: {got} != {want}"
assert r > 2 or taken() > taken0, f"rank {r}: no call under np.seterr took the quick path"

bf.barrier()
if LARGE:
    assert stats["data_messages"] > steps, f"rank {r}: the tensors did not travel as large ones"
print(f"AGENT OK {r} (quick {stats['quick']}, continued {stats['quick_continued']})", flush=True)
bf.shutdown()

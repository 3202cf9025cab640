"""A call that fails (a neighbor passed another shape) while its own large sends
are still in flight keeps their memory until MPI has sent it: the receiver,
late, still gets the values that were sent, not whatever the failed agent's
memory holds by then.

Rank 0 sends 1 MB (scaled, so the data is a temporary copy only the call holds)
to rank 1 and receives from rank 2, which sends another shape: rank 0's call
fails. Rank 1 calls 0.5 s later; meanwhile rank 0 frees the call's tensors and
fills fresh 1 MB tensors with NaN (reusing the freed memory where the allocator
does). Rank 1's average must match numpy. Once as a blocking call (the large
quick path), once nonblocking (the loop).

Then the same failure with a receiver that never comes: rank 0's send stays in
flight, and shutdown does not wait for it (the stall window, 30 s, would show).
"""
import time

import numpy as np
import torch

import bluefog_lite as bf

bf.init()
r = bf.rank()
assert bf.size() == 4
N = 1 << 18            # float32: 1 MB
rng = np.random.default_rng(5)


def call(nonblocking, name):
    x = torch.from_numpy(x0[r].copy())
    if r == 0:
        kw = dict(self_weight=0.5, src_weights={2: 0.5}, dst_weights={1: 0.5})
    elif r == 1:
        kw = dict(self_weight=0.5, src_weights={0: 1.0}, dst_weights={})
    elif r == 2:
        x = torch.ones(N + 8)           # another shape
        kw = dict(self_weight=1.0, src_weights={}, dst_weights={0: 1.0})
    else:
        kw = dict(self_weight=1.0, src_weights={}, dst_weights={})
    if nonblocking:
        return bf.synchronize(bf.neighbor_allreduce_nonblocking(x, enable_topo_check=False, name=name, **kw))
    return bf.neighbor_allreduce(x, enable_topo_check=False, name=name, **kw)


for nonblocking in (False, True):
    x0 = rng.standard_normal((4, N)).astype(np.float32)
    name = f"failed.{nonblocking}"
    bf.barrier()
    if r == 0:
        try:
            call(nonblocking, name)
            raise AssertionError("rank 0: the call with rank 2's other shape did not fail")
        except ValueError as e:
            assert "rank 2 sent float32" in str(e), e
        garbage = [torch.full((N,), float("nan")) for _ in range(64)]
        time.sleep(1.0)
        del garbage
    elif r == 1:
        time.sleep(0.5)
        got = call(nonblocking, name)
        want = 0.5 * x0[1].astype(np.float64) + 0.5 * x0[0].astype(np.float64)
        assert np.allclose(got.numpy(), want, rtol=1e-5, atol=1e-6), \
            f"rank 1: wrong average from a failed sender (nonblocking={nonblocking}); " \
            f"{int(np.isnan(got.numpy()).sum())} NaN"
    else:
        call(nonblocking, name)
x0 = rng.standard_normal((4, N)).astype(np.float32)
if r in (0, 2):      # rank 1 never calls "abandoned"
    try:
        call(False, "abandoned")
        assert r != 0, "rank 0: the call with rank 2's other shape did not fail"
    except ValueError as e:
        assert r == 0 and "rank 2 sent float32" in str(e), e
bf.barrier()
t0 = time.monotonic()
bf.shutdown()
took = time.monotonic() - t0
assert took < 10, f"rank {r}: shutdown took {took:.1f} s (waited for a send no one will take?)"
print(f"AGENT OK {r}", flush=True)

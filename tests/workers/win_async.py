"""Asynchrony: puts, accumulates (with the target's mutex) and gets complete while
the target agent computes without calling bluefog or MPI, and the target sees the
data at its next win_update. Topology: ExponentialGraph(4), target rank 0, writer
rank 3 (an in-neighbor of 0), reader rank 1 (an out-neighbor of 0).

The target computes until the writer and the reader have each left a file in the
folder argv[1] saying they are done (a file, not a message: the target makes no
MPI call), or until BUSY_S. So the test does not depend on how fast the host is
(the ops take milliseconds; a loaded host can stretch them): it fails only if
they cannot finish at all while the target computes."""
import os
import sys
import time

import numpy as np
import torch

import bluefog_lite as bf

bf.init()
rank, size = bf.rank(), bf.size()
assert size == 4
BUSY_S = 30.0                     # the longest the target computes
FOLDER = sys.argv[1]
N = 256 * 1024                    # 1 MB of float32: large windows must not stall either
TARGET, WRITER, READER = 0, 3, 1
assert TARGET in bf.out_neighbor_ranks() if rank == WRITER else True
assert TARGET in bf.in_neighbor_ranks() if rank == READER else True

x = torch.full((N,), float(rank + 1), dtype=torch.float32)
bf.win_create(x, "async", zero_init=True)
bf.barrier()
t_start = time.monotonic()
timings = {}
if rank == TARGET:
    a = np.random.default_rng(0).random((160, 160))
    done = [os.path.join(FOLDER, f"done.{r}") for r in (WRITER, READER)]
    while time.monotonic() - t_start < BUSY_S and not all(map(os.path.exists, done)):
        a = a @ a                                  # pure computation, no MPI, no bluefog
        a /= np.abs(a).max()
    t_busy_end = time.monotonic()
    versions = bf.get_win_version("async")
    y = bf.win_update("async", self_weight=0.0, neighbor_weights={WRITER: 1.0}, clone=True)
    np.testing.assert_array_equal(y.numpy(), np.full(N, 3.0 * 7 + 2 * 3.0, np.float32))
    assert versions == {2: 0, WRITER: 3}, versions
    timings["busy_end"] = t_busy_end
elif rank == WRITER:
    time.sleep(0.1)
    v = torch.full((N,), 7.0 * rank, dtype=torch.float32)
    t0 = time.monotonic()
    bf.win_put(v, "async", dst_weights={TARGET: 1.0})
    timings["put"] = time.monotonic() - t0
    t0 = time.monotonic()
    bf.win_accumulate(torch.full((N,), float(rank)), "async", dst_weights={TARGET: 1.0}, require_mutex=True)
    timings["accumulate+mutex"] = time.monotonic() - t0
    t0 = time.monotonic()
    h = bf.win_accumulate_nonblocking(torch.full((N,), float(rank)), "async", dst_weights={TARGET: 1.0})
    bf.win_wait(h)
    timings["accumulate nonblocking"] = time.monotonic() - t0
    timings["done"] = time.monotonic()
    open(os.path.join(FOLDER, f"done.{rank}"), "w").close()
elif rank == READER:
    time.sleep(0.1)
    t0 = time.monotonic()
    bf.win_get("async", src_weights={TARGET: 2.0}, require_mutex=True)
    timings["get+mutex"] = time.monotonic() - t0
    timings["done"] = time.monotonic()
    open(os.path.join(FOLDER, f"done.{rank}"), "w").close()
    y = bf.win_update("async", self_weight=0.0, neighbor_weights={TARGET: 1.0}, clone=True)
    np.testing.assert_array_equal(y.numpy(), np.full(N, 2.0 * (TARGET + 1), np.float32))

everyone = bf.allgather(torch.tensor([[timings.get("busy_end", 0.0), timings.get("done", 0.0)]],
                                     dtype=torch.float64))
busy_end = float(everyone[TARGET, 0])
for what, dt in timings.items():
    if what in ("put", "accumulate+mutex", "accumulate nonblocking", "get+mutex"):
        print(f"rank {rank}: {what} on a busy target took {dt * 1e3:.1f} ms", flush=True)
if rank in (WRITER, READER):
    assert timings["done"] < busy_end, \
        f"the one-sided ops must finish while the target computes (it gave up after {BUSY_S} s)"
if rank == TARGET:
    print(f"the target computed for {busy_end - t_start:.3f} s", flush=True)
bf.barrier()
bf.win_free()
sys.stdout.write(f"AGENT OK {rank}\n")
bf.shutdown()

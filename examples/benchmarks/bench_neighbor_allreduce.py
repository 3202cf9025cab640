"""neighbor_allreduce vs raw mpi4py, measured in the same run.

Raw baseline: Neighbor_allgather on a dist-graph communicator built from the same
topology, then a numpy weighted sum (one BLAS gemv over a (k+1, n) buffer, self
row copied in). Ours: bf.neighbor_allreduce with the same default weights.
Also: 64 concurrent 16 KB ops (fused) vs one raw exchange of 1 MB.

Run:  mpiexec -n 4 python examples/benchmarks/bench_neighbor_allreduce.py [--sizes 4K,64K,1M,16M,64M]
Prints one row per size: median seconds per op (max over agents) and the ratio.
"""
import argparse
import os
import time

# one BLAS thread per agent: agents share cores, and idle OpenBLAS threads spin
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

import bluefog_lite as bf
from bluefog_lite._mpi import MPI


def parse_size(s):
    mult = {"K": 1024, "M": 1024 ** 2}.get(s[-1].upper(), 1)
    return int(float(s.rstrip("kKmM")) * mult)


def reps_for(nbytes):
    return max(3, min(300, int(2e7 // max(nbytes, 1))))


def timed(fn, reps, comm, trials):
    """Median over trials of (max over agents of mean seconds per call)."""
    fn()
    out = []
    for _ in range(trials):
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        dt = (time.perf_counter() - t) / reps
        out.append(comm.allreduce(dt, op=MPI.MAX))
    return float(np.median(out)), float(min(out)), float(max(out))


def raw_exchange(comm, graph_comm, x, self_w, w):
    k = len(w)
    buf = np.empty((k + 1, x.size), dtype=x.dtype)
    recv = buf[1:]

    def run():
        graph_comm.Neighbor_allgather(x, recv)
        buf[0] = x
        return w_all @ buf
    w_all = np.array([self_w] + list(w), dtype=x.dtype)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    bf.init()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = bf.rank(), bf.size()
    ins, outs = bf.in_neighbor_ranks(), bf.out_neighbor_ranks()
    graph_comm = comm.Create_dist_graph_adjacent(ins, outs, reorder=False)
    self_w = 1.0 / (len(ins) + 1)
    rows = []
    for nbytes in map(parse_size, args.sizes.split(",")):
        n = nbytes // 4
        x_np = np.random.default_rng(rank).random(n, dtype=np.float32)
        x = torch.from_numpy(x_np)
        reps = reps_for(nbytes)
        raw = timed(raw_exchange(comm, graph_comm, x_np, self_w, [self_w] * len(ins)), reps, comm, args.trials)
        ours = timed(lambda: bf.neighbor_allreduce(x, name="bench"), reps, comm, args.trials)
        rows.append((f"{nbytes // 1024} KB" if nbytes < 1 << 20 else f"{nbytes >> 20} MB", raw, ours))
    # fusion: 64 concurrent 16 KB ops vs one raw 1 MB exchange
    small = [torch.rand(4096) for _ in range(64)]

    def fused():
        hs = [bf.neighbor_allreduce_nonblocking(t, name=f"fuse.{i}") for i, t in enumerate(small)]
        for h in hs:
            bf.synchronize(h)
    raw1m = timed(raw_exchange(comm, graph_comm, np.random.rand(262144).astype(np.float32), self_w,
                               [self_w] * len(ins)), 20, comm, args.trials)
    fus = timed(fused, 20, comm, args.trials)
    if rank == 0:
        print(f"neighbor_allreduce vs raw mpi4py, {size} agents, in-degree {len(ins)}, float32 "
              f"(median of {args.trials} trials, max over agents)")
        print(f"{'size':>8} {'raw mpi4py':>12} {'bluefog_lite':>13} {'ratio':>7}")
        for label, raw, ours in rows:
            print(f"{label:>8} {raw[0] * 1e3:10.3f}ms {ours[0] * 1e3:11.3f}ms {ours[0] / raw[0]:7.2f}")
        print(f"64 x 16 KB fused: {fus[0] * 1e3:.3f} ms vs one raw 1 MB exchange {raw1m[0] * 1e3:.3f} ms "
              f"-> ratio {fus[0] / raw1m[0]:.2f}")
    graph_comm.Free()
    bf.shutdown()


if __name__ == "__main__":
    main()

"""The floor for small blocking exchanges on this host: a minimal exchange that sleeps instead of
busy-polling, next to raw mpi4py and bf.neighbor_allreduce, in the same run.

    mpiexec -n 4 python examples/benchmarks/bench_floor.py [--size 4K] [--trials 7] [--methods raw,minimal,bf]
        [--json out.json]

- raw: Neighbor_allgather on a dist-graph communicator + the numpy weighted sum
  (the baseline of bench_neighbor_allreduce.py; MPICH busy-polls while it waits);
- minimal: what a blocking call costs with no library around it. The caller posts
  Irecv/Isend with its in-/out-neighbors on a private communicator and rings the
  peers that sleep (bluefog_lite's Doorbell). It waits the way the engine does:
  Testall between sched_yields for the yield window, then sleep flag up and select().
  It has no names, no packets, no second thread, no fusion, no timeline and no stall
  inspector;
- bf: bf.neighbor_allreduce of the same tensor (static Exp-2, uniform weights).

`--methods bf` times bf alone (no busy-polling raw blocks between its blocks);
compare launches with BLUEFOG_CALLER_PROGRESS=0 and =1 that way.

Not a target of its own: it shows what part of bf's time is this host's (the
minimal exchange) and what part is the library's per-operation path
(docs/performance.md, "Blocking calls run by the caller").
"""
import argparse
import os
import time

import _bench
import numpy as np
import torch

import bluefog_lite as bf
import topology
from bluefog_lite._doorbell import ANYTHING, Doorbell
from bluefog_lite._mpi import MPI
from bluefog_lite._runtime import state


class MinimalExchange:
    """A blocking weighted average with the in-neighbors, run entirely by the caller."""

    def __init__(self, comm, x, ins, outs, yield_window_s):
        self.comm, self.x, self.ins, self.outs = comm, x, ins, outs
        self.bell = Doorbell(comm)
        self.w = 1.0 / (len(ins) + 1)
        self.bufs = [np.empty_like(x) for _ in ins]
        self.tx = torch.from_numpy(x)
        self.tbufs = [torch.from_numpy(b) for b in self.bufs]
        self.yield_window_s = yield_window_s
        self.sleeps = 0

    def __call__(self):
        comm, bell = self.comm, self.bell
        reqs = [comm.Irecv(b, source=r, tag=5) for b, r in zip(self.bufs, self.ins)]
        for d in self.outs:
            reqs.append(comm.Isend(self.x, dest=d, tag=5))
            bell.ring(d)                  # a system call only if d's sleep flag is up
        t0 = time.monotonic()
        while not MPI.Request.Testall(reqs):
            if time.monotonic() - t0 < self.yield_window_s:
                os.sched_yield()
                continue
            bell.asleep(ANYTHING)         # flag up, look once more, then sleep until rung
            try:
                if MPI.Request.Testall(reqs):
                    break
                self.sleeps += 1
                bell.wait(0.002)
            finally:
                bell.asleep(0)
        out = self.tx * self.w
        for t in self.tbufs:
            out.add_(t, alpha=self.w)
        return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=_bench.parse_size, default="4K", help="bytes per call (float32)")
    ap.add_argument("--reps", type=_bench.positive_int, default=300, help="calls per timed block")
    ap.add_argument("--methods", type=_bench.choice_list(("raw", "minimal", "bf")), default="raw,minimal,bf",
                    help="which of raw,minimal,bf to time")
    ap.add_argument("--yield-window", type=float, default=3e-4, help="seconds of yielding before sleeping")
    _bench.add_common_arguments(ap, trials=7, max_reps=False)
    args = ap.parse_args()
    nbytes = args.size
    bf.init(topology_fn=topology.ExponentialTwoGraph)
    torch.set_num_threads(1)
    ins, outs = bf.in_neighbor_ranks(), bf.out_neighbor_ranks()
    comm = MPI.COMM_WORLD.Dup()
    graph_comm = comm.Create_dist_graph_adjacent(ins, outs, reorder=False)
    x = np.random.default_rng(comm.rank).random(nbytes // 4, dtype=np.float32)
    minimal = MinimalExchange(comm.Dup(), x, ins, outs, args.yield_window)

    everyone = comm.allgather(x)         # check the minimal exchange against numpy once
    expected = minimal.w * (x + sum(everyone[r] for r in ins))
    if not np.allclose(minimal().numpy(), expected, rtol=1e-5, atol=1e-6):
        raise SystemExit(f"rank {comm.rank}: the minimal exchange computed a wrong average")

    t = torch.from_numpy(x)
    methods = {"raw": _bench.raw_static(graph_comm, x, ins), "minimal": minimal,
               "bf": lambda: bf.neighbor_allreduce(t, name="bench.floor")}
    wanted = args.methods
    res = _bench.interleaved({m: methods[m] for m in wanted}, args.reps, args.trials, comm,
                             same=[(m, "raw") for m in wanted if m != "raw" and "raw" in wanted])
    sleeps = comm.allreduce(minimal.sleeps)
    eng = state().engine
    by_callers = comm.allreduce(eng.driven_by_callers)
    quick = comm.allreduce(eng.stream.stats["quick"])
    continued = comm.allreduce(eng.stream.stats["quick_continued"])
    if comm.rank == 0:
        raw = res["raw"][0] if "raw" in res else float("nan")
        print(f"{comm.size} agents, static Exp-2, {_bench.size_label(nbytes)} float32; median of "
              f"{args.trials} trials of the slowest agent's mean ms per call")
        print(f"{'method':>8} {'ms':>8} {'min-max':>15} {'x raw':>6}")
        for name, (med, lo, hi) in res.items():
            print(f"{name:>8} {med * 1e3:8.3f} {lo * 1e3:7.3f}-{hi * 1e3:<7.3f} {med / raw:6.2f}")
        calls = comm.size * (args.trials * args.reps + 1)
        if "minimal" in res:
            print(f"minimal exchange slept on {sleeps} of {calls + comm.size} calls (all agents)")
        if "bf" in res:
            print(f"bf: {by_callers} of {calls} calls run by their caller, not the communication "
                  f"thread (BLUEFOG_CALLER_PROGRESS); quick path: {quick} finished on it, {continued} "
                  "continued in the loop")
    rows = [{"key": {"method": name}, "values": dict({"median_s": v[0], "min_s": v[1], "max_s": v[2]},
                                                   **({"x_raw": v[0] / res["raw"][0]} if "raw" in res else {}))}
            for name, v in res.items()]
    _bench.write_json(args.json if comm.rank == 0 else None, "floor", comm.size,
                      {"bytes": nbytes, "trials": args.trials, "reps": args.reps}, rows)
    minimal.bell.close()
    bf.shutdown()


if __name__ == "__main__":
    main()

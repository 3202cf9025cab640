"""Fusion: many concurrent small neighbor_allreduce ops vs one op, and vs one raw exchange, of the same bytes.

    mpiexec -n 4 python examples/benchmarks/bench_fusion.py [--count 64] [--size 16K] [--trials 5] [--json out.json]

- fused: `count` neighbor_allreduce_nonblocking calls of `size` bytes each, then
  synchronize all (what an optimizer wrapper does for a model's parameters);
- one op: bf.neighbor_allreduce of one tensor of count * size bytes;
- raw: one Neighbor_allgather of count * size bytes on a dist-graph communicator
  + the numpy weighted sum (the baseline of bench_neighbor_allreduce.py).
Exp-2 graph, float32; the three compute the same average (the small tensors are
the large one's pieces), and their first results are compared (the script stops if
they differ); methods alternate in rounds; median over trials of the
slowest agent's mean seconds per call.
"""
import argparse

import _bench
import torch

import bluefog_lite as bf
import topology
from bluefog_lite._mpi import MPI
from bluefog_lite._runtime import state


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=_bench.positive_int, default=64)
    ap.add_argument("--size", type=_bench.parse_size, default="16K", help="bytes per small op")
    _bench.add_common_arguments(ap)
    args = ap.parse_args()
    nbytes = args.size
    bf.init(topology_fn=topology.ExponentialTwoGraph)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD.Dup()
    graph_comm = comm.Create_dist_graph_adjacent(bf.in_neighbor_ranks(), bf.out_neighbor_ranks(),
                                                 reorder=False)
    small = [torch.rand(nbytes // 4) for _ in range(args.count)]
    big = torch.cat(small)      # the same numbers: all three methods' results are compared

    calls = [0]

    def fused():
        calls[0] += 1
        handles = [bf.neighbor_allreduce_nonblocking(t, name=f"bench.fuse.{i}") for i, t in enumerate(small)]
        return [bf.synchronize(h) for h in handles]

    methods = {"raw": _bench.raw_static(graph_comm, big.numpy(), bf.in_neighbor_ranks()),
               "one_op": lambda: bf.neighbor_allreduce(big, name="bench.fuse.one"),
               "fused": fused}
    reps = min(args.max_reps, 20)
    stats = state().engine.stream.stats
    before = {k: stats[k] for k in ("fused_groups", "fused_joined_copies")}
    res = _bench.interleaved(methods, reps, args.trials, comm, same=[("one_op", "raw"), ("fused", "raw")])
    # how the calls were cut into groups (summed over agents, per fused call of one agent)
    groups, copies = (comm.allreduce(stats[k] - before[k]) / max(1, comm.allreduce(calls[0]))
                      for k in ("fused_groups", "fused_joined_copies"))
    values = {f"{m}_s": v[0] for m, v in res.items()}
    values["fused/raw"] = res["fused"][0] / res["raw"][0]
    values["fused/one_op"] = res["fused"][0] / res["one_op"][0]
    values["one_op/raw"] = res["one_op"][0] / res["raw"][0]
    values["groups_per_call"], values["copies_per_call"] = groups, copies
    key = {"count": args.count, "bytes": nbytes}
    if comm.rank == 0:
        total = _bench.size_label(args.count * nbytes)
        print(f"{comm.size} agents, Exp-2: {args.count} x {_bench.size_label(nbytes)} concurrent ops (fused) "
              f"vs one {total} op vs one raw {total} exchange; median of {args.trials} trials, ms per call")
        print(f"fused {values['fused_s'] * 1e3:.3f}  one op {values['one_op_s'] * 1e3:.3f}  "
              f"raw {values['raw_s'] * 1e3:.3f}  fused/raw {values['fused/raw']:.2f}  "
              f"fused/one op {values['fused/one_op']:.2f}  one op/raw {values['one_op/raw']:.2f}")
        print(f"per fused call and agent: {groups:.2f} groups, {copies:.2f} neighbor groups gathered with a copy "
              "(cut differently from this agent's)")
    _bench.write_json(args.json if comm.rank == 0 else None, "fusion", comm.size,
                      {"count": args.count, "bytes": nbytes, "trials": args.trials, "reps": reps},
                      [{"key": key, "values": values}])
    graph_comm.Free()
    comm.Free()
    bf.shutdown()


if __name__ == "__main__":
    main()

"""neighbor_allreduce vs raw mpi4py and vs torch.distributed (gloo), in the same run.

    mpiexec -n 4 python examples/benchmarks/bench_neighbor_allreduce.py [--sizes 4K,64K,1M,16M,64M]
        [--trials 5] [--max-reps 300] [--topologies static,dynamic] [--no-gloo] [--json out.json]

Exp-2 graph (topology.ExponentialTwoGraph), float32, uniform weights 1/(k+1).
- static: bf.neighbor_allreduce(x) on the static topology; raw = Neighbor_allgather
  on a dist-graph communicator of the same graph + one numpy gemv over a (k+1, n)
  buffer (self row copied in).
- dynamic: one peer per step (topology.GetDynamicOnePeerSendRecvRanks);
  bf.neighbor_allreduce with that step's dst_weights/src_weights
  (enable_topo_check=False); raw = Isend/Irecv with the step's peers + the same sum.
- gloo: dist.all_reduce of the same tensor over all agents, then div_ by the
  agent count (an average, what a user of torch.distributed would run instead).

The library's result is checked against the raw baseline's first (the script stops
if they differ). Methods alternate in rounds; each figure is the median over trials of the slowest
agent's mean seconds per call. Ratios are taken from the figures of this run.
"""
import argparse
import itertools

import _bench
import numpy as np
import torch

import bluefog_lite as bf
import topology
from bluefog_lite._mpi import MPI


def dynamic_steps(size, rank, count=12):
    """The first `count` steps of the one-peer Exp-2 schedule (12: a multiple of every
    period up to 8 agents, so cycling them keeps all agents in lockstep)."""
    sched = topology.GetDynamicOnePeerSendRecvRanks(topology.ExponentialTwoGraph(size), rank)
    return list(itertools.islice(sched, count))


def bf_dynamic(x, steps):
    counter = [0]

    def run():
        send, recv = steps[counter[0] % len(steps)]
        counter[0] += 1
        w = 1.0 / (len(recv) + 1)
        return bf.neighbor_allreduce(x, self_weight=w, src_weights={r: w for r in recv}, dst_weights=send,
                                     enable_topo_check=False, name="bench.dynamic")
    return run


def gloo_average(dist, t, size):
    def run():
        dist.all_reduce(t)
        t.div_(size)
    return run


def measure(kind, nbytes, comm, graph_comm, dist, args):
    rank, size = comm.rank, comm.size
    x_np = np.random.default_rng(rank).random(nbytes // 4, dtype=np.float32)
    x = torch.from_numpy(x_np)
    if kind == "static":
        methods = {"raw": _bench.raw_static(graph_comm, x_np, bf.in_neighbor_ranks()),
                   "bf": lambda: bf.neighbor_allreduce(x, name="bench.static")}
    else:
        steps = dynamic_steps(size, rank)
        methods = {"raw": _bench.raw_dynamic(comm, x_np, steps), "bf": bf_dynamic(x, steps)}
    if dist is not None:
        methods["gloo"] = gloo_average(dist, x.clone(), size)
    return _bench.interleaved(methods, _bench.reps_for(nbytes, hi=args.max_reps), args.trials, comm,
                              same=[("bf", "raw")])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=_bench.size_list, default="4K,64K,1M,16M,64M")
    ap.add_argument("--topologies", type=_bench.choice_list(("static", "dynamic")), default="static,dynamic")
    ap.add_argument("--no-gloo", action="store_true", help="skip the torch.distributed baseline")
    _bench.add_common_arguments(ap)
    args = ap.parse_args()
    sizes, kinds = args.sizes, args.topologies
    bf.init(topology_fn=topology.ExponentialTwoGraph)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD.Dup()
    graph_comm = comm.Create_dist_graph_adjacent(bf.in_neighbor_ranks(), bf.out_neighbor_ranks(),
                                                 reorder=False)
    dist = None if args.no_gloo else _bench.init_gloo(comm)
    rows = []
    for kind in kinds:
        for nbytes in sizes:
            res = measure(kind, nbytes, comm, graph_comm, dist, args)
            values = {f"{m}_s": v[0] for m, v in res.items()}
            values.update({f"{m}_min_s": v[1] for m, v in res.items()})
            values.update({f"{m}_max_s": v[2] for m, v in res.items()})
            values["bf/raw"] = res["bf"][0] / res["raw"][0]
            if "gloo" in res:
                values["bf/gloo"] = res["bf"][0] / res["gloo"][0]
            rows.append({"key": {"topology": kind, "bytes": nbytes}, "values": values})
    if comm.rank == 0:
        print(f"neighbor_allreduce, {comm.size} agents, Exp-2 (static in-degree {len(bf.in_neighbor_ranks())}), "
              f"float32; median of {args.trials} trials of the slowest agent's mean ms per call")
        print(f"{'topology':>8} {'size':>8} {'raw mpi4py':>11} {'bluefog':>10} {'gloo':>10} "
              f"{'bf/raw':>7} {'bf/gloo':>8}")
        for r in rows:
            v, k = r["values"], r["key"]
            gloo = f"{v['gloo_s'] * 1e3:10.3f}" if "gloo_s" in v else f"{'-':>10}"
            print(f"{k['topology']:>8} {_bench.size_label(k['bytes']):>8} {v['raw_s'] * 1e3:11.3f} "
                  f"{v['bf_s'] * 1e3:10.3f} {gloo} {v['bf/raw']:7.2f} {v.get('bf/gloo', float('nan')):8.3f}")
    _bench.write_json(args.json if comm.rank == 0 else None, "neighbor_allreduce", comm.size,
                      {"sizes": sizes, "trials": args.trials, "topologies": kinds}, rows)
    if dist is not None:
        dist.destroy_process_group()
    graph_comm.Free()
    comm.Free()
    bf.shutdown()


if __name__ == "__main__":
    main()

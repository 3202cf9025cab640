"""Peak resident memory per agent of a large neighbor_allreduce, measured in a fresh process.

    mpiexec -n 4 python examples/benchmarks/bench_memory.py [--size 64M] [--ops 4] [--mode bf|raw] [--json out.json]

After bf.init() and one small warm-up op, each agent notes its resident memory
(VmRSS) and resets its peak (writing 5 to /proc/self/clear_refs), allocates the
input tensor, runs one op, reads the peak (VmHWM), runs `ops - 1` more (buffer
reuse), and reads the peak again. The growth of the peak over the starting
resident memory is compared with what the op must hold: the input, one
receive buffer per in-neighbor and the output, (k + 2) x size.
--mode raw measures the raw mpi4py baseline instead (Neighbor_allgather into a
(k+1, n) buffer + numpy weighted sum: (k + 3) x size), in its own fresh process.
"""
import argparse
import gc

import _bench
import numpy as np
import torch

import bluefog_lite as bf
import topology
from bluefog_lite._mpi import MPI


def status_kb(field):
    """A /proc/self/status field (VmRSS, VmHWM) in kB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak():
    """Reset VmHWM to the current VmRSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=_bench.parse_size, default="64M")
    ap.add_argument("--ops", type=_bench.positive_int, default=4, help="ops in all (the first allocates the buffers)")
    ap.add_argument("--mode", choices=["bf", "raw"], default="bf")
    ap.add_argument("--json", default=None, metavar="PATH", help="rank 0 writes the results here as JSON")
    args = ap.parse_args()
    nbytes = args.size
    bf.init(topology_fn=topology.ExponentialTwoGraph)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD.Dup()
    ins = bf.in_neighbor_ranks()
    graph_comm = comm.Create_dist_graph_adjacent(ins, bf.out_neighbor_ranks(), reorder=False)
    bf.neighbor_allreduce(torch.ones(1024), name="bench.mem.warmup")
    graph_comm.Neighbor_allgather(np.ones(1024, np.float32), np.empty((len(ins), 1024), np.float32))
    gc.collect()
    comm.Barrier()
    start_kb = status_kb("VmRSS")
    was_reset = reset_peak()

    x = torch.rand(nbytes // 4)
    input_kb = status_kb("VmRSS") - start_kb
    if args.mode == "bf":
        op = lambda: bf.neighbor_allreduce(x, name="bench.mem")   # noqa: E731
    else:
        op = _bench.raw_static(graph_comm, x.numpy(), ins)
    out = op()
    first_kb = status_kb("VmHWM") - start_kb
    for _ in range(args.ops - 1):
        del out
        out = op()
    peak_kb = status_kb("VmHWM") - start_kb
    del out

    k = len(ins)
    expected = (k + 2 if args.mode == "bf" else k + 3) * nbytes
    mine = np.array([input_kb, first_kb, peak_kb], dtype=np.float64) * 1024
    worst = np.empty_like(mine)
    comm.Allreduce(mine, worst, op=MPI.MAX)
    values = {"input_bytes": worst[0], "peak_first_bytes": worst[1], "peak_bytes": worst[2],
              "expected_bytes": float(expected), "peak/expected": worst[2] / expected,
              "in_degree": float(k), "peak_was_reset": float(all(comm.allgather(was_reset)))}
    if comm.rank == 0:
        mb = lambda b: f"{b / (1 << 20):.1f} MB"   # noqa: E731
        print(f"{comm.size} agents, in-degree {k}, {args.mode}, {_bench.size_label(nbytes)} float32: "
              f"peak growth after 1 op {mb(worst[1])}, after {args.ops} ops {mb(worst[2])} "
              f"(max over agents) vs input + {k} received + output{' + self row' if args.mode == 'raw' else ''}"
              f" = {mb(expected)} -> {worst[2] / expected:.2f}"
              + ("" if values["peak_was_reset"] else " (peak could not be reset: includes start-up)"))
    _bench.write_json(args.json if comm.rank == 0 else None, "memory", comm.size,
                      {"bytes": nbytes, "ops": args.ops}, [{"key": {"mode": args.mode}, "values": values}])
    graph_comm.Free()
    comm.Free()
    bf.shutdown()


if __name__ == "__main__":
    main()

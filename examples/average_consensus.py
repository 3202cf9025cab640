"""Average consensus: every agent starts with its own vector and repeatedly averages
with its neighbors (neighbor_allreduce) until all agree on the global mean.

    bfrun -np 4 python examples/average_consensus.py [--dynamic] [--short] [--steps 30]

Static mode mixes over the Exp-2 graph; --dynamic uses the one-peer Exp-2 schedule
(each step every agent talks to a single neighbor), which reaches the exact average
in log2(n) steps when n is a power of two. Prints the distance to the true average.
"""
import argparse

import numpy as np
import torch

import bluefog_lite as bf
import topology as topo
from _cli import output_file
from _timeline_note import shutdown_and_note


def main():
    ap = argparse.ArgumentParser(description="average consensus with neighbor_allreduce")
    ap.add_argument("--dynamic", action="store_true", help="one-peer dynamic Exp-2 schedule")
    ap.add_argument("--short", action="store_true", help="a quick run: 10 steps of 1000 entries")
    ap.add_argument("--steps", type=int, default=None, help="default 30 (10 with --short)")
    ap.add_argument("--dim", type=int, default=None, help="entries per agent: default 100000 (1000 with --short)")
    ap.add_argument("--save", type=output_file, default=None,
                    help="write the agents' final vectors (one row each) to this .npy file")
    args = ap.parse_args()
    args.steps = args.steps if args.steps is not None else 10 if args.short else 30
    args.dim = args.dim if args.dim is not None else 1000 if args.short else 100000
    if min(args.steps, args.dim) < 1:
        ap.error(f"--steps and --dim must be at least 1, got {args.steps} and {args.dim}")

    bf.init(topology_fn=topo.ExponentialTwoGraph)
    torch.manual_seed(bf.rank())
    x = torch.randn(args.dim, dtype=torch.float64)
    mean = bf.allreduce(x, name="true_mean")          # the reference every agent should reach
    schedule = topo.GetDynamicOnePeerSendRecvRanks(bf.load_topology(), bf.rank())
    for step in range(args.steps):
        if args.dynamic:
            send, recv = next(schedule)
            w = 1.0 / (len(recv) + 1)     # 1/2 with one peer; 1 alone (one agent receives nothing)
            x = bf.neighbor_allreduce(x, self_weight=w, src_weights={r: w for r in recv},
                                      dst_weights=send, name="x")
        else:
            x = bf.neighbor_allreduce(x, name="x")
        dist = bf.allreduce(torch.tensor([float((x - mean).norm())]), name="dist").item()
        if bf.rank() == 0 and (step < 5 or step % 5 == 4 or step == args.steps - 1):
            print(f"step {step + 1:3d}: mean distance to the average {dist:.3e}", flush=True)
    rows = bf.allgather(x.reshape(1, -1), name="final_x") if args.save else None
    if bf.rank() == 0:
        if args.save:
            np.save(args.save, rows.numpy())
        print(f"final distance to the average: {dist:.3e}")
    shutdown_and_note()


if __name__ == "__main__":
    main()

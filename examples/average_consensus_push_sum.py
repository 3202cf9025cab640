"""Asynchronous average consensus by push-sum, with one-sided win_accumulate.

    bfrun -np 4 python examples/average_consensus_push_sum.py [--short] [--steps 200] [--jitter-ms 1.0]

Every agent starts with its own vector x and a weight p = 1. Each iteration
it pushes a share of (x, p) into each out-neighbor's window, keeps one share
itself, and adds whatever its in-neighbors have pushed since its last look
(win_update_then_collect). Nobody waits for anybody: the agents run at their
own pace (agent r sleeps a random 0 .. (1 + r % 3) * jitter ms per
iteration, so they really do make progress at different speeds), and pushes
land whenever they land. The sums of x and of p over all agents never
change, so x / p converges on every agent to the average of the initial
vectors, asynchronously, over a directed graph (here the one-way ring). Each
agent needs only its own out-degree: the same holds on directed graphs whose
in-degrees differ, where plain averaging with weights an agent can choose
alone would not reach the average (on the one-way ring every in-degree is 1,
so it happens to).

Rank 0 prints its own estimate's distance to the true average as it goes;
after the loop a barrier lets the last pushes land, a final collect takes
them, and the final line gives the worst agent's distance. (The plain
neighbor_allreduce version, static and dynamic, is average_consensus.py.)

In a timeline, row ``x`` shows ENQUEUE_WIN_ACCUMULATE / MPI_WIN_ACCUMULATE
and MPI_WIN_UPDATE, each with ACQUIRE_MUTEX (the collect and the neighbors'
accumulates exclude each other); the slower agents' iterations lie further
apart.
"""
import argparse
import time

import numpy as np
import torch

import bluefog_lite as bf
import topology as topo
from _cli import non_negative_float, output_file
from _timeline_note import shutdown_and_note


def initial_vector(rank, dim):
    return torch.from_numpy(np.random.default_rng([7, rank]).normal(size=dim) * 10)


def main():
    ap = argparse.ArgumentParser(description="asynchronous push-sum average consensus")
    ap.add_argument("--steps", type=int, default=None, help="iterations per agent (default 200; 120 with --short)")
    ap.add_argument("--short", action="store_true", help="quick run for the tests")
    ap.add_argument("--dim", type=int, default=1000)
    ap.add_argument("--jitter-ms", type=non_negative_float, default=1.0,
                    help="scale of the random per-iteration sleeps")
    ap.add_argument("--save", type=output_file, default=None,
                    help="write the agents' final x and p (one row each: x, then p) "
                    "to this .npy file")
    args = ap.parse_args()
    steps = args.steps if args.steps is not None else (120 if args.short else 200)
    if min(steps, args.dim) < 1:
        ap.error(f"--steps and --dim must be at least 1, got {steps} and {args.dim}")

    bf.init(topology_fn=lambda n: topo.RingGraph(n, connect_style=2))    # directed: i -> i+1
    rank = bf.rank()
    x = initial_vector(rank, args.dim)
    average = bf.allreduce(x, name="true_average")        # the reference, before any mixing
    bf.turn_on_win_ops_with_associated_p()
    bf.win_create(x, "x", zero_init=True)                 # the window keeps x itself
    share = 1.0 / (len(bf.out_neighbor_ranks()) + 1)
    push_to = {j: share for j in bf.out_neighbor_ranks()}
    rng = np.random.default_rng(rank)
    for step in range(1, steps + 1):
        time.sleep(rng.uniform(0, 1e-3 * args.jitter_ms * (1 + rank % 3)))  # agents at their own pace
        # x, p <- share * x, share * p once sent; the mutex keeps collects whole
        bf.win_accumulate(x, "x", self_weight=share, dst_weights=push_to, require_mutex=True)
        bf.win_update_then_collect("x")
        if rank == 0 and (step % max(1, steps // 10) == 0 or step == steps):
            dist = float((x / bf.win_associated_p("x") - average).norm() / average.norm())
            print(f"rank 0, iteration {step:4d}: relative distance of x/p to the average {dist:.3e}", flush=True)
    bf.barrier()                                          # every push has landed...
    bf.win_update_then_collect("x")                       # ...and is collected
    estimate = x / bf.win_associated_p("x")
    dist = torch.tensor([float((estimate - average).norm() / average.norm())])
    dists = bf.allgather(dist, name="final_distance")
    p = bf.win_associated_p("x")
    rows = bf.allgather(torch.cat([x, torch.tensor([p], dtype=x.dtype)]).reshape(1, -1), name="final_x_p") \
        if args.save else None
    bf.win_free()
    bf.turn_off_win_ops_with_associated_p()
    if rank == 0:
        if args.save:
            np.save(args.save, rows.numpy())
        print(f"final relative distance of x/p to the average (worst agent): {dists.max().item():.3e}",
              flush=True)
    shutdown_and_note()


if __name__ == "__main__":
    main()

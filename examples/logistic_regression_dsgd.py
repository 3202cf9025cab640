"""Decentralized SGD for logistic regression with neighbor_allreduce.

    bfrun -np 4 python examples/logistic_regression_dsgd.py [--short] [--steps N] [--lr 0.05]

Each agent keeps its own iterate w_i and, every step, averages it with its
in-neighbors on the Exp-2 graph while it computes a minibatch gradient at
w_i (the averaging is nonblocking, so the two overlap):

    w_i <- sum_j W_ij w_j - lr * grad f_i(w_i; minibatch)

With a constant step this does NOT reach the optimum of the global problem:
gradient noise and, above all, the agents' different data leave every agent
in a neighborhood of it whose size grows with lr (compare the gradient
tracking, exact diffusion and push-DIGing examples, which are exact). The
program prints the worst agent's distance to the centralized optimum, which
it computes first with Newton's method on the gathered data.

In a timeline (bfrun --timeline-filename tl_ ...) the step is on the row
``w``: COMPUTE_GRADIENT on the main thread, started right after the step's
nonblocking call, and MPI_NEIGHBOR_ALLREDUCE (ALLOCATE_OUTPUT, COMMUNICATE,
COMPUTE_AVERAGE) on the communication thread; how often the two overlap
depends on the host (docs/examples.md).
"""
import torch

import bluefog_lite as bf
import topology as topo
from _cli import positive_int
from _logistic import centralized_optimum, finish, gradient, local_problem, parser, report, steps_of
from _timeline_note import shutdown_and_note


def main():
    args = parser("decentralized SGD for logistic regression", steps=2000, short_steps=500, lr=0.05)
    args.add_argument("--batch", type=positive_int, default=50, help="minibatch size")
    args = args.parse_args()
    bf.init(topology_fn=topo.ExponentialTwoGraph)
    A, y = local_problem(args)
    w_star = centralized_optimum(A, y)
    steps = steps_of(args)
    gen = torch.Generator().manual_seed(bf.rank())
    w = torch.zeros_like(w_star)
    for step in range(1, steps + 1):
        batch = torch.randint(len(y), (args.batch,), generator=gen)
        handle = bf.neighbor_allreduce_nonblocking(w, name="w")
        with bf.timeline_context("w", "COMPUTE_GRADIENT"):
            g = gradient(w, A[batch], y[batch])
        w = bf.synchronize(handle) - args.lr * g
        report(step, w, w_star, every=steps // 10, total=steps)
    finish(w, w_star, args.save)
    shutdown_and_note()


if __name__ == "__main__":
    main()

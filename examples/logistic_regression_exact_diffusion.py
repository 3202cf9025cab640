"""Exact diffusion (and plain diffusion) for logistic regression with neighbor_allreduce.

    bfrun -np 4 python examples/logistic_regression_exact_diffusion.py [--short] [--steps N] [--lr 0.5]
        [--variant exact|diffusion]

Exact diffusion (Yuan, Ying, Zhao, Sayed, "Exact diffusion for distributed
optimization and learning", IEEE TSP 2019) corrects the bias of diffusion
(adapt-then-combine SGD) with one extra vector per agent and no extra
communication:

    psi_i <- w_i - lr * grad f_i(w_i)           adapt
    phi_i <- psi_i + w_i - psi_i(previous)      correct  (psi starts at w)
    w_i   <- sum_j Abar_ij phi_j                combine, Abar = (I + W) / 2

It needs a symmetric, doubly stochastic W: here the undirected ring (each
agent weighs itself and its two neighbors 1/3), so Abar gives 2/3 to the
agent and 1/6 to each neighbor, passed to neighbor_allreduce as self_weight
and src_weights. With a constant step the agents reach the exact optimum.

``--variant diffusion`` runs plain diffusion for comparison (adapt, then
combine with W itself: w_i <- sum_j W_ij psi_j): with a constant step and data
that differ between agents it stops at a distance from the optimum that
shrinks with the step, and no further.

In a timeline, the row ``w`` alternates COMPUTE_GRADIENT and
ENQUEUE_NEIGHBOR_ALLREDUCE on the main thread, with MPI_NEIGHBOR_ALLREDUCE on
the communication thread.
"""
import bluefog_lite as bf
import topology as topo
from _logistic import centralized_optimum, finish, gradient, local_problem, parser, report, steps_of
from _timeline_note import shutdown_and_note


def main():
    ap = parser("exact diffusion with neighbor_allreduce", steps=300, short_steps=150, lr=0.5)
    ap.add_argument("--variant", choices=["exact", "diffusion"], default="exact",
                    help="exact diffusion (default) or plain diffusion, which keeps a bias")
    args = ap.parse_args()
    exact = args.variant == "exact"
    bf.init(topology_fn=topo.RingGraph)
    A, y = local_problem(args)
    w_star = centralized_optimum(A, y)
    steps = steps_of(args)
    self_w, src_w = topo.GetRecvWeights(bf.load_topology(), bf.rank())
    if exact:       # Abar = (I + W) / 2
        self_weight, src_weights = (1 + self_w) / 2, {j: wj / 2 for j, wj in src_w.items()}
    else:
        self_weight, src_weights = self_w, dict(src_w)

    w = w_star.new_zeros(w_star.shape)
    psi_prev = w.clone()
    for step in range(1, steps + 1):
        with bf.timeline_context("w", "COMPUTE_GRADIENT"):
            psi = w - args.lr * gradient(w, A, y)
        phi = psi + w - psi_prev if exact else psi
        psi_prev = psi
        w = bf.neighbor_allreduce(phi, self_weight=self_weight, src_weights=src_weights, name="w")
        report(step, w, w_star, every=steps // 10, total=steps)
    finish(w, w_star, args.save)
    shutdown_and_note()


if __name__ == "__main__":
    main()

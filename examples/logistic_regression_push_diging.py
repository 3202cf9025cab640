"""Push-DIGing for logistic regression on a directed graph, with neighbor_allreduce.

    bfrun -np 4 python examples/logistic_regression_push_diging.py [--short] [--steps N] [--lr 0.5]

Push-DIGing (Nedic, Olshevsky, Shi, "Achieving geometric convergence for
distributed optimization over time-varying graphs", SIAM J. Optim. 2017)
combines gradient tracking with push-sum, so it needs only a
*column*-stochastic mixing matrix C: every agent splits what it sends
equally between itself and its out-neighbors, which any directed graph
allows, whatever the in-degrees. Rows of C need not sum to 1, so mixing
alone scales each agent's values by its own factor (gradient tracking run
with C, without push-sum, leaves the agents disagreeing, far from the
optimum); dividing by the push-sum weight v, mixed the same way, cancels it:

    u_i <- sum_j C_ij (u_j - lr * y_j)
    v_i <- sum_j C_ij v_j                      (v starts at 1)
    x_i <- u_i / v_i
    y_i <- sum_j C_ij y_j + grad f_i(x_i new) - grad f_i(x_i old),   y starts at grad f_i(x_i)

The paper's algorithm is synchronous (every agent mixes once per
iteration), so this example uses neighbor_allreduce, not windows: the graph
is set with is_weighted=True and each edge i -> j weighs the sender's share
1/(out-degree of i + 1), which makes the static neighbor_allreduce compute
sum_j C_ij x_j. The graph is a directed ring plus edges from agent 0 to
everyone: agent 0 sends to all, the others to one, and in-degrees differ,
so C is not doubly stochastic. The agents still reach the exact optimum.

The mixing of y is nonblocking, started with those of u and v; by default the
three run as one fused group, so it is over before the gradient is computed
(with BLUEFOG_FUSION_THRESHOLD=0 it runs alone and overlaps the gradient). In
a timeline, rows ``u``, ``v`` and ``y`` each show MPI_NEIGHBOR_ALLREDUCE on the
communication thread, and row ``x`` COMPUTE_GRADIENT on the main thread.
"""
import networkx as nx

import bluefog_lite as bf
from _logistic import centralized_optimum, finish, gradient, local_problem, parser, report, steps_of
from _timeline_note import shutdown_and_note


def ring_with_a_broadcaster(size):
    """Directed ring i -> i+1, plus 0 -> every agent; edge i -> j (self-loop
    included) weighs 1/(out-degree of i + 1): the columns of the mixing matrix
    sum to 1."""
    out = {i: {(i + 1) % size} - {i} for i in range(size)}
    out[0] |= set(range(1, size))
    G = nx.DiGraph()
    G.add_nodes_from(range(size))
    for i, targets in out.items():
        share = 1.0 / (len(targets) + 1)
        G.add_weighted_edges_from((i, j, share) for j in targets | {i})
    return G


def main():
    args = parser("push-DIGing on a directed graph with neighbor_allreduce", steps=300,
                  short_steps=150, lr=0.5).parse_args()
    bf.init(topology_fn=ring_with_a_broadcaster, is_weighted=True)
    A, y = local_problem(args)
    w_star = centralized_optimum(A, y)
    steps = steps_of(args)

    x = w_star.new_zeros(w_star.shape)
    u, v = x.clone(), x.new_ones(1)
    g = gradient(x, A, y)
    track = g.clone()                          # y of the algorithm: the gradient tracker
    for step in range(1, steps + 1):
        hu = bf.neighbor_allreduce_nonblocking(u - args.lr * track, name="u")
        hv = bf.neighbor_allreduce_nonblocking(v, name="v")
        hy = bf.neighbor_allreduce_nonblocking(track, name="y")
        u, v = bf.synchronize(hu), bf.synchronize(hv)
        x = u / v
        with bf.timeline_context("x", "COMPUTE_GRADIENT"):     # (y's mixing may still run: see above)
            g_new = gradient(x, A, y)
        track = bf.synchronize(hy) + g_new - g
        g = g_new
        report(step, x, w_star, every=steps // 10, total=steps)
    finish(x, w_star, args.save)
    shutdown_and_note()


if __name__ == "__main__":
    main()

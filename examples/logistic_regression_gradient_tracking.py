"""Gradient tracking (DIGing) for logistic regression with one-sided win_accumulate.

    bfrun -np 4 python examples/logistic_regression_gradient_tracking.py [--short] [--steps N] [--lr 0.5]

Each agent keeps its iterate w_i and a tracker q_i of the average gradient
(Nedic, Olshevsky, Shi, "Achieving geometric convergence for distributed
optimization over time-varying graphs", 2017: DIGing):

    w_i <- sum_j W_ij w_j - lr * q_i
    q_i <- sum_j W_ij q_j + grad f_i(w_i new) - grad f_i(w_i old),   q_i starts at grad f_i(w_i)

Since the sum of the trackers always equals the sum of the current local
gradients, the agents agree on a point where the *global* gradient vanishes:
the iterates reach the exact optimum with a constant step, unlike
decentralized SGD (logistic_regression_dsgd.py).

The mixing is done with windows instead of a two-sided exchange: every agent
pushes shares of w (and of q) into its out-neighbors' windows with
win_accumulate (one share each, keeping one for itself), then adds what its
in-neighbors pushed with win_update_then_collect. On the Exp-2 graph every
agent has as many in- as out-neighbors, so W is doubly stochastic, as DIGing
needs. One-sided pushes complete without the target's help; a named
allreduce after each round ("sync.w", "sync.q") makes every agent collect
exactly one push per neighbor per round (a fast agent's next push cannot
land before a slow agent's collect), which keeps the algorithm exact.

The push of q is started before the gradient at the new w is computed, so
the two can run at the same time. In a timeline compare COMPUTE_GRADIENT on
row ``w`` (main thread) with MPI_WIN_ACCUMULATE on row ``q`` (communication
thread); rows ``sync.w`` and ``sync.q`` hold the collectives that end rounds.
"""
import torch

import bluefog_lite as bf
import topology as topo
from _logistic import centralized_optimum, finish, gradient, local_problem, parser, report, steps_of
from _timeline_note import shutdown_and_note


def push(x, name, share):
    """Start adding share * x into each out-neighbor's window ``name``; once
    sent, x itself is scaled by share (the part this agent keeps)."""
    return bf.win_accumulate_nonblocking(x, name, self_weight=share,
                                         dst_weights={j: share for j in bf.out_neighbor_ranks()})


def collect(handle, name):
    """Complete the round: x <- share * x + what the in-neighbors pushed, i.e.
    x <- sum_j W_ij x_j, in place (the window holds x itself)."""
    bf.win_wait(handle)          # my pushes have landed in my neighbors' windows...
    bf.allreduce(torch.zeros(1), name=f"sync.{name}")   # ...and everyone's in mine
    # Rounds are separated by the collective, so no accumulate can race this collect.
    bf.win_update_then_collect(name, require_mutex=False)


def main():
    args = parser("gradient tracking (DIGing) with win_accumulate", steps=300, short_steps=150,
                  lr=0.5).parse_args()
    bf.init(topology_fn=topo.ExponentialTwoGraph)
    A, y = local_problem(args)
    w_star = centralized_optimum(A, y)
    steps = steps_of(args)
    share = 1.0 / (len(bf.out_neighbor_ranks()) + 1)

    w = torch.zeros_like(w_star)
    g = gradient(w, A, y)
    q = g.clone()
    bf.win_create(w, "w", zero_init=True)     # the window keeps w and q themselves:
    bf.win_create(q, "q", zero_init=True)     # collects update them in place
    for step in range(1, steps + 1):
        descent = args.lr * q                 # before q is pushed (and scaled)
        collect(push(w, "w", share), "w")
        w.sub_(descent)
        handle = push(q, "q", share)
        with bf.timeline_context("w", "COMPUTE_GRADIENT"):     # overlaps the push of q
            g_new = gradient(w, A, y)
        collect(handle, "q")
        q.add_(g_new - g)
        g = g_new
        report(step, w, w_star, every=steps // 10, total=steps)
    finish(w, w_star, args.save)
    bf.win_free()
    shutdown_and_note()


if __name__ == "__main__":
    main()

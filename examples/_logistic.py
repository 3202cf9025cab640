"""Shared part of the logistic-regression examples: the data, the loss, its
gradient, the centralized optimum, and the report of the distance to it.

Every agent holds its own samples of a regularized logistic regression,

    f_i(w) = (1/m) * sum_k log(1 + exp(-y_k * a_k.w)) + (rho/2) * |w|^2,

and the agents jointly minimize F(w) = (1/n) * sum_i f_i(w). The agents' data
differ on purpose (each has its own feature shift and its own labelling
vector), so each local minimizer is far from the global one: an algorithm
that only mixes what it sees locally pays for that heterogeneity.
"""
import argparse

import numpy as np
import torch

import bluefog_lite as bf
from _cli import output_file, positive_float, positive_int

RHO = 0.05


def make_data(rank, samples=200, dim=10, seed=17):
    """(A, y) of agent ``rank`` as float64 numpy arrays: A is samples x dim whose
    last column is the constant 1 (the bias), y holds labels in {-1, +1}."""
    shared = np.random.default_rng(seed).normal(size=dim)
    rng = np.random.default_rng([seed, rank])
    w_true = shared + rng.normal(size=dim)
    features = rng.normal(size=(samples, dim - 1)) + rng.normal(scale=0.5, size=dim - 1)
    A = np.hstack([features, np.ones((samples, 1))])
    prob = 1.0 / (1.0 + np.exp(-A @ w_true))
    y = np.where(rng.random(samples) < prob, 1.0, -1.0)
    return A, y


def local_problem(args):
    """This agent's data as torch tensors (the sizes were checked by the parser)."""
    A, y = make_data(bf.rank(), args.samples, args.dim)
    return torch.from_numpy(A), torch.from_numpy(y)


def gradient(w, A, y, rho=RHO):
    """Gradient of f_i at w (on the rows of A/y given: all of them, or a minibatch)."""
    margin = y * (A @ w)
    return -(A.T @ (y * torch.sigmoid(-margin))) / len(y) + rho * w


def loss(w, A, y, rho=RHO):
    return torch.nn.functional.softplus(-y * (A @ w)).mean() + 0.5 * rho * w.dot(w)


def centralized_optimum(A, y):
    """w* of the global problem: every agent gathers all the data and runs
    Newton's method on it (a reference independent of the decentralized run).
    All agents have the same number of samples, so F is the plain average
    of the loss over the gathered samples."""
    A_all = bf.allgather(A, name="data.A")
    y_all = bf.allgather(y, name="data.y")
    w = torch.zeros(A.shape[1], dtype=torch.float64)
    for _ in range(50):
        g = gradient(w, A_all, y_all)
        if g.norm() < 1e-13:
            break
        s = torch.sigmoid(y_all * (A_all @ w))
        H = (A_all.T * (s * (1 - s))) @ A_all / len(y_all) + RHO * torch.eye(len(w), dtype=w.dtype)
        step = torch.linalg.solve(H, g)
        t = 1.0                              # backtracking keeps the damped phase monotone
        while loss(w - t * step, A_all, y_all) > loss(w, A_all, y_all) and t > 1e-4:
            t /= 2
        w = w - t * step
    return w


def relative_distances(w, w_star, name="distance"):
    """Every agent's |w_i - w*| / |w*| (collective: all agents call it)."""
    mine = torch.tensor([float((w - w_star).norm() / w_star.norm())], dtype=torch.float64)
    return bf.allgather(mine, name=name)


def report(step, w, w_star, every, total):
    """Print the worst agent's relative distance on rank 0 every ``every`` steps
    (collective); returns it."""
    if step % max(1, every) and step != total:
        return None
    worst = relative_distances(w, w_star).max().item()
    if bf.rank() == 0:
        print(f"step {step:5d}: relative distance to the optimum (worst agent) {worst:.3e}", flush=True)
    return worst


def finish(w, w_star, save):
    """The final line (the figure of merit) and, with --save, the agents'
    final iterates (one row per agent) in a .npy file."""
    worst = relative_distances(w, w_star, name="final_distance").max().item()
    rows = bf.allgather(w.reshape(1, -1), name="final_w")
    if bf.rank() == 0:
        if save:
            np.save(save, rows.numpy())
        print(f"final relative distance to the optimum: {worst:.3e}", flush=True)
    return worst


def parser(description, steps, short_steps, lr):
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--steps", type=positive_int, default=None, help=f"iterations (default {steps})")
    ap.add_argument("--short", action="store_true", help=f"quick run for the tests ({short_steps} iterations)")
    ap.add_argument("--lr", type=positive_float, default=lr, help=f"step size (default {lr})")
    ap.add_argument("--samples", type=positive_int, default=200, help="samples per agent")
    ap.add_argument("--dim", type=positive_int, default=10, help="features, the bias included")
    ap.add_argument("--save", type=output_file, default=None, help="write the agents' final iterates to this .npy file")
    ap.set_defaults(default_steps=steps, short_steps=short_steps)
    return ap


def steps_of(args):
    if args.steps is not None:
        return args.steps
    return args.short_steps if args.short else args.default_steps

"""Numpy references shared by the worker scripts (imported from their own folder)."""
import numpy as np

import topology


def uniform_mixing(G):
    """The matrix M of the default neighbor average on graph G (uniform weights
    1/(in-degree+1), self included): one neighbor_allreduce takes x to M @ x."""
    A = (topology.mixing_matrix(G) > 0).astype(float)
    np.fill_diagonal(A, 1.0)
    return (A / A.sum(axis=0, keepdims=True)).T

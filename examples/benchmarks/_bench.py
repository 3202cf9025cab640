"""Shared helpers of the benchmark scripts: sizes, interleaved timing, baselines, JSON output.

Import this module first: it pins one BLAS/OpenMP thread per agent before
numpy or torch start their thread pools (agents share cores; idle OpenBLAS
threads spin, ../shared/LIMITS.md point 2).
"""
import argparse
import json
import os
import socket
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402  (after the thread settings on purpose)


def parse_size(text):
    """'4K' -> 4096, '1M' -> 1048576, '100' -> 100 (bytes); 4KB and 4KiB mean 4K too.
    Raises argparse.ArgumentTypeError naming the accepted forms."""
    body = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(body[-1:], 1)
    try:
        nbytes = int(float(body.rstrip("KMG")) * mult)
    except (ValueError, OverflowError):     # (OverflowError: inf)
        nbytes = -1
    if nbytes <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use bytes or a number with K, M or G "
                                         "(4K = 4KB = 4KiB = 4096 bytes)")
    return nbytes


def size_list(text):
    """An argparse type: a comma list of sizes (parse_size) -> [bytes]."""
    return [parse_size(s) for s in text.split(",")]


def choice_list(choices):
    """An argparse type: a comma list of words, each one of choices -> [words]."""
    def parse(text):
        words = text.split(",")
        bad = [w for w in words if w not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, bad))}: choose from "
                                             f"{', '.join(choices)}")
        return words
    return parse


def positive_int(text):
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def size_label(nbytes):
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):g} MB"
    return f"{nbytes / 1024:g} KB" if nbytes >= 1024 else f"{nbytes} B"


def reps_for(nbytes, budget_bytes=2e7, lo=3, hi=300):
    """Calls per timed block: about budget_bytes moved, between lo and hi calls
    (hi wins where it is below lo: --max-reps is a bound)."""
    return min(hi, max(lo, int(budget_bytes // max(nbytes, 1))))


def interleaved(methods, reps, trials, comm, same=()):
    """{name: (median, min, max)} over trials of the slowest agent's mean seconds per call.

    Methods run in rounds (A B C A B C ...), each block preceded by a barrier,
    so drift of the machine's load hits every method alike. One untimed call of
    each method first (connections, buffers, allocator); same: (name, reference)
    pairs of methods whose first results must agree (check_same), so that a
    library call that computes the wrong thing cannot look fast."""
    from mpi4py import MPI
    first = {name: fn() for name, fn in methods.items()}
    check_same(first, same, comm)
    samples = {name: [] for name in methods}
    for _ in range(trials):
        for name, fn in methods.items():
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            dt = (time.perf_counter() - t0) / reps
            samples[name].append(comm.allreduce(dt, op=MPI.MAX))
    return {name: spread(v) for name, v in samples.items()}


def check_same(results, pairs, comm, rtol=1e-4, atol=1e-5):
    """Stop the benchmark on every agent (SystemExit naming the methods) unless, on
    every agent, results[name] equals results[reference] for each (name, reference)
    in pairs. A result is an array, a tensor, or a list of them (concatenated)."""
    def flat(value):
        if isinstance(value, (list, tuple)):
            return np.concatenate([flat(v) for v in value]) if value else np.empty(0)
        if hasattr(value, "cpu"):       # a torch tensor, maybe on a device
            value = value.detach().cpu().numpy()
        return np.asarray(value, dtype=np.float64).ravel()
    def same(a, b):
        return a.shape == b.shape and np.allclose(a, b, rtol=rtol, atol=atol)
    wrong = [f"{name} != {ref}" for name, ref in pairs if not same(flat(results[name]), flat(results[ref]))]
    agents = comm.allgather(wrong)
    if any(agents):
        raise SystemExit("benchmark stopped: results differ on agents "
                         + "; ".join(f"{r}: {', '.join(w)}" for r, w in enumerate(agents) if w))


def spread(values):
    """(median, min, max) of a non-empty sequence, as floats."""
    return float(np.median(values)), float(min(values)), float(max(values))


class RawNeighborAverage:
    """The raw mpi4py baseline of neighbor_allreduce: receive the neighbors' arrays,
    then one BLAS gemv over a contiguous (k+1, n) buffer (self row copied in). shared:
    a larger such buffer whose first k+1 rows it uses (one for every step of a dynamic
    topology, as the library reuses its pooled buffers: a buffer per step received
    into untouched pages, ten times slower at 16 MB, on most timed calls)."""

    def __init__(self, n, self_weight, src_weights, dtype=np.float32, shared=None):
        self.ranks = list(src_weights)
        k = len(self.ranks)
        self.buf = np.empty((k + 1, n), dtype=dtype) if shared is None else shared[:k + 1]
        self.w = np.array([self_weight] + [src_weights[r] for r in self.ranks], dtype=dtype)

    def combine(self, x):
        self.buf[0] = x
        return self.w @ self.buf


def raw_static(graph_comm, x, in_ranks):
    """Neighbor_allgather on a dist-graph communicator + weighted sum (uniform weights)."""
    w = 1.0 / (len(in_ranks) + 1)
    avg = RawNeighborAverage(x.size, w, {r: w for r in in_ranks}, x.dtype)

    def run():
        graph_comm.Neighbor_allgather(x, avg.buf[1:])
        return avg.combine(x)
    return run


def raw_dynamic(comm, x, steps):
    """Per step: Isend to the step's send ranks, Irecv from its receive ranks, then the
    weighted sum. steps: list of (send_ranks, recv_ranks), cycled in lockstep."""
    from mpi4py import MPI
    shared = np.empty((max(len(recv) for _, recv in steps) + 1, x.size), dtype=x.dtype)
    plans = []
    for send, recv in steps:
        w = 1.0 / (len(recv) + 1)
        plans.append((send, recv, RawNeighborAverage(x.size, w, {r: w for r in recv}, x.dtype, shared)))
    counter = [0]

    def run():
        send, recv, avg = plans[counter[0] % len(plans)]
        counter[0] += 1
        reqs = [comm.Irecv(avg.buf[i + 1], source=r, tag=7) for i, r in enumerate(recv)]
        reqs += [comm.Isend(x, dest=d, tag=7) for d in send]
        MPI.Request.Waitall(reqs)
        return avg.combine(x)
    return run


def init_gloo(comm):
    """torch.distributed with gloo on 127.0.0.1; rank and world size from MPI, port chosen
    by rank 0 (a free one) and broadcast over MPI."""
    import torch.distributed as dist
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=comm.rank, world_size=comm.size)
    return dist


def add_common_arguments(parser, trials=5, max_reps=True):
    parser.add_argument("--trials", type=positive_int, default=trials, help="timed rounds per method")
    if max_reps:
        parser.add_argument("--max-reps", type=positive_int, default=300,
                            help="at most this many calls per timed block")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="rank 0 writes the results here as JSON (rows of key + values)")


def write_json(path, bench, agents, params, rows):
    """rows: list of {"key": {...}, "values": {name: float}}. Does nothing when path is None.
    The file appears whole or not at all (written aside, then renamed)."""
    if path is None:
        return
    with open(path + ".part", "w") as f:
        json.dump({"bench": bench, "agents": agents, "params": params, "rows": rows}, f, indent=1)
    os.replace(path + ".part", path)

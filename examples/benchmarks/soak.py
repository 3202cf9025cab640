"""Soak: many small operations in a row, checking that nothing grows and nothing drifts
(run: mpiexec -n 4 python soak.py, or bfrun -np 4 python examples/benchmarks/soak.py).

Default: 100,000 neighbor_allreduce of 16 floats and 20,000 window operations
(win_accumulate with the target's mutex, win_put, win_get, win_update,
win_update_then_collect, a nonblocking put) per agent. After a warm-up (the first
WARMUP of each phase) it samples, on every agent: resident memory (VmRSS), OS
threads and Python threads, live operation handles, names in flight, entries
waiting in the engine's inbox, handles kept per window, and Python objects. At
the end every agent must have: resident memory at most 10% above the post-warm-up
sample, the same threads, no live handle, an empty inbox; and the numbers must be
right: the neighbor averages reach the exact average of the initial values, and
every accumulate arrived exactly once (counted by win_update_then_collect).

Prints one SOAK line per agent and sample and a summary; exits non-zero on a
failed check. tests/test_reliability.py runs it with smaller counts.
"""
import argparse
import gc
import os
import sys
import threading
import time

import numpy as np
import torch

import bluefog_lite as bf
from bluefog_lite import _runtime

WARMUP = 0.1          # fraction of each phase before the baseline sample
RSS_GROWTH_LIMIT = 0.10


def proc_status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def sample(phase, done):
    """What must not grow, on this agent, at a quiescent point (after a barrier)."""
    gc.collect()
    eng = _runtime.state().engine
    windows = _runtime.state().windows
    s = {"phase": phase, "done": done, "rss_kb": proc_status("VmRSS"), "os_threads": proc_status("Threads"),
         "py_threads": threading.active_count(), "handles": len(eng._ops), "names": len(eng._names),
         "inbox": len(eng.stream.inbox), "window_handles": sum(len(w.handles) for w in windows.values()),
         "objects": len(gc.get_objects())}
    fields = " ".join(f"{k}={v}" for k, v in s.items())
    os.write(1, f"SOAK {bf.rank()} {fields}\n".encode())
    return s


def neighbor_phase(count, samples):
    """x <- W x, count times, on the static Exp-2 graph (doubly stochastic): every
    agent ends at the average of the initial values."""
    rank, size = bf.rank(), bf.size()
    x = torch.from_numpy(np.random.default_rng(rank).normal(size=16))
    target = np.mean([np.random.default_rng(r).normal(size=16) for r in range(size)], axis=0)
    marks = {int(count * WARMUP), count // 2}
    for i in range(count):
        x = bf.neighbor_allreduce(x, name="soak.x")
        if i + 1 in marks:
            bf.barrier()
            samples.append(sample("neighbor_allreduce", i + 1))
    bf.barrier()
    samples.append(sample("neighbor_allreduce", count))
    return float(np.max(np.abs(x.numpy() - target)))


def window_phase(count, samples):
    """Six kinds of window operations in turn; returns (accumulates made, ones collected)."""
    ones = torch.ones(16, dtype=torch.float64)
    bf.win_create(torch.zeros(16, dtype=torch.float64), "soak.sum", zero_init=True)
    bf.win_create(torch.zeros(16), "soak.put")
    mine = torch.zeros(16)
    accumulates = 0
    collected = torch.zeros(16, dtype=torch.float64)
    first = max(int(count * WARMUP), 6)     # (the baseline: after every kind has run once, the second window too)
    marks = {first, max(count // 2, first)}
    for i in range(count):
        kind = i % 6
        if kind == 0:
            bf.win_accumulate(ones, "soak.sum", require_mutex=True)
            accumulates += 1
        elif kind == 1:
            bf.win_put(mine + i, "soak.put")
        elif kind == 2:
            bf.win_get("soak.put")
        elif kind == 3:
            bf.win_update("soak.put", clone=True)
        elif kind == 4:
            collected += bf.win_update_then_collect("soak.sum")
            bf.win_update("soak.sum", 0.0, {}, require_mutex=True)     # back to 0 for the next count
        else:
            bf.win_wait(bf.win_put_nonblocking(mine, "soak.put"))
        if i + 1 in marks:
            bf.barrier()
            samples.append(sample("window", i + 1))
    bf.barrier()
    collected += bf.win_update_then_collect("soak.sum")
    samples.append(sample("window", count))
    bf.win_free()
    return accumulates, collected


def check(samples, start_of_phase):
    """Problems with growth between the post-warm-up sample and the last one."""
    base, last = samples[start_of_phase], samples[-1]
    problems = []
    growth = (last["rss_kb"] - base["rss_kb"]) / base["rss_kb"]
    if growth > RSS_GROWTH_LIMIT:
        problems.append(f"resident memory grew {growth:.1%} ({base['rss_kb']} -> {last['rss_kb']} kB)")
    for key in ("os_threads", "py_threads"):
        if last[key] != base[key]:
            problems.append(f"{key} {base[key]} -> {last[key]}")
    for key in ("handles", "names", "window_handles"):
        if last[key] > base[key]:
            problems.append(f"{key} {base[key]} -> {last[key]}")
    if last["inbox"] > bf.size():
        problems.append(f"{last['inbox']} entries wait in the inbox")
    return problems, growth


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nar", type=int, default=100_000, help="neighbor_allreduce calls per agent")
    parser.add_argument("--win", type=int, default=20_000, help="window operations per agent")
    args = parser.parse_args()
    bf.init()
    rank, size = bf.rank(), bf.size()
    problems, lines = [], []

    t0 = time.perf_counter()
    samples = [sample("start", 0)]
    error = neighbor_phase(args.nar, samples)
    t_nar = time.perf_counter() - t0
    found, growth = check(samples, 1)
    problems += [f"neighbor_allreduce: {p}" for p in found]
    if error > 1e-9:
        problems.append(f"neighbor_allreduce: {error:.3g} away from the exact average")
    lines.append(f"neighbor_allreduce x{args.nar}: {t_nar:.1f} s ({t_nar / args.nar * 1e6:.0f} us/op), "
                 f"RSS {growth:+.1%} after warm-up, distance to the average {error:.1e}")

    t0 = time.perf_counter()
    first = len(samples)
    accumulates, collected = window_phase(args.win, samples)
    t_win = time.perf_counter() - t0
    found, growth = check(samples, first)
    problems += [f"window: {p}" for p in found]
    expected = accumulates * len(bf.in_neighbor_ranks())
    if not torch.equal(collected, torch.full((16,), float(expected), dtype=torch.float64)):
        problems.append(f"window: collected {collected[:3].tolist()}..., expected {expected} in every entry")
    lines.append(f"window ops x{args.win}: {t_win:.1f} s ({t_win / args.win * 1e6:.0f} us/op), "
                 f"RSS {growth:+.1%} after warm-up, {accumulates} accumulates per agent all counted")

    end = samples[-1]
    lines.append(f"end: RSS {end['rss_kb'] / 1024:.0f} MiB (start {samples[0]['rss_kb'] / 1024:.0f} MiB), "
                 f"{end['os_threads']} OS threads, {end['handles']} live handles, {end['objects']} objects "
                 f"(post-warm-up {samples[1]['objects']})")
    for line in lines:
        os.write(1, f"SOAK SUMMARY {rank}: {line}\n".encode())
    for p in problems:
        os.write(1, f"SOAK PROBLEM {rank}: {p}\n".encode())
    failed = bf.allreduce(torch.tensor([len(problems)]), average=False, name="soak.problems")
    bf.shutdown()
    if int(failed) == 0:
        os.write(1, f"AGENT OK {rank}\n".encode())
    elif rank == 0:
        os.write(1, f"SOAK FAILED on {size} agents\n".encode())
    sys.exit(0 if int(failed) == 0 else 1)


if __name__ == "__main__":
    main()

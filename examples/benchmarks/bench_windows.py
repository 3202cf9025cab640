"""Benchmark of one-sided window operations.

    mpiexec -n 4 python examples/benchmarks/bench_windows.py [--sizes 4K,64K,1M,16M] [--rounds 5]
        [--parts rma,busy,side] [--json out.json]

1. win_put / win_accumulate to every out-neighbor (ExponentialGraph: 2 at N=4)
   against raw mpi4py on Win.Allocate windows, same run, same sizes (float32):
   Lock/Put/Unlock per target, and the calls win_put itself makes (Lock_all once,
   Put + Flush) without the library around them.
2. 1 MB accumulates (with the target's mutex) into an agent that computes for 1 s
   without calling MPI.
3. What a window costs the rest: neighbor_allreduce (all agents), rank 0's
   compute loop, an idle agent's CPU use; without a window, with an idle one, and
   while the neighbors keep putting into rank 0.

All agents run each measurement at the same time. The methods are interleaved in
rounds (A B C A B C ...) so that scheduler noise and drift hit them equally;
numbers are medians per agent, averaged over agents. On an oversubscribed host
small-message times still vary between launches: compare rows of one run.
"""
import argparse
import time

import _bench
import numpy as np
import torch

import bluefog_lite as bf
from bluefog_lite._mpi import MPI

def reps_for(nbytes):
    return 40 if nbytes <= 64 << 10 else (10 if nbytes <= 1 << 20 else 2)


def interleaved(methods, reps, sync, rounds):
    """{name: median seconds} of calls of each method, run in `rounds` interleaved blocks."""
    samples = {name: [] for name in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            sync()
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
    return {name: float(np.median(s)) for name, s in samples.items()}


def mean_over_agents(x):
    return float(bf.allreduce(torch.tensor([x], dtype=torch.float64), name="bench.mean")[0])


def raw_lock_round(win, dsts, src, accumulate):
    """Lock/op/Unlock per target: a lock request the target must answer."""
    for d in dsts:
        win.Lock(d, MPI.LOCK_SHARED)
        if accumulate:
            win.Accumulate([src, MPI.FLOAT], d, target=0, op=MPI.SUM)
        else:
            win.Put([src, MPI.FLOAT], d, target=0)
        win.Unlock(d)


def raw_flush_round(win, dsts, src, accumulate):
    """The MPI calls win_put makes, without the library: (Lock_all once), op + Flush."""
    for d in dsts:
        if accumulate:
            win.Accumulate([src, MPI.FLOAT], d, target=0, op=MPI.SUM)
        else:
            win.Put([src, MPI.FLOAT], d, target=0)
        win.Flush(d)


def raw_window(comm, nbytes):
    win = MPI.Win.Allocate(nbytes, 1, comm=comm)
    np.frombuffer(win.tomemory(), np.uint8)[:] = 0
    return win


def bench_rma(comm, sizes, rounds):
    outs = bf.out_neighbor_ranks()
    rows = []
    for nbytes in sizes:
        src, t = np.ones(nbytes // 4, np.float32), torch.ones(nbytes // 4)
        locked, epoch = raw_window(comm, nbytes), raw_window(comm, nbytes)
        epoch.Lock_all(MPI.MODE_NOCHECK)
        bf.win_create(t, "bench", zero_init=True)
        methods = {
            "lock_put": lambda: raw_lock_round(locked, outs, src, False),
            "flush_put": lambda: raw_flush_round(epoch, outs, src, False),
            "put": lambda: bf.win_put(t, "bench"),
            "lock_acc": lambda: raw_lock_round(locked, outs, src, True),
            "flush_acc": lambda: raw_flush_round(epoch, outs, src, True),
            "acc": lambda: bf.win_accumulate(t, "bench"),
            "acc_mutex": lambda: bf.win_accumulate(t, "bench", require_mutex=True),
        }
        res = interleaved(methods, reps_for(nbytes), comm.Barrier, rounds)
        bf.barrier()
        bf.win_free("bench")
        epoch.Unlock_all()
        locked.Free()
        epoch.Free()
        rows.append((nbytes, {k: mean_over_agents(v) for k, v in res.items()}))
    return rows


def busy_target(seconds=1.0):
    """Rank 0 computes; rank size-1 (an in-neighbor) accumulates 1 MB into it every 10 ms."""
    rank, size = bf.rank(), bf.size()
    t = torch.ones(256 * 1024)
    bf.win_create(t, "busy", zero_init=True)
    bf.barrier()
    times = []
    if rank == 0:
        a, t0 = np.random.default_rng(0).random((160, 160)), time.time()
        while time.time() - t0 < seconds:
            a = a @ a
            a /= np.abs(a).max()
    elif rank == size - 1:
        time.sleep(0.05)
        t_end = time.time() + seconds * 0.8
        while time.time() < t_end:
            t0 = time.perf_counter()
            bf.win_accumulate(t, "busy", dst_weights={0: 1.0}, require_mutex=True)
            times.append(time.perf_counter() - t0)
            time.sleep(0.01)
    bf.barrier()
    bf.win_free("busy")
    # only the writer has timings: sums over agents are its numbers
    calls = int(bf.allreduce(torch.tensor([len(times)]), average=False, name="bench.busy.n")[0])
    median = float(bf.allreduce(torch.tensor([float(np.median(times)) if times else 0.0],
                                             dtype=torch.float64), average=False, name="bench.busy")[0])
    return median, calls


def compute_loop(iters=300):
    a = torch.rand(160, 160)
    t0 = time.perf_counter()
    for _ in range(iters):
        a = a @ a
        a /= a.abs().max()
    return time.perf_counter() - t0


def target_compute(neighbors, repeats=3):
    """Rank 0's compute-loop times while its in-neighbors are idle, put 1 MB into its
    window every 5 ms ("put"), or copy 1 MB in their own memory every 5 ms ("copy",
    the control: same CPU and memory traffic, no window). A nonblocking allreduce
    tells them when rank 0 is done."""
    bf.barrier()
    if bf.rank() == 0:
        times = [compute_loop() for _ in range(repeats)]
        bf.allreduce(torch.zeros(1), name="bench.target.done")
        return times
    done = bf.allreduce_nonblocking(torch.zeros(1), name="bench.target.done")
    t, scratch = torch.ones(256 * 1024), torch.empty(256 * 1024)
    active = 0 in bf.out_neighbor_ranks()
    while not bf.poll(done):
        if active and neighbors == "put":
            bf.win_put(t, "side", dst_weights={0: 1.0})
        elif active and neighbors == "copy":
            scratch.copy_(t)
        time.sleep(0.005)
    bf.synchronize(done)
    return []


def idle_cpu_share(seconds=0.7):
    """CPU time / wall time of an agent whose main thread sleeps (the comm thread's pokes)."""
    c0, w0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return (time.process_time() - c0) / (time.perf_counter() - w0)


CONDITIONS = {"no window": "idle", "window exists (idle)": "idle",
              "control: no window op, in-neighbors copy 1 MB locally / 5 ms": "copy",
              "in-neighbors win_put 1 MB into rank 0 / 5 ms": "put"}


def side_effects(rounds):
    x, small = torch.ones(256 * 1024), torch.ones(1024)
    samples = {c: {"nar_4k": [], "nar_1m": [], "compute": [], "idle_cpu": []} for c in CONDITIONS}
    for _ in range(rounds):
        for cond in CONDITIONS:
            want = cond != "no window"
            if want and not bf.get_current_created_window_names():
                bf.win_create(torch.zeros(256 * 1024), "side")
            if not want:
                bf.win_free()
            s = samples[cond]
            for key, t, reps in (("nar_4k", small, 40), ("nar_1m", x, 8)):
                bf.barrier()
                for _ in range(reps):
                    t0 = time.perf_counter()
                    bf.neighbor_allreduce(t, name="bench." + key)
                    s[key].append(time.perf_counter() - t0)
            s["compute"] += target_compute(CONDITIONS[cond])
            bf.barrier()
            if CONDITIONS[cond] == "idle":
                s["idle_cpu"].append(idle_cpu_share())
    bf.win_free()
    med = lambda v: float(np.median(v)) if v else 0.0   # noqa: E731
    return {c: {k: mean_over_agents(med(v)) * (bf.size() if k == "compute" else 1) for k, v in s.items()}
            for c, s in samples.items()}


def report(rows, busy, side):
    us = lambda s: f"{s * 1e6:.1f}"   # noqa: E731
    label = _bench.size_label
    if rows:
        report_rma(rows, us, label)
    if busy is not None:
        print(f"\n1 MB win_accumulate(require_mutex=True) into an agent computing for 1 s without MPI "
              f"calls: median {busy[0] * 1e3:.2f} ms over {busy[1]} calls")
    if side is not None:
        report_side(side, us)


def report_rma(rows, us, label):
    print(f"N={bf.size()} agents, ExponentialGraph, {len(bf.out_neighbor_ranks())} out-neighbors each; "
          "one round = the op to every out-neighbor; median per agent, mean over agents, in us")
    for op, key in (("put", "put"), ("accumulate", "acc")):
        print(f"\n| size | raw Lock/{op}/Unlock | raw {op}+Flush in Lock_all | win_{op} "
              f"| ratio to Lock/{op}/Unlock | ratio to {op}+Flush |")
        print("|---|---|---|---|---|---|")
        for nbytes, r in rows:
            print(f"| {label(nbytes)} | {us(r['lock_' + key])} | {us(r['flush_' + key])} | {us(r[key])} "
                  f"| {r[key] / r['lock_' + key]:.2f} | {r[key] / r['flush_' + key]:.2f} |")
    print("\n| size | win_accumulate(require_mutex=True) | ratio to win_accumulate |\n|---|---|---|")
    for nbytes, r in rows:
        print(f"| {label(nbytes)} | {us(r['acc_mutex'])} | {r['acc_mutex'] / r['acc']:.2f} |")


def report_side(side, us):
    print("\n| condition | neighbor_allreduce 4 KB (us) | neighbor_allreduce 1 MB (us) "
          "| rank 0 compute loop (ms) | idle agent CPU use |")
    print("|---|---|---|---|---|")
    for cond, r in side.items():
        cpu = f"{r['idle_cpu'] * 100:.1f}%" if r["idle_cpu"] else "-"
        print(f"| {cond} | {us(r['nar_4k'])} | {us(r['nar_1m'])} | {r['compute'] * 1e3:.1f} | {cpu} |")


RMA_RATIOS = {"put/lock_put": ("put", "lock_put"), "put/flush_put": ("put", "flush_put"),
              "acc/lock_acc": ("acc", "lock_acc"), "acc/flush_acc": ("acc", "flush_acc"),
              "acc_mutex/acc": ("acc_mutex", "acc")}


def json_rows(rows, busy, side):
    out = []
    for nbytes, r in rows:
        values = {f"{k}_s": v for k, v in r.items()}
        values.update({name: r[a] / r[b] for name, (a, b) in RMA_RATIOS.items()})
        out.append({"key": {"table": "rma", "bytes": nbytes}, "values": values})
    if busy is not None:
        out.append({"key": {"table": "busy"}, "values": {"median_s": busy[0], "calls": busy[1]}})
    for cond, r in (side or {}).items():
        out.append({"key": {"table": "side", "condition": cond},
                    "values": {"nar_4k_s": r["nar_4k"], "nar_1m_s": r["nar_1m"], "compute_s": r["compute"],
                               "idle_cpu": r["idle_cpu"]}})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=_bench.size_list, default="4K,64K,1M,16M")
    ap.add_argument("--rounds", type=_bench.positive_int, default=5, help="interleaved rounds per measurement")
    ap.add_argument("--parts", type=_bench.choice_list(("rma", "busy", "side")), default="rma,busy,side",
                    help="comma list of: rma (ops vs raw RMA), busy (busy target), side (side effects)")
    ap.add_argument("--json", default=None, metavar="PATH", help="rank 0 writes the results here as JSON")
    args = ap.parse_args()
    parts, sizes = set(args.parts), args.sizes
    bf.init()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD.Dup()
    rows = bench_rma(comm, sizes, args.rounds) if "rma" in parts else []
    busy = busy_target() if "busy" in parts else None
    side = side_effects(args.rounds) if "side" in parts else None
    if bf.rank() == 0:
        report(rows, busy, side)
    _bench.write_json(args.json if bf.rank() == 0 else None, "windows", bf.size(),
                      {"sizes": sizes, "rounds": args.rounds, "parts": sorted(parts),
                       "out_degree": len(bf.out_neighbor_ranks())}, json_rows(rows, busy, side))
    comm.Free()
    bf.shutdown()


if __name__ == "__main__":
    main()

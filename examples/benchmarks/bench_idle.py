"""What an idle bluefog_lite costs computation: agents compute while their communication threads idle.

    mpiexec -n 8 python examples/benchmarks/bench_idle.py [--seconds 1] [--trials 5] [--json out.json]

Every agent runs a pure-CPU loop (small matmuls, one torch thread) for
`--seconds` per round while bluefog_lite is initialized and has nothing in
flight. Rounds alternate between the engine's idle poke (the thread wakes every
50 ms to look for MPI progress) and the 2 ms poke it used before
(`engine.idle_poke_s`, set in place between rounds). Not part of run_all: it
measures one engine setting (docs/performance.md, "Idle cost").
Prints the total compute steps per second of all agents for each setting
(median over trials) and their ratio.
"""
import argparse
import time

import _bench
import torch

import bluefog_lite as bf
from bluefog_lite._mpi import MPI
from bluefog_lite._runtime import state

SETTINGS = {"idle_poke_50ms": 0.05, "poke_2ms": 0.002}


def compute_rate(seconds):
    a = torch.randn(64, 64)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(100):
            a = torch.tanh(a @ a * 0.01)
        n += 100
    return n / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="compute time per round")
    _bench.add_common_arguments(ap, max_reps=False)
    args = ap.parse_args()
    bf.init()
    torch.set_num_threads(1)
    comm, eng = MPI.COMM_WORLD, state().engine
    bf.neighbor_allreduce(torch.ones(4), name="bench.idle.warm")
    samples = {name: [] for name in SETTINGS}
    for _ in range(args.trials):
        for name, poke in SETTINGS.items():
            eng.idle_poke_s = poke
            bf.barrier()
            time.sleep(0.1)          # every thread back asleep with this setting's timeout
            samples[name].append(comm.allreduce(compute_rate(args.seconds), op=MPI.SUM))
    eng.idle_poke_s = SETTINGS["idle_poke_50ms"]
    res = {name: _bench.spread(v) for name, v in samples.items()}
    ratio = res["idle_poke_50ms"][0] / res["poke_2ms"][0]
    if comm.rank == 0:
        print(f"{comm.size} agents computing while idle; total steps/s, median of {args.trials} trials")
        for name, (med, lo, hi) in res.items():
            print(f"{name:>15} {med:10.0f}  ({lo:.0f}-{hi:.0f})")
        print(f"idle poke 50 ms / 2 ms: {ratio:.2f}x the compute throughput")
    rows = [{"key": {"setting": name}, "values": {"median": v[0], "min": v[1], "max": v[2]}}
            for name, v in res.items()]
    _bench.write_json(args.json if comm.rank == 0 else None, "idle", comm.size,
                      {"seconds": args.seconds, "trials": args.trials}, rows)
    bf.shutdown()


if __name__ == "__main__":
    main()

"""1200 runs (init() ... shutdown()) in one process on 2 agents (~8 s): the
communicators of ended runs are freed at the init() after next (see
runtime_runs.py). When every run kept its two, MPICH ran out of communicators at
run 1022 (init() raised an opaque MPI.Exception)."""
import bluefog_lite as bf

for run in range(1200):
    bf.init()
    rank = bf.rank()
    if run % 100 == 0:
        bf.barrier()
    bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

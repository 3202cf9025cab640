"""Run several examples one after the other in one job (one start-up instead of
one per example): each example's own main() with the arguments below and
--save <dir>/<label>.npy. Rank 0 prints "EXAMPLE <label>"
before each, so the test can match every final line to its run.
argv: the output directory."""
import importlib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "examples"))

from mpi4py import MPI  # noqa: E402

LOGISTIC = ["logistic_regression_dsgd", "logistic_regression_gradient_tracking",
            "logistic_regression_exact_diffusion", "logistic_regression_push_diging"]
out_dir = sys.argv[1]
RUNS = [(label, module, args + ["--save", os.path.join(out_dir, label + ".npy")]) for label, module, args in (
    ("consensus_static", "average_consensus", ["--short"]),                  # 10 steps, 1000 entries
    ("consensus_dynamic", "average_consensus", ["--dynamic", "--steps", "4", "--dim", "1000"]),
    ("push_sum", "average_consensus_push_sum", ["--short"]))]
RUNS += [(name, name, ["--short", "--save", os.path.join(out_dir, name + ".npy")]) for name in LOGISTIC]
RUNS += [("logistic_regression_diffusion", "logistic_regression_exact_diffusion",
          ["--short", "--variant", "diffusion", "--save", os.path.join(out_dir, "logistic_regression_diffusion.npy")])]
rank = MPI.COMM_WORLD.rank
for label, module, args in RUNS:
    if rank == 0:
        print(f"EXAMPLE {label}", flush=True)
    sys.argv = [module + ".py", *args]
    importlib.import_module(module).main()       # bf.init() ... bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

"""Run the four logistic-regression examples one after the other in one job
(one start-up instead of four): each example's own main(), with --short and
--save <dir>/<name>.npy. Rank 0 prints "EXAMPLE <name>" before each, so the
test can match every final line to its example. argv: the output directory."""
import importlib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "examples"))

from mpi4py import MPI  # noqa: E402

NAMES = ["logistic_regression_dsgd", "logistic_regression_gradient_tracking",
         "logistic_regression_exact_diffusion", "logistic_regression_push_diging"]

out_dir = sys.argv[1]
rank = MPI.COMM_WORLD.rank
for name in NAMES:
    if rank == 0:
        print(f"EXAMPLE {name}", flush=True)
    sys.argv = [name + ".py", "--short", "--save", os.path.join(out_dir, name + ".npy")]
    importlib.import_module(name).main()       # bf.init() ... bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

"""Training throughput of the CNN example: bluefog_lite optimizers vs torch DDP on gloo, same run.

    mpiexec -n 4 python examples/benchmarks/bench_training.py [--steps 20] [--rounds 5] [--batch 32]
        [--methods awc,awc_timeline,atc,winput,gradallreduce,ddp] [--json out.json]

Every method trains its own copy of the same model (examples/cnn_patterns.py's
make_model and training_set when that module imports cleanly, else an equivalent
CNN and generated data defined here) from the same initial weights, with
torch.optim.SGD(lr=0.02, momentum=0.9), on the same batches:
- awc, atc: DistributedAdaptWithCombine / AdaptThenCombine, neighbor_allreduce on Exp-2;
- winput: DistributedWinPutOptimizer (one-sided puts to the Exp-2 out-neighbors);
- gradallreduce: DistributedGradientAllreduceOptimizer (allreduce of gradients);
- ddp: torch.nn.parallel.DistributedDataParallel on a gloo process group;
- awc_timeline: awc with the timeline recording (bf.timeline_start for its rounds,
  FORWARD/BACKWARD hooks installed): awc_timeline/awc is the timeline's overhead
  on this training loop (step time, on / off).
Methods alternate in rounds of `steps` steps; a round's throughput is
agents * batch / (slowest agent's mean step time). Figures are medians over rounds.
"""
import argparse
import copy
import os
import shutil
import sys
import tempfile
import time

import _bench
import torch
import torch.nn.functional as F

import bluefog_lite as bf
import topology
from bluefog_lite._mpi import MPI

METHODS = ("awc", "awc_timeline", "atc", "winput", "gradallreduce", "ddp")


def _fallback_model():
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(16 * 4 * 4, 10))


def _fallback_data(rank, size, samples):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(samples, 16, 16, generator=g).numpy(), torch.randint(0, 10, (samples,), generator=g).numpy()


def model_and_data():
    """(make_model, training_set, source): the CNN example's builders if importable."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        from cnn_patterns import make_model, training_set
        make_model(), training_set(0, 1, 2)
        return make_model, training_set, "examples/cnn_patterns.py"
    except Exception as e:   # the example is optional and may be mid-edit: say so, use our own
        print(f"bench_training: using the built-in CNN ({type(e).__name__}: {e})", file=sys.stderr)
        return _fallback_model, _fallback_data, "built-in CNN (cnn_patterns.py not importable)"


def build(method, model):
    """(model, optimizer) of one method; the model is wrapped in DDP for "ddp"."""
    if method == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    nar = bf.CommunicationType.neighbor_allreduce
    wrappers = {
        "awc": lambda: bf.DistributedAdaptWithCombineOptimizer(opt, model, nar),
        "awc_timeline": lambda: bf.DistributedAdaptWithCombineOptimizer(opt, model, nar),
        "atc": lambda: bf.DistributedAdaptThenCombineOptimizer(opt, model, nar),
        "winput": lambda: bf.DistributedWinPutOptimizer(opt, model, window_prefix="bench.winput"),
        "gradallreduce": lambda: bf.DistributedGradientAllreduceOptimizer(opt, model),
        "ddp": lambda: opt,
    }
    return model, wrappers[method]()


def run_steps(model, opt, batches, start, steps):
    for k in range(start, start + steps):
        images, labels = batches[k % len(batches)]
        opt.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        opt.step()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=_bench.positive_int, default=20, help="steps per round")
    ap.add_argument("--rounds", type=_bench.positive_int, default=5)
    ap.add_argument("--batch", type=_bench.positive_int, default=32)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json", default=None, metavar="PATH", help="rank 0 writes the results here as JSON")
    args = ap.parse_args()
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        ap.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    bf.init(topology_fn=topology.ExponentialTwoGraph)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD.Dup()
    dist = _bench.init_gloo(comm) if "ddp" in methods else None
    make_model, training_set, source = model_and_data()
    torch.manual_seed(0)
    base = make_model()
    bf.broadcast_parameters(base.state_dict(), root_rank=0)
    images, labels = training_set(bf.rank(), bf.size(), 16 * args.batch)
    images, labels = torch.from_numpy(images).unsqueeze(1), torch.from_numpy(labels).long()
    batches = list(zip(images.split(args.batch), labels.split(args.batch)))
    runs = {m: build(m, copy.deepcopy(base)) for m in methods}
    for model, opt in runs.values():        # warm-up: connections, buffers, allocator
        run_steps(model, opt, batches, 0, 3)
    step_s = {m: [] for m in methods}
    folder = tempfile.mkdtemp(prefix="bench_training_timeline_")
    for r in range(args.rounds):
        for m in methods:
            model, opt = runs[m]
            if m == "awc_timeline":
                hooks = bf.timeline_install_hooks(model)
                bf.timeline_start(os.path.join(folder, f"round{r}_"))
            comm.Barrier()
            t0 = time.perf_counter()
            run_steps(model, opt, batches, r * args.steps, args.steps)
            step_s[m].append(comm.allreduce((time.perf_counter() - t0) / args.steps, op=MPI.MAX))
            if m == "awc_timeline":
                # (not timed: it formats the round's last writer period on this thread, which a
                # long run formats on the writer's thread while it trains; bench_timeline.py
                # counts that CPU time)
                bf.timeline_stop()
                hooks.remove()
    shutil.rmtree(folder, ignore_errors=True)      # this agent's own folder: only the times are kept
    if "winput" in runs:
        runs["winput"][1].free_windows()
    samples = comm.size * args.batch
    values = {}
    for m in methods:
        med, lo, hi = _bench.spread([samples / s for s in step_s[m]])
        values.update({f"{m}_samples_per_s": med, f"{m}_min": lo, f"{m}_max": hi,
                       f"{m}_step_s": _bench.spread(step_s[m])[0]})
    if "awc" in methods and "awc_timeline" in methods:     # per round: the two ran back to back
        values["awc_timeline/awc"] = _bench.spread([a / b for a, b in zip(step_s["awc_timeline"], step_s["awc"])])[0]
    if "ddp" in methods:
        values.update({f"{m}/ddp": values[f"{m}_samples_per_s"] / values["ddp_samples_per_s"]
                       for m in methods if m != "ddp"})
    if comm.rank == 0:
        print(f"{comm.size} agents, model: {source}, batch {args.batch} per agent; "
              f"median of {args.rounds} rounds x {args.steps} steps")
        for m in methods:
            ratio = f"  ({values[f'{m}/ddp']:.2f} x DDP)" if f"{m}/ddp" in values else ""
            print(f"{m:>14}: {values[f'{m}_samples_per_s']:9.1f} samples/s, "
                  f"step {values[f'{m}_step_s'] * 1e3:.2f} ms{ratio}")
    _bench.write_json(args.json if comm.rank == 0 else None, "training", comm.size,
                      {"model": source, "batch": args.batch, "steps": args.steps, "rounds": args.rounds,
                       "methods": methods}, [{"key": {"model": "cnn"}, "values": values}])
    if dist is not None:
        dist.destroy_process_group()
    comm.Free()
    bf.shutdown()


if __name__ == "__main__":
    main()

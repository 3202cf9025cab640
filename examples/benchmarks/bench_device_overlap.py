"""What a nonblocking call on a CUDA tensor costs its caller while the GPU is busy, and
the training step time of an MLP on the GPU with the AWC and gradient-allreduce
optimizers. Needs a GPU (agents share it).

    mpiexec -n 4 python examples/benchmarks/bench_device_overlap.py [--width 1024] [--layers 8] [--batch 4096]

Prints (rank 0): the median time for neighbor_allreduce_nonblocking of a 4 MB tensor to
return with ~50 ms of GPU work queued before it, and the mean step time of each
optimizer (each the mean over agents). To compare two versions of the library, run
it under each (PYTHONPATH) in alternating launches: launches differ by 10-40%.
"""
import argparse
import time

import torch

import bluefog_lite as bf


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_device_overlap.py needs a CUDA GPU")
    bf.init()
    dev = torch.device("cuda")

    def mean_over_agents(t):
        return float(bf.allreduce(torch.tensor([t], dtype=torch.float64), average=False, name="t.max")) / bf.size()

    # the call's return while ~50 ms of GPU work is queued before it
    z = torch.ones(1 << 20, device=dev)
    returns = []
    for _ in range(6):
        torch.cuda.synchronize()
        bf.barrier()
        torch.cuda._sleep(100_000_000)
        z.mul_(1.0)
        t0 = time.perf_counter()
        h = bf.neighbor_allreduce_nonblocking(z, name="busy")
        returns.append(time.perf_counter() - t0)
        bf.synchronize(h)
    returns.sort()
    ret = mean_over_agents(returns[len(returns) // 2])

    steps = {}
    for kind in ("awc", "gar"):
        torch.manual_seed(0)
        mods = []
        for _ in range(a.layers):
            mods += [torch.nn.Linear(a.width, a.width), torch.nn.ReLU()]
        model = torch.nn.Sequential(*mods).to(dev)
        base = torch.optim.SGD(model.parameters(), lr=1e-4)
        opt = (bf.DistributedAdaptWithCombineOptimizer(base, model, name_prefix=kind) if kind == "awc" else
               bf.DistributedGradientAllreduceOptimizer(base, model, name_prefix=kind))
        x = torch.randn(a.batch, a.width, device=dev)

        def step():
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        bf.barrier()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
        steps[kind] = mean_over_agents((time.perf_counter() - t0) / a.steps)
        opt.remove_hooks()
    if bf.rank() == 0:
        print(f"width {a.width} layers {a.layers} batch {a.batch}: call return {ret * 1e3:.3f} ms, "
              f"awc step {steps['awc'] * 1e3:.2f} ms, gar step {steps['gar'] * 1e3:.2f} ms", flush=True)
    bf.shutdown()


if __name__ == "__main__":
    main()

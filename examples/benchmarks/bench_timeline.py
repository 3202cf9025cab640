"""Timeline overhead: the same training step with the timeline off and on, in one run.

    mpiexec -n 2 python examples/benchmarks/bench_timeline.py [--steps 25] [--rounds 40] [--json out.json]

Each agent trains a small multi-layer perceptron with
bf.DistributedAdaptWithCombineOptimizer (SGD, neighbor_allreduce on the default
topology): each layer's parameters are sent right after its forward and
combined in step(). "On" rounds record everything a real run records:
the timeline started with bf.timeline_start (writer thread running), the
FORWARD/BACKWARD hooks installed, user activities per step. Off and on rounds
alternate (in alternating order) so that drift of the machine's load affects
both alike; each agent's ratio is its mean on-step time over its mean
off-step time, in wall time and in the agent's CPU time (all its threads; every
writer burst counted, the drain of the round's last one at timeline_stop too,
which wall time leaves out), with the standard error of the per-pair ratios;
the JSON holds the mean over agents of the ratios and of the step times.
"""
import argparse
import os
import shutil
import statistics
import tempfile
import time
import timeit

import _bench
import torch

import bluefog_lite as bf
from bluefog_lite.timeline import _recorder


def build_model(width, layers):
    mods = [torch.nn.Linear(32, width), torch.nn.ReLU()]
    for _ in range(layers - 2):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*mods)


def train_step(model, opt, data, target):
    """One AWC step; opt.step() also advances the timeline's step counter."""
    with bf.timeline_context("loss", "STEP"):
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(model(data), target)
        loss.backward()
    opt.step()


def timed_round(model, opt, batches, steps, finish=None):
    """(wall seconds, process CPU seconds) per step; CPU time counts every thread
    of this agent (main, communication, timeline writer). finish() runs after the
    steps, outside the wall time and inside the CPU time."""
    bf.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for k in range(steps):
        train_step(model, opt, *batches[k % len(batches)])
    wall = time.perf_counter() - t0
    if finish is not None:
        finish()
    return wall / steps, (time.process_time() - c0) / steps


def recorded_round(model, opt, batches, steps, prefix):
    """timed_round with the timeline on. Its stop formats the events still pending
    (those of the round's last writer period), which a long run formats on the
    writer's thread while it trains: their CPU time is counted, their wall time is
    not (done at the stop, on the main thread, a round shorter than the writer's
    period would pay all of its formatting serially: 1.39 instead of 1.25 at 2
    agents)."""
    hooks = bf.timeline_install_hooks(model)
    bf.timeline_start(prefix)
    try:
        return timed_round(model, opt, batches, steps, finish=bf.timeline_stop)
    finally:
        bf.timeline_stop()      # (after a round that raised; does nothing once stopped)
        hooks.remove()


def disabled_site_ns():
    """Cost of one event site while the timeline is off (the `current is None` test)."""
    n = 1_000_000
    t = timeit.timeit("begin('x', 'A')", globals={"begin": _recorder.begin}, number=n)
    base = timeit.timeit("f('x', 'A')", globals={"f": lambda a, b: None}, number=n)
    return max(0.0, (t - base) / n * 1e9), t / n * 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=_bench.positive_int, default=25, help="steps per round")
    ap.add_argument("--rounds", type=_bench.positive_int, default=40, help="off/on round pairs")
    ap.add_argument("--width", type=_bench.positive_int, default=256)
    ap.add_argument("--layers", type=_bench.positive_int, default=4)
    ap.add_argument("--batch", type=_bench.positive_int, default=64)
    ap.add_argument("--dir", default=None,
                    help="keep the timeline files here (default: a temporary folder, removed at the end)")
    ap.add_argument("--json", default=None, metavar="PATH", help="rank 0 writes the results here as JSON")
    args = ap.parse_args()

    bf.init()
    torch.manual_seed(bf.rank())
    model = build_model(args.width, args.layers)
    bf.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model)
    params = list(model.named_parameters())
    batches = [(torch.randn(args.batch, 32), torch.randint(0, 10, (args.batch,))) for _ in range(8)]
    folder = args.dir or tempfile.mkdtemp(prefix="bench_timeline_")
    os.makedirs(folder, exist_ok=True)
    for _ in range(10):        # warm-up: buffers, connections, allocator
        train_step(model, opt, *batches[0])

    off, on = [], []
    for r in range(args.rounds):
        prefix = os.path.join(folder, f"round{r}_")
        if r % 2:       # alternate the order inside a pair: a trend in the machine's load cancels
            on.append(recorded_round(model, opt, batches, args.steps, prefix))
            off.append(timed_round(model, opt, batches, args.steps))
        else:
            off.append(timed_round(model, opt, batches, args.steps))
            on.append(recorded_round(model, opt, batches, args.steps, prefix))
    with open(os.path.join(folder, f"round0_{bf.rank()}.json")) as f:
        # lines of spans and instants (a begin/end pair is two, a complete "X" span one)
        events = sum(1 for line in f if '"ph":"M"' not in line and '"ph":"' in line) / args.steps
    if args.dir is None:        # each agent made its own folder (~10 MB of files at the defaults)
        shutil.rmtree(folder, ignore_errors=True)

    # ratio of the mean step times over all rounds (every writer burst counted),
    # with the spread of the per-pair ratios as an error estimate
    pair = [a[0] / b[0] for a, b in zip(on, off)]
    wall_ratio = statistics.fmean(a[0] for a in on) / statistics.fmean(b[0] for b in off)
    cpu_ratio = statistics.fmean(a[1] for a in on) / statistics.fmean(b[1] for b in off)
    err = statistics.stdev(pair) / len(pair) ** 0.5 if len(pair) > 1 else float("nan")
    mean = lambda xs, i: statistics.fmean(x[i] for x in xs)   # noqa: E731
    ratios = bf.allgather(torch.tensor([[wall_ratio, cpu_ratio, err, mean(off, 0), mean(on, 0), mean(off, 1),
                                         mean(on, 1)]], dtype=torch.float64), name="bench.ratio")
    steps = ratios[:, 3:].mean(dim=0).tolist()      # step times (wall off, on; CPU off, on), mean over agents
    site_ns, site_total_ns = disabled_site_ns()
    if bf.rank() == 0:
        print(f"agents {bf.size()}, MLP {args.layers} layers x {args.width}, batch {args.batch}, AWC optimizer, "
              f"{len(params)} parameters averaged per step; {args.rounds} off/on round pairs x {args.steps} steps")
        print(f"mean step wall time (over agents) off {steps[0] * 1e3:.3f} ms, on {steps[1] * 1e3:.3f} ms; "
              f"process CPU per step off {steps[2] * 1e3:.3f} ms, on {steps[3] * 1e3:.3f} ms")
        print(f"events per step (rank 0): {events:.0f}")
        print("on/off ratio per agent: wall " + ", ".join(
            f"{w:.3f} (+-{e:.3f})" for w, e in zip(ratios[:, 0].tolist(), ratios[:, 2].tolist()))
            + "; CPU " + ", ".join(f"{x:.3f}" for x in ratios[:, 1].tolist()))
        print(f"mean wall ratio {ratios[:, 0].mean().item():.3f}, mean CPU ratio {ratios[:, 1].mean().item():.3f}")
        print(f"disabled event site: {site_total_ns:.0f} ns per call ({site_ns:.0f} ns above an empty call)")
        values = {"off_step_s": steps[0], "on_step_s": steps[1], "off_cpu_s": steps[2],
                  "on_cpu_s": steps[3], "on/off": ratios[:, 0].mean().item(),
                  "on/off_cpu": ratios[:, 1].mean().item(), "on/off_err": ratios[:, 2].mean().item(),
                  "events_per_step": events, "disabled_site_ns": site_total_ns}
        _bench.write_json(args.json, "timeline", bf.size(),
                          {"steps": args.steps, "rounds": args.rounds, "width": args.width,
                           "layers": args.layers, "batch": args.batch, "optimizer": "AWC"},
                          [{"key": {"model": "mlp"}, "values": values}])
    bf.shutdown()


if __name__ == "__main__":
    main()

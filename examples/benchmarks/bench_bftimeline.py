"""bftimeline at scale: merge and summary of 4 agents' 200 MB files, peak memory and time.

    python examples/benchmarks/bench_bftimeline.py [--agents 4] [--mb 200] [--dir /tmp/bft_bench]

Writes the agents' files in the writer's layout (one event per line): training
steps of 8 parameters, each with FORWARD and BACKWARD on the main thread and a
neighbor_allreduce (ENQUEUE_ on main; MPI_ with ALLOCATE_OUTPUT, COMMUNICATE,
COMPUTE_AVERAGE on the communication thread), every agent with its own clock
offset and jitter. Then runs each measurement in a fresh process, so that its
peak resident memory (ru_maxrss) and CPU time are its own: importing
bluefog_lite.timeline (the baseline of every bftimeline command; it does not import torch),
json.load of one file (the memory of "one file's events", for comparison),
bftimeline summary, bftimeline merge without and with arrows. Prints one line
per measurement.
"""
import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time

PARAMS = 8
STEP_US = 4000.0


def write_agent(path, rank, size, target_bytes, seed):
    """One agent's file of about target_bytes; returns (bytes, events)."""
    rng = random.Random(seed)
    offset = (rank * 137.5) % 900.0 - 450.0
    meta = {"rank": rank, "size": size, "hostname": f"node{rank // 2}", "clock_offset_us": offset,
            "clock_offset_rtt_us": 12.0, "clock_offset_measured": True}
    names = [f"layer{i}.{'weight' if i % 2 == 0 else 'bias'}" for i in range(PARAMS)]
    head = ["[\n", json.dumps({"name": "bluefog_metadata", "ph": "M", "pid": 0, "tid": 0, "args": meta}) + ",\n"]
    for pid, name in enumerate(names, start=1):
        head.append(f'{{"name":"process_name","ph":"M","pid":{pid},"tid":0,"args":{{"name":"{name}"}}}},\n')
        for tid, thread in ((1, "main"), (2, "communication")):
            head.append(f'{{"name":"thread_name","ph":"M","pid":{pid},"tid":{tid},'
                        f'"args":{{"name":"{thread}"}}}},\n')
    written, events = 0, len(head) - 1
    with open(path, "w") as f:
        f.write("".join(head))
        step = 0
        while written < target_bytes:
            t = 1e9 + step * STEP_US - offset + rng.uniform(0.0, 300.0 if rank != 1 else 900.0)
            lines = []
            for i in range(PARAMS):
                pid = i + 1
                fwd = t + 20.0 * i
                bwd = t + 400.0 + 20.0 * (PARAMS - 1 - i)
                enq = bwd + 18.0
                mpi = enq + 5.0 + rng.uniform(0.0, 30.0)
                comm_end = mpi + 300.0 + rng.uniform(0.0, 400.0)
                spans_main = (("FORWARD", fwd, fwd + 15.0), ("BACKWARD", bwd, bwd + 17.0))
                for act, b, e in spans_main:
                    lines.append(f'{{"name":"{act}","ph":"B","ts":{b:.3f},"pid":{pid},"tid":1}},\n')
                    lines.append(f'{{"name":"{act}","ph":"E","ts":{e:.3f},"pid":{pid},"tid":1}},\n')
                lines.append(f'{{"name":"ENQUEUE_NEIGHBOR_ALLREDUCE","ph":"B","ts":{enq:.3f},'
                             f'"pid":{pid},"tid":1}},\n')
                comm = (("MPI_NEIGHBOR_ALLREDUCE", "B", mpi), ("ALLOCATE_OUTPUT", "B", mpi + 1.0),
                        ("ALLOCATE_OUTPUT", "E", mpi + 4.0), ("COMMUNICATE", "B", mpi + 5.0),
                        ("COMMUNICATE", "E", comm_end), ("COMPUTE_AVERAGE", "B", comm_end + 1.0),
                        ("COMPUTE_AVERAGE", "E", comm_end + 40.0),
                        ("MPI_NEIGHBOR_ALLREDUCE", "E", comm_end + 42.0))
                for act, ph, ts in comm:
                    lines.append(f'{{"name":"{act}","ph":"{ph}","ts":{ts:.3f},"pid":{pid},"tid":2}},\n')
                lines.append(f'{{"name":"ENQUEUE_NEIGHBOR_ALLREDUCE","ph":"E","ts":{comm_end + 45.0:.3f},'
                             f'"pid":{pid},"tid":1}},\n')
            chunk = "".join(lines)
            f.write(chunk)
            written += len(chunk)
            events += len(lines)
            step += 1
        f.write('{"name":"bluefog_end","ph":"M","pid":0,"tid":0,"args":{"clean_shutdown":true}}\n]\n')
    return os.path.getsize(path), events + 1


def child(argv):
    """Run one measurement in this (fresh) process; print its wall time and peak RSS."""
    t0 = time.perf_counter()
    if argv[0] == "import":
        from bluefog_lite.timeline.__main__ import main   # noqa: F401 (what every bftimeline command imports)
        what = "import bluefog_lite.timeline only (baseline)"
    elif argv[0] == "json.load":
        with open(argv[1]) as f:
            n = len(json.load(f))
        what = f"{n} events"
    else:
        from bluefog_lite.timeline.__main__ import main
        with open(os.devnull, "w") as devnull:
            stdout, sys.stdout = sys.stdout, devnull
            try:
                code = main(argv)
            finally:
                sys.stdout = stdout
        assert code == 0, f"bftimeline {argv} failed"
        what = "ok"
    seconds = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"seconds": seconds, "cpu_s": usage.ru_utime + usage.ru_stime,
                      "peak_mb": usage.ru_maxrss / 1024.0, "what": what}))


def measure(label, argv):
    out = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{label:<38} {r['seconds']:7.1f} s wall {r['cpu_s']:7.1f} s CPU   peak RSS {r['peak_mb']:6.0f} MB   "
          f"{r['what']}", flush=True)
    return r


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--mb", type=float, default=200.0, help="size of each agent's file")
    ap.add_argument("--dir", default="/tmp/bft_bench")
    ap.add_argument("--keep", action="store_true", help="keep the files afterwards")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    prefix = os.path.join(args.dir, "tl_")
    t0 = time.perf_counter()
    for r in range(args.agents):
        size, events = write_agent(f"{prefix}{r}.json", r, args.agents, args.mb * 1e6, seed=r)
        print(f"wrote {prefix}{r}.json: {size / 1e6:.0f} MB, {events} events", flush=True)
    print(f"(writing took {time.perf_counter() - t0:.0f} s)")
    merged = os.path.join(args.dir, "merged.json")
    measure("python + import (baseline)", ["import"])
    measure("json.load of one file (reference)", ["json.load", prefix + "0.json"])
    measure("bftimeline summary", ["summary", prefix, "--json", os.path.join(args.dir, "summary.json")])
    measure("bftimeline merge --no-flows", ["merge", prefix, "-o", merged, "--no-flows"])
    measure("bftimeline merge --topology RingGraph", ["merge", prefix, "-o", merged, "--topology", "RingGraph"])
    print(f"merged file with arrows: {os.path.getsize(merged) / 1e6:.0f} MB")
    if not args.keep:
        for r in range(args.agents):
            os.remove(f"{prefix}{r}.json")
        os.remove(merged)


if __name__ == "__main__":
    main()

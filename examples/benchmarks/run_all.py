"""Run the whole benchmark suite under MPI and write docs/performance_tables.md and docs/performance.png.

    python examples/benchmarks/run_all.py [--quick] [--agents 2,4,8] [--repeats 3] [--only NAMES]

Each benchmark script is launched with the mpiexec next to this Python (the
pip MPICH), one BLAS/OpenMP thread per agent, at each agent count where it
makes sense, `repeats` times (fresh processes every time). Every launch writes
its JSON (--json); per figure the tables give the median over the repeats with
the min–max range. Every ratio is taken inside one launch (both sides measured
in the same run, interleaved) and only then summarized over repeats.
--quick runs everything small (about two minutes on an idle 2-core machine) to
check the pipeline; its output is labelled as such and is not for quoting.
"""
import argparse
import datetime
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bluefog_lite.run import default_mpiexec

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BENCHES = ("neighbor_allreduce", "fusion", "windows", "training", "timeline", "memory")


def plan(quick, agent_counts, main_agents):
    """[(bench, script, agents, [args])]: one entry per launch kind (repeated later)."""
    if quick:
        nar = ["--sizes", "4K,1M", "--trials", "2", "--max-reps", "20"]
        fusion = ["--trials", "2", "--max-reps", "5"]
        rma = ["--sizes", "4K,1M", "--rounds", "2", "--parts", "rma"]
        training = ["--steps", "5", "--rounds", "2"]
        timeline = ["--steps", "5", "--rounds", "4"]
        memory = ["--size", "16M", "--ops", "2"]
    else:
        nar = ["--sizes", "4K,64K,1M,16M,64M", "--trials", "5"]
        fusion = ["--trials", "5"]
        rma = ["--sizes", "4K,64K,1M,16M", "--rounds", "5", "--parts", "rma"]
        training = ["--steps", "20", "--rounds", "5"]
        timeline = ["--steps", "25", "--rounds", "20"]
        memory = ["--size", "64M", "--ops", "4"]
    jobs = []
    for n in agent_counts:
        jobs.append(("neighbor_allreduce", "bench_neighbor_allreduce.py", n, nar))
        jobs.append(("fusion", "bench_fusion.py", n, fusion))
        jobs.append(("windows", "bench_windows.py", n, rma))
        jobs.append(("memory", "bench_memory.py", n, memory + ["--mode", "bf"]))
        jobs.append(("memory", "bench_memory.py", n, memory + ["--mode", "raw"]))
    if not quick:
        jobs.append(("windows", "bench_windows.py", main_agents, ["--rounds", "5", "--parts", "busy,side"]))
    jobs.append(("training", "bench_training.py", main_agents, training))
    for n in sorted({min(agent_counts), main_agents}):   # also the fewest agents (2 on 2 cores: not oversubscribed)
        jobs.append(("timeline", "bench_timeline.py", n, timeline))
    return jobs


def launch(script, agents, args, json_path, log_path, timeout, work, library=REPO):
    """Run one benchmark launch, with the bluefog_lite of the tree ``library``
    first on the path; True when it exited 0 and wrote its JSON. A launch that
    failed keeps what JSON it wrote as json_path + ".failed" (--resume must not take
    it); one interrupted here (Ctrl-C: the launch runs in its own session, out of the
    terminal's reach) is taken down before the interrupt goes on."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = library + os.pathsep + env.get("PYTHONPATH", "")
    extra = ["--dir", os.path.join(work, "timeline")] if script == "bench_timeline.py" else []
    cmd = [default_mpiexec(), "-n", str(agents), sys.executable, os.path.join(HERE, script), *args, *extra,
           "--json", json_path]
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        rc = None
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.write(f"\nrun_all: killed after {timeout} s\n")
        except BaseException:
            stop(proc)
            log.write("\nrun_all: interrupted\n")
            raise
        finally:
            if rc != 0 and os.path.exists(json_path):     # (rc None: killed or interrupted)
                os.replace(json_path, json_path + ".failed")
    return rc == 0 and os.path.exists(json_path)


def stop(proc, grace=5):
    """Take a launch's process group down: SIGTERM (mpiexec passes it on to the
    ranks), then SIGKILL after grace seconds."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def summarize(runs):
    """Group the launches' rows by (bench, agents, key) and give each value its
    median, min, max and count over the repeats."""
    groups = {}
    for run in runs:
        for row in run["rows"]:
            ident = (run["bench"], run["agents"], json.dumps(row["key"], sort_keys=True))
            entry = groups.setdefault(ident, {"bench": run["bench"], "agents": run["agents"],
                                              "key": row["key"], "samples": {}, "params": run["params"]})
            for name, v in row["values"].items():
                entry["samples"].setdefault(name, []).append(v)
    out = []
    for entry in groups.values():
        entry["values"] = {name: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
                           for name, v in entry.pop("samples").items()}
        out.append(entry)
    return out


def write_outputs(results, docs, work):
    sys.path.insert(0, HERE)
    import _report
    os.makedirs(docs, exist_ok=True)
    tables, png = os.path.join(docs, "performance_tables.md"), os.path.join(docs, "performance.png")
    with open(tables, "w") as f:
        f.write(_report.markdown(results))
    _report.figure(results, png)
    print(f"wrote {tables}, {png}; per-launch JSON and logs in {work}")


def load_average():
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


def default_docs(quick, work):
    """docs/, except for a --quick run (not for quoting): its --work folder."""
    return work if quick else os.path.join(REPO, "docs")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few rounds, 1 repeat: checks the pipeline")
    ap.add_argument("--agents", default=None, help="agent counts (default 2,4,8; 2,4 with --quick)")
    ap.add_argument("--repeats", type=int, default=None, help="launches per benchmark (default 3; 1 with --quick)")
    ap.add_argument("--only", default=",".join(BENCHES), help=f"comma list of: {', '.join(BENCHES)}")
    ap.add_argument("--docs", default=None,
                    help="where performance_tables.md and performance.png go (default: docs/; with --quick the "
                         "--work folder, so that a pipeline check does not overwrite the report's tables)")
    ap.add_argument("--work", default=None, help="folder for the per-launch JSON and logs (default: a temp dir)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds before one launch is killed")
    ap.add_argument("--resume", action="store_true",
                    help="keep the launches --work already holds a JSON for (a run that was cut off) and run the rest")
    ap.add_argument("--report-only", action="store_true",
                    help="launch nothing: rewrite the tables and figure from --work's results.json")
    args = ap.parse_args()
    if args.resume and not args.work:
        ap.error("--resume needs --work (the folder of the run that was cut off)")
    if args.report_only:
        if not args.work:
            ap.error("--report-only needs --work (the folder of an earlier run)")
        path = os.path.join(args.work, "results.json")
        if not os.path.exists(path):
            ap.error(f"{path} does not exist: only a run that finished writes it (finish a cut-off run "
                     "with --resume --work DIR)")
        with open(path) as f:
            results = json.load(f)
        write_outputs(results, args.docs or default_docs(results["meta"]["quick"], args.work), args.work)
        return
    agent_counts = [2, 4] if args.quick else [2, 4, 8]
    if args.agents is not None:
        try:
            agent_counts = [int(a) for a in args.agents.split(",")]
        except ValueError:
            ap.error(f"--agents must be a comma list of agent counts, got {args.agents!r}")
    if len(set(agent_counts)) != len(agent_counts):
        ap.error(f"--agents lists an agent count twice: {args.agents!r}")
    repeats = (1 if args.quick else 3) if args.repeats is None else args.repeats
    only = set(args.only.split(","))
    unknown = only - set(BENCHES)
    if unknown or repeats < 1 or min(agent_counts) < 2:
        ap.error(f"bad --only {sorted(unknown)}" if unknown else "need --repeats >= 1 and --agents >= 2")
    main_agents = 4 if 4 in agent_counts else agent_counts[-1]
    work = args.work or tempfile.mkdtemp(prefix="bf_bench_")
    os.makedirs(work, exist_ok=True)
    jobs = [j for j in plan(args.quick, agent_counts, main_agents) if j[0] in only]

    started, load_before = time.time(), load_average()
    runs, failures, kept = [], [], 0
    for rep in range(repeats):
        for bench, script, agents, bargs in jobs:
            # (named after what the launch runs, so that --resume keeps only the same launch's result)
            digest = hashlib.sha1(json.dumps([script, bargs]).encode()).hexdigest()[:10]
            stem = os.path.join(work, f"{bench}_n{agents}_{digest}_r{rep}")
            label = f"[{rep + 1}/{repeats}] {bench:<18} n={agents} {' '.join(bargs):<48}"
            if args.resume and os.path.exists(stem + ".json"):
                kept += 1
                print(f"{label} kept", flush=True)
            else:
                t0 = time.time()
                ok = launch(script, agents, bargs, stem + ".json", stem + ".log", args.timeout, work)
                print(f"{label} {'ok' if ok else 'FAILED'} ({time.time() - t0:.0f} s)", flush=True)
                if not ok:
                    failures.append(f"{bench} at {agents} agents ({stem}.log)")
                    continue
            with open(stem + ".json") as f:
                runs.append(json.load(f))
    meta = {"quick": args.quick, "agents": agent_counts, "main_agents": main_agents, "repeats": repeats,
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "seconds": round(time.time() - started),
            "load_before": load_before, "load_after": load_average(), "cores": os.cpu_count(),
            "failures": failures, "kept": kept,
            "command": " ".join(["python", "examples/benchmarks/run_all.py", *sys.argv[1:]])}
    results = {"meta": meta, "results": summarize(runs)}
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    write_outputs(results, args.docs or default_docs(args.quick, work), work)
    if failures:
        print("FAILED launches:\n  " + "\n  ".join(failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

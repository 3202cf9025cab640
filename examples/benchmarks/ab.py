"""Alternating launches of two versions of the library: the A/B comparisons of docs/performance.md.

    python examples/benchmarks/ab.py --base REV [--pairs 6] [--agents 4] SCRIPT [SCRIPT ARGS ...]

A is the library at REV (a commit, branch or tag), checked out into a temporary
git worktree that is removed at the end; B is the library of the tree this file
is in, uncommitted changes included. Both run the same benchmark script (this
tree's SCRIPT, from examples/benchmarks/): only the library differs. Each pair
launches SCRIPT under mpiexec once per side, A first in odd pairs and B first in
even ones, so that a slow drift of the host's load affects both sides alike.

A single launch on this host moves by 10-20% with the load (docs/performance.md),
more than most changes to the library; pairs launched back to back are what tells
a change of a few percent. Each launch writes its JSON (--json, which the bench_*
scripts accept but for bench_bftimeline and bench_device_overlap); the tool prints, per row of the script's results and
per value, the figure of each side in every pair, the two means, B/A of the means
and in how many pairs B was lower. --values keeps only some values (e.g. bf/raw).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import run_all

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = run_all.REPO


def git(*args, cwd=REPO):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def add_worktree(rev, folder):
    """Check REV out into folder (detached); raises SystemExit naming REV if it cannot."""
    if git("rev-parse", "--git-dir").returncode != 0:
        raise SystemExit(f"ab.py: {REPO} is not a git checkout; A/B needs the history to check out --base")
    commit = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if commit.returncode != 0:
        raise SystemExit(f"ab.py: --base {rev!r} is not a commit of {REPO}")
    done = git("worktree", "add", "--detach", "--quiet", folder, commit.stdout.strip())
    if done.returncode != 0:
        raise SystemExit(f"ab.py: git worktree add failed: {done.stderr.strip()}")
    return commit.stdout.strip()


def library_of(tree):
    """The folder bluefog_lite is imported from with tree first on the path, as
    launches have it (checked: an installed copy must not shadow the tree under test)."""
    env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
    probe = subprocess.run([sys.executable, "-c", "import bluefog_lite, os; print(os.path.dirname("
                            "os.path.realpath(bluefog_lite.__file__)))"],
                           env=env, cwd=HERE, capture_output=True, text=True)
    return probe.stdout.strip()


def takes_json(script):
    """Whether script has the --json option (from its --help, which runs no MPI)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    usage = subprocess.run([sys.executable, os.path.join(HERE, script), "--help"], env=env, cwd=HERE,
                           capture_output=True, text=True)
    return "--json" in usage.stdout


def launch(tree, script, agents, args, stem, timeout):
    """One launch of script with the library of tree (run_all's launch); returns its results (rows)."""
    if not run_all.launch(script, agents, args, stem + ".json", stem + ".log", timeout, os.path.dirname(stem),
                          library=tree):
        with open(stem + ".log") as log:
            raise SystemExit(f"ab.py: {script} failed or did not finish within {timeout} s; "
                             f"the end of its output:\n{log.read()[-3000:]}")
    with open(stem + ".json") as f:
        return json.load(f)["rows"]


def row_label(key):
    return " ".join(f"{k}={v}" for k, v in sorted(key.items())) or "-"


def summarize(runs, wanted):
    """runs: [(side, rows)] in launch order. Returns [(row, value, A list, B list)]."""
    table = {}
    for side, rows in runs:
        for row in rows:
            label = row_label(row["key"])
            for name, value in row["values"].items():
                if wanted and name not in wanted:
                    continue
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    table.setdefault((label, name), {"A": [], "B": []})[side].append(float(value))
    return [(label, name, v["A"], v["B"]) for (label, name), v in table.items()]


def report(summary):
    lines = []
    for label, name, a, b in summary:
        if not a or not b:
            continue
        lower = sum(y < x for x, y in zip(a, b))
        ma, mb = statistics.fmean(a), statistics.fmean(b)
        lines.append(f"{label}  {name}\n"
                     f"    A: {' '.join(f'{x:.4g}' for x in a)}\n"
                     f"    B: {' '.join(f'{y:.4g}' for y in b)}\n"
                     f"    mean A {ma:.4g}, mean B {mb:.4g}, B/A {mb / ma if ma else float('nan'):.3f}, "
                     f"B lower in {lower} of {min(len(a), len(b))} pairs")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the revision of side A (B is this tree)")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--values", default="", help="comma-separated value names to report (default: all)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every figure here as JSON")
    ap.add_argument("script", help="a benchmark script of examples/benchmarks (e.g. bench_floor.py)")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.agents < 1:
        ap.error("--pairs and --agents must be at least 1")
    script = os.path.basename(args.script)
    if not os.path.exists(os.path.join(HERE, script)):
        ap.error(f"no benchmark script {script!r} in {HERE}")
    if not takes_json(script):
        ap.error(f"{script} writes no JSON results (it has no --json option): nothing to compare")
    if run_all.default_mpiexec() is None:
        raise SystemExit("ab.py: no mpiexec found (pip install mpich)")
    work = tempfile.mkdtemp(prefix="bluefog_ab_")
    base_tree = os.path.join(work, "base")
    try:
        commit = add_worktree(args.base, base_tree)
        trees = {"A": base_tree, "B": REPO}
        for side, tree in trees.items():
            found = library_of(tree)
            if os.path.realpath(found) != os.path.realpath(os.path.join(tree, "bluefog_lite")):
                raise SystemExit(f"ab.py: side {side} imports bluefog_lite from {found or '(nowhere)'}, "
                                 f"not from {tree}: an installed copy shadows it")
        print(f"A = {args.base} ({commit[:12]}), B = {REPO} (working tree); "
              f"{args.pairs} pairs of {script} {' '.join(args.args)} at {args.agents} agents", flush=True)
        runs = []
        for pair in range(args.pairs):
            for side in ("AB" if pair % 2 == 0 else "BA"):
                stem = os.path.join(work, f"{side}{pair}")
                runs.append((side, launch(trees[side], script, args.agents, args.args, stem, args.timeout)))
                print(f"  pair {pair + 1} {side} done", flush=True)
    finally:
        if os.path.isdir(base_tree):
            git("worktree", "remove", "--force", base_tree)
        git("worktree", "prune")
        shutil.rmtree(work, ignore_errors=True)
    wanted = {v for v in args.values.split(",") if v}
    summary = summarize(runs, wanted)
    print(report(summary) or "no numeric values in the results" + (f" named {sorted(wanted)}" if wanted else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"base": args.base, "commit": commit, "script": script, "args": args.args,
                       "agents": args.agents, "pairs": args.pairs,
                       "figures": [{"row": label, "value": name, "A": a, "B": b}
                                   for label, name, a, b in summary]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

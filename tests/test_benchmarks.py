"""Smoke tests of the benchmark pipeline: run_all.py's JSON, tables and figure (no performance targets)."""
import json
import os
import subprocess
import sys

import pytest

from mpi_helpers import REPO, run_agents, run_bounded

BENCH = os.path.join(REPO, "examples", "benchmarks")
sys.path.insert(0, BENCH)

import _report  # noqa: E402
import run_all  # noqa: E402


def _run_all(docs, work, *extra):
    cmd = [sys.executable, os.path.join(BENCH, "run_all.py"), "--quick", "--agents", "2",
           "--only", "neighbor_allreduce,memory", "--docs", str(docs), "--work", str(work), "--timeout", "150",
           *extra]
    code, out = run_bounded(cmd, 240, "run_all.py --quick")
    assert code == 0, out[-4000:]
    return out


def test_quick_run_writes_tables_figure_and_positive_numbers(tmp_path):
    docs, work = tmp_path / "docs", tmp_path / "work"
    _run_all(docs, work)

    results = json.loads((work / "results.json").read_text())
    assert results["meta"]["quick"] and results["meta"]["agents"] == [2]
    nar = {(e["key"]["topology"], e["key"]["bytes"]): e["values"] for e in results["results"]
           if e["bench"] == "neighbor_allreduce"}
    assert set(nar) == {(t, b) for t in ("static", "dynamic") for b in (4096, 1 << 20)}
    for values in nar.values():
        for name in ("raw_s", "bf_s", "gloo_s", "bf/raw", "bf/gloo"):
            assert values[name]["median"] > 0 and values[name]["n"] == 1, name
    memory = {e["key"]["mode"]: e["values"] for e in results["results"] if e["bench"] == "memory"}
    assert set(memory) == {"bf", "raw"}
    assert all(v["peak_bytes"]["median"] > 0 and v["expected_bytes"]["median"] > 0 for v in memory.values())

    tables = (docs / "performance_tables.md").read_text()
    assert "QUICK MODE" in tables
    assert "### neighbor_allreduce, static Exp-2" in tables and "### neighbor_allreduce, dynamic" in tables
    assert "| 2 | 4 KB |" in tables and "| 2 | 1 MB |" in tables
    assert "### Peak resident memory" in tables
    assert (docs / "performance.png").stat().st_size > 10_000

    # a run cut off before its last launch: --resume keeps what the folder holds and runs the rest
    raw_json = next(p for p in work.glob("memory_n2_*_r0.json")
                    if json.loads(p.read_text())["rows"][0]["key"]["mode"] == "raw")
    kept_text = {p.name: p.read_text() for p in work.glob("*_r0.json") if p != raw_json}
    raw_json.unlink()
    out = _run_all(docs, work, "--resume")
    assert out.count(" kept") == len(kept_text) == 2, out
    assert {p.name: p.read_text() for p in work.glob("*_r0.json") if p != raw_json} == kept_text
    assert raw_json.exists()
    resumed = json.loads((work / "results.json").read_text())
    assert resumed["meta"]["kept"] == 2
    assert {e["key"]["mode"] for e in resumed["results"] if e["bench"] == "memory"} == {"bf", "raw"}
    assert "2 launches were kept from an earlier, cut-off run" in (docs / "performance_tables.md").read_text()
    # resumed with another --only: each launch keeps its own result (they were named by position
    # in the list, so the memory launches took the results of others)
    out = _run_all(docs, work, "--resume", "--only", "memory")
    assert out.count(" kept") == 2, out
    resumed = json.loads((work / "results.json").read_text())
    assert {e["key"]["mode"] for e in resumed["results"] if e["bench"] == "memory"} == {"bf", "raw"}
    assert all(v["n"] == 1 for e in resumed["results"] for v in e["values"].values())
    # without --docs a --quick run writes its tables into --work: it must not overwrite the report's
    docs_tables = (docs / "performance_tables.md").read_text()
    cmd = [sys.executable, os.path.join(BENCH, "run_all.py"), "--quick", "--agents", "2", "--only", "memory",
           "--work", str(work), "--resume"]
    code, out = run_bounded(cmd, 240, "run_all.py --quick --resume")
    assert code == 0 and out.count(" kept") == 2, out
    assert "QUICK MODE" in (work / "performance_tables.md").read_text() and (work / "performance.png").exists()
    assert (docs / "performance_tables.md").read_text() == docs_tables
    # --resume needs the folder to resume
    code, out = run_bounded(cmd[:-3] + ["--resume"], 60, "run_all.py --resume without --work")
    assert code == 2 and "--resume needs --work" in out, out


def _run(bench, agents, key, values, params=None):
    return {"bench": bench, "agents": agents, "params": params or {}, "rows": [{"key": key, "values": values}]}


def test_report_covers_every_benchmark_and_summarizes_repeats(tmp_path):
    methods = ["awc", "atc", "winput", "gradallreduce", "ddp"]
    training = {f"{m}_{s}": 100.0 for m in methods for s in ("samples_per_s", "step_s")}
    training.update({f"{m}/ddp": 1.0 for m in methods[:-1]})
    rma = {f"{k}_s": 1e-5 for k in ("lock_put", "flush_put", "put", "lock_acc", "flush_acc", "acc", "acc_mutex")}
    rma.update({r: 1.0 for r in ("put/lock_put", "put/flush_put", "acc/lock_acc", "acc/flush_acc", "acc_mutex/acc")})
    nar = {"raw_s": 1e-3, "bf_s": 1e-3, "gloo_s": 2e-3, "bf/raw": 1.0, "bf/gloo": 0.5}
    runs = [_run("neighbor_allreduce", 4, {"topology": "static", "bytes": 4096}, dict(nar, **{"bf/raw": r}))
            for r in (1.0, 2.0, 4.0)]
    runs += [
        _run("fusion", 4, {"count": 64, "bytes": 16384},
             {"fused_s": 2e-3, "one_op_s": 1e-3, "raw_s": 1e-3, "fused/raw": 2.0, "fused/one_op": 2.0}),
        _run("windows", 4, {"table": "rma", "bytes": 4096}, rma),
        _run("training", 4, {"model": "cnn"}, training, {"model": "m", "batch": 32, "methods": methods}),
        _run("timeline", 4, {"model": "mlp"}, {"off_step_s": 0.01, "on_step_s": 0.0101, "on/off": 1.01,
                                                "on/off_cpu": 1.01, "events_per_step": 100.0}),
        _run("memory", 4, {"mode": "bf"}, {"peak_bytes": 4.0, "expected_bytes": 4.0, "peak/expected": 1.0,
                                           "in_degree": 2.0}, {"bytes": 1 << 20}),
    ]
    summary = run_all.summarize(runs)
    ratio = next(e for e in summary if e["bench"] == "neighbor_allreduce")["values"]["bf/raw"]
    assert ratio == {"median": 2.0, "min": 1.0, "max": 4.0, "n": 3}
    meta = {"quick": False, "agents": [4], "main_agents": 4, "repeats": 3, "date": "d", "seconds": 1,
            "load_before": [0.5] * 3, "load_after": [0.5] * 3, "cores": 2, "failures": [], "command": "c"}
    results = {"meta": meta, "results": summary}
    text = _report.markdown(results)
    for header in ("neighbor_allreduce, static", "Fusion", "win_put vs raw", "win_accumulate vs raw",
                   "Training throughput", "Timeline overhead", "Peak resident memory"):
        assert f"### {header}" in text, header
    assert "| 4 | 4 KB | 1 | 1 | 2 | 2.00 (1.00–4.00) | 0.50 | ≤ 3: met |" in text
    assert "QUICK MODE" not in text
    _report.figure(results, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000


def _bench_json(tmp_path, script, agents, *args, timeout):
    """Run a benchmark script on agents with --json; it must exit 0. Returns the JSON."""
    out_json = tmp_path / (script + ".json")
    rc, out = run_agents(agents, os.path.join(BENCH, script), *args, "--json", out_json, timeout=timeout,
                         expect_ok=False)
    assert rc == 0, out[-4000:]
    return json.loads(out_json.read_text())


def test_floor_benchmark_checks_its_average_and_reports_three_methods(tmp_path):
    """bench_floor.py (not part of run_all): its minimal exchange must compute the
    neighbor average numpy computes (the script exits non-zero otherwise), and
    the JSON has a positive time for raw, minimal and bf."""
    result = _bench_json(tmp_path, "bench_floor.py", 3, "--trials", "2", "--reps", "20", timeout=150)
    assert result["bench"] == "floor" and result["agents"] == 3
    times = {row["key"]["method"]: row["values"]["median_s"] for row in result["rows"]}
    assert set(times) == {"raw", "minimal", "bf"}
    assert all(0 < t < 1 for t in times.values()), times


@pytest.mark.parametrize("script, args, wrong", [
    ("bench_neighbor_allreduce.py", ["--sizes", "4K", "--trials", "1", "--no-gloo"], "bf != raw"),
    ("bench_fusion.py", ["--trials", "1", "--max-reps", "2", "--count", "4"], "one_op != raw")])
def test_a_library_call_that_computes_the_wrong_thing_stops_the_benchmark(tmp_path, script, args, wrong):
    """neighbor_allreduce replaced by a copy of its input: the script compares the
    library's first result with the raw baseline's and stops on every agent, writing no
    figures (a broken call timed as a very fast one)."""
    out_json = tmp_path / "out.json"
    rc, out = run_agents(2, "bench_broken_library.py", os.path.join(BENCH, script), *args, "--json", out_json,
                         timeout=120, expect_ok=False)
    assert rc != 0 and not out_json.exists(), out[-3000:]
    assert out.count("benchmark stopped: results differ on agents 0: " + wrong + "; 1: " + wrong) == 2, out[-3000:]


def test_benchmark_arguments_are_checked_before_anything_runs():
    """Sizes take K/M/G with an optional B or iB; a misspelt choice or a count of 0 is
    a usage error naming it (a misspelt topology measured the dynamic one under its name)."""
    import argparse
    import _bench
    assert [_bench.parse_size(s) for s in ("4K", "4kb", "4KiB", "1M", "100", "1.5K")] == [
        4096, 4096, 4096, 1 << 20, 100, 1536]
    for bad in ("4X", "", "0", "-1K", "KB", "inf", "infK", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
            _bench.parse_size(bad)
    for script, args, message in (
            ("bench_neighbor_allreduce.py", ["--topologies", "statc"], "unknown 'statc': choose from static"),
            ("bench_windows.py", ["--parts", "rmma"], "unknown 'rmma': choose from rma"),
            ("bench_neighbor_allreduce.py", ["--trials", "0"], "'0' is not a whole number >= 1"),
            ("bench_timeline.py", ["--steps", "0"], "'0' is not a whole number >= 1")):
        proc = subprocess.run([sys.executable, os.path.join(BENCH, script), *args], capture_output=True,
                              text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
        assert proc.returncode == 2 and message in proc.stderr, (script, proc.stderr[-2000:])


def test_idle_benchmark_reports_both_settings(tmp_path):
    """bench_idle.py (not part of run_all): both poke settings measured, positive rates."""
    result = _bench_json(tmp_path, "bench_idle.py", 2, "--trials", "1", "--seconds", "0.2", timeout=90)
    assert result["bench"] == "idle" and result["agents"] == 2
    rates = {row["key"]["setting"]: row["values"]["median"] for row in result["rows"]}
    assert set(rates) == {"idle_poke_50ms", "poke_2ms"} and all(r > 0 for r in rates.values()), rates


def _ab(tmp_path, *args, timeout=240):
    return run_bounded([sys.executable, os.path.join(BENCH, "ab.py"), *map(str, args)], timeout, "ab.py",
                       cwd=tmp_path)


def _worktrees():
    return subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout


def test_ab_alternates_the_base_and_this_tree_and_removes_its_worktree(tmp_path):
    before = _worktrees()
    code, out = _ab(tmp_path, "--base", "HEAD", "--pairs", "2", "--agents", "2", "--values", "x_raw",
                    "--json", tmp_path / "ab.json",
                    "bench_floor.py", "--size", "4K", "--trials", "1", "--reps", "20", "--methods", "raw,bf")
    assert code == 0, out[-4000:]
    # A first in the first pair, B first in the second: drift of the host hits both sides alike
    order = [line.split()[-2] for line in out.splitlines() if line.strip().startswith("pair ")]
    assert order == ["A", "B", "B", "A"], out
    result = json.loads((tmp_path / "ab.json").read_text())
    figures = {f["row"]: f for f in result["figures"]}
    assert set(figures) == {"method=raw", "method=bf"} and all(f["value"] == "x_raw" for f in figures.values())
    assert figures["method=raw"]["A"] == figures["method=raw"]["B"] == [1.0, 1.0]
    assert len(figures["method=bf"]["A"]) == len(figures["method=bf"]["B"]) == 2
    # bf's time over raw's of the same launch: a positive ratio (which side is faster is the
    # host's load at the moment, not what this test checks)
    assert all(0 < v < float("inf") for v in figures["method=bf"]["A"] + figures["method=bf"]["B"])
    assert "B lower in" in out
    assert _worktrees() == before


def test_ab_names_a_revision_that_does_not_exist(tmp_path):
    before = _worktrees()
    code, out = _ab(tmp_path, "--base", "no-such-revision", "bench_floor.py", timeout=60)
    assert code != 0 and "--base 'no-such-revision' is not a commit" in out
    assert _worktrees() == before

"""Tables (markdown) and figure (PNG) from run_all.py's summarized results."""
import os

# issue 8's targets: (bench, agents, key fields, value name) -> (bound, "le" or "ge")
NAR_TARGETS = {4096: 3.0, 1 << 20: 1.3, 16 << 20: 1.15}       # bf/raw, static, 4 agents
FUSION_TARGET = 2.0                                          # fused/raw
TIMELINE_TARGET = 1.03                                       # on/off
# peak may exceed expected by this: allocator, code pages, MPI's own pools (the raw
# baseline exceeds its own expectation by 3 MB at 8 agents); a hidden copy is a whole tensor
MEMORY_SLACK_MB = 4
METHOD_NAMES = {"awc": "AWC (neighbor_allreduce)", "awc_timeline": "AWC, timeline recording",
                "atc": "ATC (neighbor_allreduce)", "winput": "win_put", "gradallreduce": "gradient allreduce",
                "ddp": "DDP (gloo)"}
SHORT_NAMES = {"awc": "AWC", "awc_timeline": "AWC\n+timeline", "atc": "ATC", "winput": "win_put",
               "gradallreduce": "gradient\nallreduce", "ddp": "DDP\n(gloo)"}


def size_label(nbytes):
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):g} MB"
    return f"{nbytes / 1024:g} KB" if nbytes >= 1024 else f"{nbytes} B"


def entries(results, bench, **key):
    """Summarized rows of one benchmark whose key contains `key`, by agents then key order."""
    rows = [e for e in results["results"] if e["bench"] == bench
            and all(e["key"].get(k) == v for k, v in key.items())]
    return sorted(rows, key=lambda e: (e["agents"], e["key"].get("bytes", 0)))


def _num(x, spec):
    if spec is None:        # three significant digits, never an exponent
        return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"
    return format(x, spec)


def fmt(stat, scale=1.0, spec=None):
    """'median (min–max)' over repeats, or the median alone when they agree."""
    if stat is None:
        return "–"
    med = _num(stat["median"] * scale, spec)
    if stat["n"] > 1 and stat["min"] != stat["max"]:
        return f"{med} ({_num(stat['min'] * scale, spec)}–{_num(stat['max'] * scale, spec)})"
    return med


def ratio(stat, digits=2):
    return fmt(stat, spec=f".{digits}f")


def verdict(stat, bound, le=True):
    if stat is None:
        return "–"
    ok = stat["median"] <= bound if le else stat["median"] >= bound
    return f"{'≤' if le else '≥'} {bound:g}: {'met' if ok else 'missed'}"


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def nar_section(results):
    out = []
    for kind, title in (("static", "static Exp-2"), ("dynamic", "dynamic one-peer Exp-2")):
        rows = []
        for e in entries(results, "neighbor_allreduce", topology=kind):
            v, n = e["values"], e["key"]["bytes"]
            target = verdict(v["bf/raw"], NAR_TARGETS[n]) if kind == "static" and e["agents"] == 4 \
                and n in NAR_TARGETS else ""
            rows.append([e["agents"], size_label(n), fmt(v["raw_s"], 1e3), fmt(v["bf_s"], 1e3),
                         fmt(v.get("gloo_s"), 1e3), ratio(v["bf/raw"]), ratio(v.get("bf/gloo")), target])
        if rows:
            out.append(f"### neighbor_allreduce, {title}\n\n" + table(
                ["agents", "size", "raw mpi4py (ms)", "bluefog_lite (ms)", "gloo all_reduce (ms)",
                 "bf / raw", "bf / gloo", "target (4 agents)"], rows))
    return "\n".join(out)


def fusion_section(results):
    rows = []
    for e in entries(results, "fusion"):
        v, k = e["values"], e["key"]
        rows.append([e["agents"], fmt(v["fused_s"], 1e3), fmt(v["one_op_s"], 1e3), fmt(v["raw_s"], 1e3),
                     ratio(v["fused/raw"]), ratio(v["fused/one_op"]), verdict(v["fused/raw"], FUSION_TARGET)])
    if not rows:
        return ""
    k = entries(results, "fusion")[0]["key"]
    total = size_label(k["count"] * k["bytes"])
    return (f"### Fusion: {k['count']} concurrent {size_label(k['bytes'])} ops vs one {total} op\n\n" + table(
        ["agents", f"{k['count']} × {size_label(k['bytes'])} fused (ms)", f"one {total} op (ms)",
         f"raw {total} exchange (ms)", "fused / raw", "fused / one op", "target"], rows))


def windows_section(results):
    out = []
    for op, key in (("put", "put"), ("accumulate", "acc")):
        rows = []
        for e in entries(results, "windows", table="rma"):
            v = e["values"]
            extra = [ratio(v["acc_mutex/acc"])] if key == "acc" else []
            rows.append([e["agents"], size_label(e["key"]["bytes"]), fmt(v[f"lock_{key}_s"], 1e6),
                         fmt(v[f"flush_{key}_s"], 1e6), fmt(v[f"{key}_s"], 1e6),
                         ratio(v[f"{key}/lock_{key}"]), ratio(v[f"{key}/flush_{key}"])] + extra)
        if rows:
            header = ["agents", "size", f"raw Lock/{op}/Unlock (µs)", f"raw {op}+Flush in Lock_all (µs)",
                      f"win_{op} (µs)", "ratio to Lock/Unlock", "ratio to +Flush"]
            out.append(f"### win_{op} vs raw mpi4py RMA\n\n" + table(
                header + (["with mutex / without"] if key == "acc" else []), rows))
    busy = entries(results, "windows", table="busy")
    for e in busy:
        out.append(f"### win_accumulate into a busy agent\n\n1 MB `win_accumulate(require_mutex=True)` into "
                   f"an agent computing for 1 s without MPI calls ({e['agents']} agents): median "
                   f"{fmt(e['values']['median_s'], 1e3)} ms per call.\n")
    side_entries = entries(results, "windows", table="side")
    side_agents = side_entries[0]["agents"] if side_entries else 0
    side = [[e["key"]["condition"], fmt(e["values"]["nar_4k_s"], 1e6), fmt(e["values"]["nar_1m_s"], 1e6),
             fmt(e["values"]["compute_s"], 1e3),
             fmt(e["values"]["idle_cpu"], 100, ".1f") if e["values"]["idle_cpu"]["median"] else "–"]
            for e in side_entries]
    if side:
        out.append(f"### What a window costs the rest ({side_agents} agents)\n\n" + table(
            ["condition", "neighbor_allreduce 4 KB (µs)", "neighbor_allreduce 1 MB (µs)",
             "rank 0 compute loop (ms)", "idle agent CPU (%)"], side))
    return "\n".join(out)


def training_section(results):
    out = []
    for e in entries(results, "training"):
        v, p = e["values"], e["params"]
        rows = []
        for m in p["methods"]:
            r = v.get(f"{m}/ddp")
            target = verdict(r, 1.0, le=False) if m == "awc" else ""
            rows.append([METHOD_NAMES.get(m, m), fmt(v[f"{m}_samples_per_s"], spec=".0f"),
                         fmt(v[f"{m}_step_s"], 1e3), ratio(r) if r else ("1.00" if m == "ddp" else "–"), target])
        out.append(f"### Training throughput, {e['agents']} agents\n\nModel: {p['model']}, batch {p['batch']} "
                   f"per agent, SGD with momentum; samples/s over all agents.\n\n" + table(
                       ["optimizer", "samples/s", "step (ms)", "throughput / DDP", "target"], rows))
    return "\n".join(out)


def timeline_section(results):
    rows = []
    for e in entries(results, "timeline"):
        v = e["values"]
        rows.append(["MLP (bench_timeline.py)", e["agents"], fmt(v["off_step_s"], 1e3), fmt(v["on_step_s"], 1e3),
                     ratio(v["on/off"], 3), ratio(v["on/off_cpu"], 3), fmt(v["events_per_step"]),
                     verdict(v["on/off"], TIMELINE_TARGET)])
    for e in entries(results, "training"):
        v = e["values"]
        if "awc_timeline/awc" in v:
            rows.append(["CNN example (bench_training.py)", e["agents"], fmt(v["awc_step_s"], 1e3),
                         fmt(v["awc_timeline_step_s"], 1e3), ratio(v["awc_timeline/awc"], 3), "–", "–",
                         verdict(v["awc_timeline/awc"], TIMELINE_TARGET)])
    if not rows:
        return ""
    return "### Timeline overhead (AWC training loops, on vs off)\n\n" + table(
        ["training loop", "agents", "step off (ms)", "step on (ms)", "on / off (wall)", "on / off (CPU)",
         "events per step", "target"], rows)


def memory_section(results):
    rows = []
    for e in entries(results, "memory"):
        v, mode = e["values"], e["key"]["mode"]
        what = "input + received + output" if mode == "bf" else "input + (k+1)-row buffer + output"
        target = ""
        if mode == "bf":
            ok = v["peak_bytes"]["median"] <= v["expected_bytes"]["median"] + MEMORY_SLACK_MB * (1 << 20)
            target = f"≤ expected + {MEMORY_SLACK_MB} MB: {'met' if ok else 'missed'}"
        mb = 1 / (1 << 20)
        rows.append([e["agents"], int(v["in_degree"]["median"]), "bluefog_lite" if mode == "bf" else "raw mpi4py",
                     size_label(e["params"]["bytes"]), fmt(v["peak_bytes"], mb, ".1f"),
                     f"{fmt(v['expected_bytes'], mb, '.0f')} ({what})", ratio(v["peak/expected"], 3), target])
    if not rows:
        return ""
    return ("### Peak resident memory per agent (fresh process, max over agents)\n\n" + table(
        ["agents", "in-degree", "code", "tensor", "peak growth (MB)", "expected (MB)", "peak / expected",
         "target"], rows))


def markdown(results):
    meta = results["meta"]
    mode = ("**QUICK MODE**: small sizes, few rounds; it checks the pipeline and its numbers are "
            "not for quoting" if meta["quick"] else "full run")
    head = (f"# Benchmark tables\n\nGenerated by `{meta['command']}` on {meta['date']}, {mode}; "
            f"agents {', '.join(map(str, meta['agents']))}, {meta['repeats']} repeat(s), "
            f"{meta['cores']} cores, load average {meta['load_before'][0]:.2f} before and "
            f"{meta['load_after'][0]:.2f} after, {meta['seconds']} s. Cells: median over repeats "
            "(min–max when they differ); every ratio is taken inside one run. "
            "What each table measures: [performance.md](performance.md#reproduce).\n")
    if meta.get("kept"):
        head += (f"\n{meta['kept']} launches were kept from an earlier, cut-off run in the same --work "
                 "folder (`--resume`); the load average and seconds above are those of the rest.\n")
    if meta["failures"]:
        head += "\nFailed launches (missing from the tables): " + "; ".join(meta["failures"]) + "\n"
    parts = [nar_section(results), fusion_section(results), windows_section(results),
             training_section(results), timeline_section(results), memory_section(results)]
    return head + "\n" + "\n".join(p for p in parts if p)


def _spread(stats):
    """Medians and matplotlib's yerr (distances to min and max) of summarized values."""
    med = [st["median"] for st in stats]
    return med, [[m - st["min"] for m, st in zip(med, stats)], [st["max"] - m for m, st in zip(med, stats)]]


def _errorbar(ax, xs, stats, **kw):
    med, err = _spread(stats)
    ax.errorbar(xs, med, yerr=err, capsize=3, marker="o", **kw)


def _legend(ax, size):
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=size)


def _panel_nar_ratio(ax, results, key, title):
    for kind, style in (("static", "-"), ("dynamic", "--")):
        for n in results["meta"]["agents"]:
            es = [e for e in entries(results, "neighbor_allreduce", topology=kind)
                  if e["agents"] == n and key in e["values"]]
            if es:
                _errorbar(ax, [e["key"]["bytes"] for e in es], [e["values"][key] for e in es],
                          linestyle=style, label=f"{kind}, {n} agents")
    if key == "bf/raw":
        ax.scatter(list(NAR_TARGETS), list(NAR_TARGETS.values()), marker="_", s=400, color="red",
                   label="target (static, 4 agents)", zorder=5)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="tensor bytes", ylabel="time ratio (lower is better)", title=title)
    _legend(ax, 7)


def _panel_nar_times(ax, results):
    n = results["meta"]["main_agents"]
    es = [e for e in entries(results, "neighbor_allreduce", topology="static") if e["agents"] == n]
    for name, label in (("raw_s", "raw mpi4py"), ("bf_s", "bluefog_lite"), ("gloo_s", "gloo all_reduce")):
        pts = [e for e in es if name in e["values"]]
        if pts:
            _errorbar(ax, [e["key"]["bytes"] for e in pts], [e["values"][name] for e in pts], label=label)
    ax.set(xscale="log", yscale="log", xlabel="tensor bytes", ylabel="seconds per op",
           title=f"neighbor_allreduce, static Exp-2, {n} agents")
    _legend(ax, 7)


def _panel_windows(ax, results):
    for key, label in (("put/lock_put", "win_put / Lock-Put-Unlock"),
                       ("acc/lock_acc", "win_accumulate / Lock-Acc-Unlock")):
        for n in results["meta"]["agents"]:
            es = [e for e in entries(results, "windows", table="rma") if e["agents"] == n]
            if es:
                _errorbar(ax, [e["key"]["bytes"] for e in es], [e["values"][key] for e in es],
                          label=f"{label}, {n} agents")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="tensor bytes", ylabel="time ratio", title="windows vs raw RMA")
    _legend(ax, 6)


def _panel_training(ax, results):
    for e in entries(results, "training")[:1]:
        ms = e["params"]["methods"]
        med, err = _spread([e["values"][f"{m}_samples_per_s"] for m in ms])
        ax.bar(range(len(ms)), med, yerr=err, capsize=4)
        ax.set_xticks(range(len(ms)), [SHORT_NAMES.get(m, m) for m in ms], fontsize=8)
        ax.set(ylabel="samples/s (all agents)", title=f"CNN training throughput, {e['agents']} agents")


def _panel_fusion(ax, results):
    es = entries(results, "fusion")
    if not es:
        return
    xs = range(len(es))
    for off, key, label in ((-0.2, "fused/raw", "fused / raw exchange"), (0.2, "fused/one_op", "fused / one op")):
        med, err = _spread([e["values"][key] for e in es])
        ax.bar([x + off for x in xs], med, width=0.4, label=label, yerr=err, capsize=3)
    ax.axhline(FUSION_TARGET, color="red", lw=1, label="target fused / raw")
    ax.set_xticks(list(xs), [f"{e['agents']} agents" for e in es])
    k = es[0]["key"]
    ax.set(ylabel="time ratio", title=f"{k['count']} × {size_label(k['bytes'])} concurrent ops "
           f"vs {size_label(k['count'] * k['bytes'])}")
    _legend(ax, 7)


def figure(results, path):
    """A 2 x 3 panel PNG: ratios to the baselines vs size, times at the main agent count,
    window ratios, training throughput, fusion. Whiskers: min–max over repeats."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    meta = results["meta"]
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    _panel_nar_ratio(axes[0, 0], results, "bf/raw", "neighbor_allreduce / raw mpi4py")
    _panel_nar_ratio(axes[0, 1], results, "bf/gloo", "neighbor_allreduce / gloo all_reduce")
    _panel_nar_times(axes[0, 2], results)
    _panel_windows(axes[1, 0], results)
    _panel_training(axes[1, 1], results)
    _panel_fusion(axes[1, 2], results)
    fig.suptitle(("QUICK MODE (pipeline check, not for quoting) — " if meta["quick"] else "")
                 + f"bluefog_lite benchmarks, {meta['date']}; medians over {meta['repeats']} repeat(s), "
                 "whiskers: min–max")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)

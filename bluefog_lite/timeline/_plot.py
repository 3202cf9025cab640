"""bftimeline plot: a PNG of every agent's slices on one time axis (rank 0's clock).

One lane per agent and thread (the rows of all op names of that thread drawn
together), colored by phase. Operation-wide slices (ENQUEUE_, MPI_, user
activities) are drawn as tall pale bars, the phases inside them and the
compute (FORWARD, BACKWARD) as narrower saturated bars on top. Slices closer
than a pixel are drawn as one bar, so a long run stays a few thousand
rectangles per lane.
"""
import collections
from array import array

import numpy as np

from . import _intervals
from ._agents import find_agents, refuse_as_output
from ._reader import iter_events
from ._slices import SliceReader

# (label, color, tall) in drawing order; the first matching pattern wins
_GROUPS = (
    ("user activity", "#d9d9d9", True),
    ("ENQUEUE_* (op in flight)", "#c6dbef", True),
    ("MPI_* (communication thread)", "#fdd0a2", True),
    ("FORWARD", "#2171b5", False),
    ("BACKWARD", "#6a51a3", False),
    ("NEGOTIATION", "#8c6d31", False),
    ("ALLOCATE_OUTPUT", "#969696", False),
    ("COMMUNICATE", "#e6550d", False),
    ("COMPUTE_AVERAGE", "#31a354", False),
    ("MEMCPY_*_FUSION_BUFFER", "#e377c2", False),
    ("WIN_SYNC_COMPUTE_AVERAGE", "#17becf", False),
    ("ACQUIRE_MUTEX", "#d62728", False),
    ("COPY_TO_HOST / COPY_TO_DEVICE / WAIT_COPY_TO_HOST", "#bcbd22", False),
)
_BY_NAME = {"FORWARD": 3, "BACKWARD": 4, "NEGOTIATION": 5, "ALLOCATE_OUTPUT": 6, "COMMUNICATE": 7,
            "COMPUTE_AVERAGE": 8, "MEMCPY_IN_FUSION_BUFFER": 9,
            "WIN_SYNC_COMPUTE_AVERAGE": 10, "ACQUIRE_MUTEX": 11, "COPY_TO_HOST": 12, "COPY_TO_DEVICE": 12,
            "WAIT_COPY_TO_HOST": 12}
WIDTH_IN, DPI = 14.0, 100


def _group(name):
    g = _BY_NAME.get(name)
    if g is not None:
        return g
    if name.startswith("ENQUEUE_"):
        return 1
    if name.startswith("MPI_"):
        return 2
    return 0


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("bftimeline plot needs matplotlib: pip install matplotlib "
                           "(or pip install bluefog_lite[plot])") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot(prefix, out_path, start_ms=None, end_ms=None, allow_missing=False):
    """Draw the run under prefix into out_path (PNG). start_ms/end_ms: a window in
    ms from the earliest timestamp of any agent; allow_missing: see find_agents.
    Returns (the number of lanes, the files left out)."""
    plt = _pyplot()
    agents = find_agents(prefix, allow_missing)
    refuse_as_output(agents, out_path, "plot")
    lanes, t0 = _read_lanes(agents)
    if not lanes:
        raise ValueError(f"{prefix}<rank>.json hold no slices to plot")
    t_end = max(float(np.max(e)) for per_group in lanes.values() for _, e in per_group.values())
    lo = 0.0 if start_ms is None else start_ms
    hi = (t_end - t0) / 1000.0 if end_ms is None else end_ms
    if hi <= lo:
        raise ValueError(f"empty plot window: start {lo} ms, end {hi} ms")
    keys = sorted(lanes)
    legend_rows = 1 if len({g for lane in lanes.values() for g in lane}) <= 6 else 2
    top_in, bottom_in, left_in = 0.5 + 0.22 * legend_rows, 0.55, 1.7
    height = min(top_in + bottom_in + 0.28 * len(keys) + 0.3, 60.0)
    fig = plt.figure(figsize=(WIDTH_IN, height), dpi=DPI)
    ax = fig.add_axes((left_in / WIDTH_IN, bottom_in / height, 1 - (left_in + 0.25) / WIDTH_IN,
                       1 - (top_in + bottom_in) / height))
    pixel_ms = (hi - lo) / (ax.get_position().width * WIDTH_IN * DPI)
    used = set()
    for y, key in enumerate(keys):
        for g, (b, e) in sorted(lanes[key].items()):
            b, e = (b - t0) / 1000.0, (e - t0) / 1000.0
            keep = (e >= lo) & (b <= hi)
            b, e = _intervals.union(np.maximum(b[keep], lo), np.minimum(e[keep], hi), gap=pixel_ms)
            if b.size == 0:
                continue
            used.add(g)
            h = 0.8 if _GROUPS[g][2] else 0.44
            ax.broken_barh(list(zip(b, np.maximum(e - b, pixel_ms))), (y - h / 2, h),
                           facecolors=_GROUPS[g][1], edgecolors="none")
    _decorate(ax, keys, lo, hi)
    fig.suptitle(_drawable(f"{prefix}<rank>.json: {len({k[0] for k in keys})} agents on rank 0's clock"),
                 y=1 - 0.08 / height, va="top", fontsize=10)
    groups = sorted(used)
    if not groups:
        plt.close(fig)
        raise ValueError(f"nothing to plot between {lo:g} and {hi:g} ms (from the earliest timestamp of any "
                         "agent): choose --start/--end inside the run")
    fig.legend([plt.Rectangle((0, 0), 1, 1, color=_GROUPS[g][1]) for g in groups],
               [_GROUPS[g][0] for g in groups], loc="upper center", bbox_to_anchor=(0.5, 1 - 0.32 / height),
               ncol=len(groups) if len(groups) <= 6 else (len(groups) + 1) // 2, fontsize=8, frameon=False)
    fig.savefig(out_path, format="png")
    plt.close(fig)
    return len(keys), agents.skipped


def _read_lanes(agents):
    """{(rank, thread order, thread name): {group: (begins, ends)}} and the earliest timestamp."""
    lanes = {}
    t0 = np.inf
    for agent in agents:
        reader = SliceReader(iter_events(agent.path), agent.offset_us)
        cols = collections.defaultdict(lambda: (array("d"), array("d")))
        for s in reader:
            b, e = cols[(s.pid, s.tid, _group(s.name))]
            b.append(s.begin)
            e.append(s.end)
        t0 = min(t0, reader.first)
        threads = {}
        for (pid, tid, g), (b, e) in cols.items():
            thread = reader.thread_name(pid, tid)
            lane = lanes.setdefault((agent.rank, threads.setdefault(thread, _thread_order(thread)), thread), {})
            old = lane.get(g)
            b, e = np.frombuffer(b), np.frombuffer(e)
            lane[g] = (b, e) if old is None else (np.concatenate((old[0], b)), np.concatenate((old[1], e)))
    return lanes, t0


def _thread_order(thread):
    return {"main": 0, "communication": 2}.get(thread, 1)


def _decorate(ax, keys, lo, hi):
    ax.set_ylim(len(keys) - 0.5, -0.5)
    ax.set_xlim(lo, hi)
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([_drawable(f"rank {rank}  {thread}") for rank, _, thread in keys], fontsize=8)
    for y in range(1, len(keys)):
        if keys[y][0] != keys[y - 1][0]:
            ax.axhline(y - 0.5, color="#555555", linewidth=0.6)
    ax.set_xlabel("time (ms) since the first event")
    ax.grid(axis="x", color="#eeeeee", linewidth=0.5)
    ax.set_axisbelow(True)


def _drawable(text):
    """text that matplotlib can draw: a lone surrogate (a file name's undecodable
    byte, a thread name) as a backslash escape (matplotlib raised TypeError)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")

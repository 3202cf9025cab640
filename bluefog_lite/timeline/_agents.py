"""Finding the files of one run (PREFIX<rank>.json) and what each says about its agent."""
import collections
import os
import re
import time

from ._reader import is_empty, read_metadata

Agent = collections.namedtuple("Agent", "rank path hostname offset_us meta")
Agent.__doc__ = ("One agent's file. offset_us: add it to the file's timestamps to get rank 0's "
                 "clock (the clock_offset_us measured at init; 0 when not recorded).")


class Agents(list):
    """The Agent of each file read, by rank; skipped: the files left out (allow_missing)."""

    def __init__(self, agents, skipped):
        super().__init__(agents)
        self.skipped = skipped


def find_agents(prefix, allow_missing=False):
    """The agents of the run recorded under prefix, by rank (an Agents list).

    Raises ValueError when there is no PREFIX<rank>.json, when a file is not a
    timeline or its recorded rank differs from its name, or when the files
    disagree on the number of agents or some are missing or empty. allow_missing:
    read the run without the missing and empty files (an agent that died before
    it wrote anything), named in the result's skipped."""
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"prefix must be a non-empty string (files are PREFIX<rank>.json), got {prefix!r}")
    folder, base = os.path.split(prefix)
    folder = folder or "."
    if not os.path.isdir(folder):
        raise ValueError(f"no timeline files {prefix}<rank>.json: directory {folder!r} does not exist")
    pattern = re.compile(re.escape(base) + r"([0-9]+)\.json\Z")
    found, others = {}, []
    for entry in os.listdir(folder):
        m = pattern.match(entry)
        path = os.path.join(folder, entry)
        if m and os.path.isfile(path):
            if _of_longer_prefix(base, entry, path):
                others.append(f"{path} (another run's: its prefix is longer)")
            else:
                found.setdefault(int(m.group(1)), path)
    if not found:
        raise ValueError(f"no timeline files {prefix}<rank>.json (looked for e.g. {prefix}0.json)")
    agents, skipped = [], others
    for rank, path in sorted(found.items()):
        if allow_missing and is_empty(path):
            skipped.append(f"{path} (empty)")
        else:
            agents.append(_agent(rank, path))
    if not agents:
        raise ValueError(f"every timeline file {prefix}<rank>.json is empty: no agent wrote a timeline")
    runs = collections.defaultdict(list)     # (run id, size) -> its files' ranks
    for a in agents:
        runs[(a.meta.get("run_id"), a.meta.get("size"))].append(a)
    if len(runs) != 1:
        raise ValueError(f"the files {prefix}<rank>.json come from different runs ("
                         + "; ".join(_describe_run(run) for run in runs.values())
                         + "): delete the other run's files or record each run under its own prefix")
    size = agents[0].meta.get("size")
    if isinstance(size, int):
        missing = [f"{prefix}{r}.json" for r in range(size) if r not in found]
        if missing and not allow_missing:
            raise ValueError(f"the run had {size} agents but these files are missing: {', '.join(missing)} "
                             "(--allow-missing reads the run without them)")
        skipped += [f"{path} (missing)" for path in missing]
        stray = [a.path for a in agents if a.rank >= size]
        if stray:
            raise ValueError(f"files for ranks beyond the run's {size} agents: {', '.join(stray)}")
    return Agents(agents, sorted(skipped))


def refuse_as_output(agents, out_path, what):
    """Raise if out_path is one of the run's files: writing the output of ``what``
    (merge, summary, plot) there would destroy an input."""
    for agent in agents:
        if os.path.exists(out_path) and os.path.samefile(out_path, agent.path):
            raise ValueError(f"the output {out_path} is rank {agent.rank}'s timeline file, an input of the {what}; "
                             "write the output elsewhere")


def _describe_run(agents):
    meta = agents[0].meta
    ranks = [a.rank for a in agents]
    shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
    started = meta.get("run_started_s")
    when = (" started " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
            if isinstance(started, (int, float)) else "")
    return f"ranks {shown} of a run of {meta.get('size')} agents{when}"


def _of_longer_prefix(base, entry, path):
    """True if the file entry (at path) is a rank's file of a run recorded under a
    prefix that extends base (run1's rank 0, run10.json, is not rank 10 of run):
    its metadata's prefix and rank name it so. A renamed file counts as base's."""
    try:
        meta = read_metadata(path)
    except ValueError:
        return False
    recorded, rank = meta.get("prefix"), meta.get("rank")
    if not isinstance(recorded, str) or not isinstance(rank, int):
        return False
    own = os.path.basename(recorded)
    return own != base and own.startswith(base) and f"{own}{rank}.json" == entry


def _agent(rank, path):
    meta = read_metadata(path)
    if meta.get("rank") != rank:
        raise ValueError(f"{path} records rank {meta.get('rank')!r}, not {rank} as its name says")
    offset = meta.get("clock_offset_us")
    if offset is None:
        offset = 0.0
    if not isinstance(offset, (int, float)):
        raise ValueError(f"{path}: clock_offset_us must be a number, got {offset!r}")
    return Agent(rank, path, str(meta.get("hostname", "?")), float(offset), meta)

"""What the examples print at the end when a timeline was recorded: where the files are
and how to look at them."""
import os

import bluefog_lite as bf


def shutdown_and_note():
    """bf.shutdown() (which closes the timeline files), then, on rank 0, the note of
    timeline_note, if a timeline was recorded: every example ends with it, after its
    figure of merit."""
    rank, size = bf.rank(), bf.size()
    bf.shutdown()
    note = timeline_note(size)
    if note and rank == 0:
        print(note, flush=True)


def timeline_note(size):
    """The lines to print (on one agent), or None when no timeline was recorded."""
    prefix = os.environ.get("BLUEFOG_TIMELINE")
    if not prefix:
        return None
    commands = [(f"bftimeline summary {prefix}", "time per phase, overlap, stragglers"),
                (f"bftimeline merge {prefix} -o merged.json", "one clock-aligned trace"),
                (f"bftimeline plot {prefix} -o timeline.png", "a picture; needs matplotlib")]
    width = max(len(c) for c, _ in commands)
    return "\n".join([f"timeline: one file per agent, {prefix}0.json .. {prefix}{size - 1}.json; open them in "
                      "https://ui.perfetto.dev or chrome://tracing, or see all agents at once with"]
                     + [f"  {c.ljust(width)}   ({what})" for c, what in commands] + ["(docs/timeline.md)"])

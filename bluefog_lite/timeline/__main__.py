"""The bftimeline command (also ``python -m bluefog_lite.timeline``): merge, summary, plot."""
import argparse
import json
import sys

_TOPOLOGIES = ("ExponentialGraph", "ExponentialTwoGraph", "FullyConnectedGraph", "MeshGrid2DGraph",
               "RingGraph", "StarGraph", "SymmetricExponentialGraph")


def _parser():
    ap = argparse.ArgumentParser(
        prog="bftimeline",
        description="Read the per-agent timeline files PREFIX<rank>.json of one run (bfrun "
                    "--timeline-filename PREFIX) together, on rank 0's clock.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{merge,summary,plot}")
    missing = argparse.ArgumentParser(add_help=False)
    missing.add_argument("--allow-missing", action="store_true",
                         help="read the run without the files of agents that wrote none (missing or empty: "
                              "an agent that died early); the output names them")
    m = sub.add_parser("merge", parents=[missing], help="all agents in one trace file (Perfetto / chrome://tracing)",
                       description="Write one trace: a process per agent, a thread per row of its file, "
                                   "clocks aligned, flow arrows from each send to the matching receive.")
    m.add_argument("prefix", metavar="PREFIX")
    m.add_argument("-o", "--output", required=True, metavar="MERGED.json")
    m.add_argument("--topology", choices=_TOPOLOGIES, metavar="NAME",
                   help="for files without SEND_TO marks (written by older versions): the run's static "
                        "topology (a builder of the topology package, e.g. ExponentialTwoGraph), whose "
                        "edges neighbor-operation arrows then follow; without it they connect every pair "
                        "of agents. Files with the marks get arrows to the ranks each call sent to")
    m.add_argument("--no-flows", action="store_true", help="leave out the arrows")
    s = sub.add_parser("summary", parents=[missing], help="time per phase, overlap, stragglers, per agent",
                       description="Per agent: time in FORWARD, BACKWARD, communication and each of its "
                                   "phases, idle; communication/computation overlap; straggler ranking.")
    s.add_argument("prefix", metavar="PREFIX")
    s.add_argument("--json", metavar="OUT.json", help="also write the summary as JSON")
    s.add_argument("--compute", action="append", default=[], metavar="ACTIVITY",
                   help="count this activity (e.g. your timeline_context name) as compute too; repeatable")
    p = sub.add_parser("plot", parents=[missing], help="a PNG of all agents on one time axis",
                       description="Draw every agent's slices on one time axis, one lane per agent and "
                                   "thread, colored by phase (needs matplotlib).")
    p.add_argument("prefix", metavar="PREFIX")
    p.add_argument("-o", "--output", required=True, metavar="TIMELINE.png")
    p.add_argument("--start", type=float, metavar="MS", help="window start, ms after the first event")
    p.add_argument("--end", type=float, metavar="MS", help="window end, ms after the first event")
    return ap


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        if args.command == "merge":
            from ._merge import merge
            topo = None
            if args.topology:
                import topology
                topo = getattr(topology, args.topology)
            counts = merge(args.prefix, args.output, topology=topo, flows=not args.no_flows,
                           allow_missing=args.allow_missing)
            _write(sys.stdout, f"bftimeline: wrote {args.output}: {counts['agents']} agents, "
                               f"{counts['events']} events, {counts['flows']} flow arrows"
                               + _without(counts["skipped"]) + "\n")
        elif args.command == "summary":
            from ._summary import format_summary, summarize
            summary = summarize(args.prefix, compute=args.compute, allow_missing=args.allow_missing,
                                output=args.json)
            if args.json:
                with open(args.json, "w", encoding="utf-8") as f:
                    json.dump(summary, f, indent=1)
            _write(sys.stdout, format_summary(summary))
            for name in summary["compute_not_found"]:
                sys.stderr.write(f"bftimeline summary: warning: --compute {name!r}: no agent recorded an "
                                 "activity of that name (check its spelling)\n")
        else:
            from ._plot import plot
            lanes, skipped = plot(args.prefix, args.output, start_ms=args.start, end_ms=args.end,
                                  allow_missing=args.allow_missing)
            _write(sys.stdout, f"bftimeline: wrote {args.output} ({lanes} lanes)" + _without(skipped) + "\n")
    except (ValueError, RuntimeError, OSError) as exc:
        _write(sys.stderr, f"bftimeline {args.command}: error: {exc}\n")
        return 1
    except (KeyError, TypeError, AttributeError) as exc:    # a hand-made or foreign file's event
        _write(sys.stderr, f"bftimeline {args.command}: error: a timeline file of {args.prefix} holds an event "
                           f"these tools cannot read ({type(exc).__name__}: {exc}); were the files written by "
                           "bluefog_lite and left unedited?\n")
        return 1
    return 0


def _write(stream, text):
    """text to stream; what its encoding cannot hold (a name with a lone surrogate,
    a non-ASCII name on an ASCII terminal) is written as backslash escapes."""
    try:
        stream.write(text)
    except UnicodeEncodeError:
        encoding = getattr(stream, "encoding", None) or "utf-8"
        stream.write(text.encode(encoding, "backslashreplace").decode(encoding))


def _without(skipped):
    return f"; without {', '.join(skipped)}" if skipped else ""


if __name__ == "__main__":
    sys.exit(main())

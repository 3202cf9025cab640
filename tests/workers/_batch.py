"""Several worker scripts run one after another in one MPI job (mpi_helpers.Batch).

A launch costs more than many workers' own work on this 2-core machine (four
interpreters importing torch: ~4.5 s at 4 agents, ~8.5 s at 8), so a family of
cases of one test (same agents, same environment) shares one. Each case runs its
script as __main__ with its own argv (runpy: fresh globals; the script's
bf.init() ... bf.shutdown() as in a job of its own) and prints "CASE DONE <label>
<rank>" when it returns. A case that raises ends the job as a worker does (the
library's uncaught-exception hook aborts it), so the cases after it do not run.

argv: label script args... [-- label script args...]
"""
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def cases(argv):
    case = []
    for word in argv + ["--"]:
        if word == "--":
            if case:
                yield case[0], case[1], case[2:]
            case = []
        else:
            case.append(word)


if __name__ == "__main__":
    rank = os.environ.get("PMI_RANK", "?")
    for label, script, args in cases(sys.argv[1:]):
        path = os.path.join(HERE, script)
        sys.argv = [path] + args
        print(f"CASE START {label} {rank}", flush=True)
        runpy.run_path(path, run_name="__main__")
        print(f"CASE DONE {label} {rank}", flush=True)

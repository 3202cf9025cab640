"""Fuzz: random combinations of weights, ranks, shapes and dtypes fed to the public
operations on 4 agents (tests/workers/fuzz_ops.py). Every call must either match
its numpy reference or raise the expected clear error on the agents that can know
it; never hang, never return wrong numbers.

The seed is fixed so that a failure can be replayed; set BLUEFOG_FUZZ_SEED to
explore others (the failing seed and call are in the output)."""
import os
import re

from mpi_helpers import run_agents

SEED = int(os.environ.get("BLUEFOG_FUZZ_SEED", "20250107"))
CALLS = 300
OPS = ["neighbor_allreduce_static", "neighbor_allreduce_dynamic", "neighbor_allgather", "allreduce",
       "broadcast", "allgather", "pair_gossip", "hierarchical_neighbor_allreduce"]


def test_random_calls_match_numpy_or_fail_clearly_on_every_agent():
    # two emulated machines, so that hierarchical_neighbor_allreduce exchanges between machines;
    # a call that hangs becomes a TimeoutError (a failure) long before the outer timeout
    _, out = run_agents(4, "fuzz_ops.py", SEED, CALLS, timeout=240,
                        env={"BLUEFOG_OP_TIMEOUT_S": "20", "BLUEFOG_RANKS_PER_MACHINE": "2"})
    summary = re.search(r"^FUZZ (.*)$", out, re.M)
    assert summary, out[-3000:]
    counts = {k: int(v) for k, v in re.findall(r"(\S+)=(\d+)", summary.group(1))}
    # counts are summed over the 4 agents
    for op in OPS:
        assert counts.get(op, 0) >= 4 * 5, (op, counts)
    assert counts["values"] >= 4 * 150, counts            # most calls are valid and checked
    assert counts["errors"] >= 4 * 20, counts             # and plenty of clear errors
    assert counts["window_calls"] >= 4 * 10 and counts["topologies"] >= 4 * 5, counts

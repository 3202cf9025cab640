"""Reliability (issue 7, SPEC section 10): misuse is reported, not hung on; one dead
agent ends the job; nothing is silently wrong.

One test per case of the issue. The bad-input cases share one 4-agent job
(tests/workers/rel_cases.py runs each case on every agent and prints one line per
case and agent); the cases that end a job get a job of their own. Every job must
end within JOB_LIMIT_S.

Deeper tests of some of these live with their subject and are not repeated here:
numerics of every op (test_ops.py), set_topology agreement and refusal while ops
are in flight (test_runtime.py), window errors in depth (test_windows.py), a
timeline file that fails on one agent only (test_timeline.py), bfrun's argument
parsing in-process (test_bfrun.py).
"""
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from bluefog_lite.timeline._reader import metadata, read_events, read_spans
from mpi_helpers import REPO, UNTAKEN, WORKERS, run_agents, seconds_since

N = 4
JOB_LIMIT_S = 30.0
BFRUN = os.path.join(REPO, "bfrun")
ENV = {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}


# ---- the shared bad-input job ---------------------------------------------------------

class Outcomes:
    """{case: {rank: outcome}} from the REL lines of rel_cases.py."""

    def __init__(self, out):
        self.out = out
        self.cases = {}
        for case, rank, outcome in re.findall(r"^REL (\S+) (\d+) (.*)$", out, re.M):
            self.cases.setdefault(case, {})[int(rank)] = outcome

    def of(self, case):
        got = self.cases.get(case, {})
        assert sorted(got) == list(range(N)), f"{case}: agents {sorted(got)} reported:\n{self.out[-3000:]}"
        return got


@pytest.fixture(scope="module")
def cases():
    _, out = run_agents(N, "rel_cases.py", timeout=180, env={"BLUEFOG_OP_TIMEOUT_S": "20"})
    elapsed = seconds_since(r"STARTED \d+ ([\d.]+)", out)
    outcomes = Outcomes(out)
    assert outcomes.of("done") == {r: "OK" for r in range(N)}
    assert elapsed < JOB_LIMIT_S, f"the bad-input job took {elapsed:.1f} s"
    return outcomes


def raised(cases, case, exc, *words, ranks=range(N)):
    """Every agent in ranks raised exc with a message containing every word."""
    got = cases.of(case)
    for r in ranks:
        assert got[r].startswith(f"{exc}: "), f"{case} on rank {r}: {got[r]}"
        for word in words:
            assert word in got[r], f"{case} on rank {r}: {word!r} not in {got[r]}"
    return got


def worked(cases, prefix):
    checked = [c for c in cases.cases if c.startswith(prefix)]
    assert checked, f"no case {prefix}*"
    for case in checked:
        assert cases.of(case) == {r: "OK" for r in range(N)}, (case, cases.of(case))
    return checked


# ---- before init, after shutdown ------------------------------------------------------

RUNTIME_CALLS = ["rank", "set_topology", "barrier", "allreduce", "broadcast", "allgather",
                 "neighbor_allreduce", "neighbor_allgather", "hierarchical_neighbor_allreduce",
                 "pair_gossip", "poll", "synchronize", "win_create", "win_put", "win_get", "win_update",
                 "win_mutex", "win_free", "broadcast_parameters", "broadcast_optimizer_state",
                 "InferSourceFromDestinationRanks", "timeline_start", "DistributedAdaptWithCombineOptimizer"]


def test_every_operation_before_init_asks_for_init(cases):
    for call in RUNTIME_CALLS:
        raised(cases, f"before_init.{call}", "BluefogError", "not initialized", "bf.init()")
    assert len([c for c in cases.cases if c.startswith("before_init.")]) >= len(RUNTIME_CALLS)


def test_every_operation_after_shutdown_says_shut_down(cases):
    for call in RUNTIME_CALLS:
        raised(cases, f"after_shutdown.{call}", "BluefogError", "shut down", "bf.init() again")


def test_init_with_a_bad_topology_fn_fails_on_every_agent(cases):
    raised(cases, "init.topology_fn_wrong_size", "ValueError", "topology_fn", "nodes 0..3", "got 5 nodes")
    raised(cases, "init.topology_fn_not_callable", "TypeError", "topology_fn must be a callable")
    raised(cases, "init.topology_fn_differs", "ValueError", "different graphs on different agents")
    raised(cases, "init.is_weighted_differs", "ValueError", "init: agents passed different is_weighted",
           "rank 2: True")
    raised(cases, "init.one_agent_bad_graph", "ValueError", "init: the graph returned by topology_fn must have "
           "nodes 0..3", ranks=[1])
    raised(cases, "init.one_agent_bad_graph", "ValueError", "init failed on every agent because of bad input "
           "(rank 1: ValueError: init: the graph returned by topology_fn", ranks=[0, 2, 3])
    raised(cases, "init.one_agent_fn_raises", "ZeroDivisionError", "", ranks=[2])
    raised(cases, "init.one_agent_fn_raises", "ValueError", "(rank 2: ZeroDivisionError: ", ranks=[0, 1, 3])
    raised(cases, "init.one_agent_bad_is_weighted", "TypeError", "is_weighted must be True or False, got 'yes'",
           ranks=[3])
    raised(cases, "init.one_agent_bad_is_weighted", "ValueError", "(rank 3: TypeError: is_weighted", ranks=[0, 1, 2])
    # a graph whose neighbors cannot be read on one agent (RuntimeError, after the checks): every agent
    # raises (before, that agent alone raised after the exchange, and the others waited in init)
    raised(cases, "init.one_agent_unreadable_graph", "RuntimeError", "this graph's neighbors cannot be read",
           ranks=[0])
    raised(cases, "init.one_agent_unreadable_graph", "ValueError", "init failed on every agent because of bad input "
           "(rank 0: RuntimeError: this graph's neighbors cannot be read", ranks=[1, 2, 3])
    raised(cases, "init.after_failed_init", "BluefogError", "not initialized")   # and init() works after


# ---- tensors that differ between neighbors ---------------------------------------------------

def test_neighbor_allreduce_shape_or_dtype_differing_between_neighbors(cases):
    got = raised(cases, "mismatch.neighbor_allreduce.shape", "ValueError", "NEIGHBOR_ALLREDUCE 'mm.nar.shape'",
                 "same shape and dtype")
    for r in range(1, N):   # the others name rank 0 and what it sent
        assert "rank 0 sent float32[5] but this agent has float32[4]" in got[r]
    assert "but this agent has float32[5]" in got[0]
    got = raised(cases, "mismatch.neighbor_allreduce.dtype", "ValueError", "same shape and dtype")
    assert "rank 1 sent float64[4] but this agent has float32[4]" in got[0]


def test_neighbor_allgather_dtype_or_trailing_shape_differing(cases):
    got = raised(cases, "mismatch.neighbor_allgather.dtype", "ValueError", "NEIGHBOR_ALLGATHER",
                 "agree on dtype")
    assert "rank 2 sent int32[2, 3] but this agent has float32[2, 3]" in got[0]
    got = raised(cases, "mismatch.neighbor_allgather.shape", "ValueError", "all dimensions but the first")
    assert "rank 3 sent float32[2, 4]" in got[1]


def test_neighbor_allgather_and_neighbor_allreduce_under_one_name(cases):
    """Agent 1 runs neighbor_allgather where the others run neighbor_allreduce: every
    agent that receives from the other kind raises (the data used to be combined)."""
    for n in (4, 300_000):
        got = raised(cases, f"mismatch.kind.{n}", "ValueError", "neighbors must call the same operation")
        assert f"NEIGHBOR_ALLGATHER 'mm.kind.{n}': rank 0 sent its tensor for this name with " \
               "NEIGHBOR_ALLREDUCE" in got[1], got[1]
        for r in (0, 2, 3):
            assert f"NEIGHBOR_ALLREDUCE 'mm.kind.{n}': rank 1 sent its tensor for this name with " \
                   "NEIGHBOR_ALLGATHER" in got[r], got[r]


def test_pair_gossip_and_neighbor_allreduce_under_one_name(cases):
    """Agent 0 gossips with agent 1, which runs neighbor_allreduce with agent 0 under the
    same name: both raise, naming the other's operation; agents 2 and 3 gossip fine."""
    got = cases.of("mismatch.kind.pair_gossip")
    assert got[0].startswith("ValueError: PAIR_GOSSIP 'mm.kind.pg': rank 1 sent its tensor for this name "
                             "with NEIGHBOR_ALLREDUCE"), got[0]
    assert got[1].startswith("ValueError: NEIGHBOR_ALLREDUCE 'mm.kind.pg': rank 0 sent its tensor for this "
                             "name with PAIR_GOSSIP"), got[1]
    assert got[2] == got[3] == "NONE", got


def test_integer_allreduce_with_average_differing_between_agents_raises_everywhere(cases):
    """int8 sums in int64 to average, in int8 otherwise: MPI got two buffer types and
    aborted the job."""
    raised(cases, "collective.int_average_differs", "ValueError", "different average=", "rank 1: summed in int8")


def test_allreduce_shape_or_dtype_differing_lists_every_agent(cases):
    raised(cases, "mismatch.allreduce.shape", "ValueError", "agents passed different tensors",
           "rank 0: float32[3], rank 1: float32[2]")
    raised(cases, "mismatch.allreduce.dtype", "ValueError", "rank 3: int64[2]", "same shape and dtype")
    assert cases.of("mismatch.still_works") == {r: "OK" for r in range(N)}


def test_win_put_of_a_tensor_unlike_the_window(cases):
    raised(cases, "mismatch.win_create", "ValueError", "agents passed different windows",
           "rank 1: 'mm.win' float32[4]")
    raised(cases, "mismatch.win_put", "ValueError", "does not match window 'w3'", "float32[4]", "float32[3]",
           ranks=[1])
    assert [cases.of("mismatch.win_put")[r] for r in (0, 2, 3)] == ["NONE"] * 3


# ---- weights --------------------------------------------------------------------------------

def test_src_weights_naming_a_rank_that_is_not_an_in_neighbor(cases):
    got = raised(cases, "weights.src_not_in_neighbor", "ValueError", "not in-neighbors", "dst_weights")
    assert "names ranks [1] that are not in-neighbors [2, 3]" in got[0]


def test_dst_weights_without_a_matching_receiver(cases):
    raised(cases, "weights.dst_without_receiver", "ValueError", "do not match across agents",
           "rank 0 sends to rank 1 but rank 1 does not receive from it")


def test_nan_and_infinite_weights_are_refused(cases):
    raised(cases, "weights.nan_self_weight", "ValueError", "self_weight must be finite")
    raised(cases, "weights.nan_src_weight", "ValueError", "src_weights[", "must be finite")
    raised(cases, "weights.inf_dst_weight", "ValueError", "dst_weights[", "must be finite, got inf")
    raised(cases, "weights.nan_pair_weight", "ValueError", "pair_weight must be finite")
    raised(cases, "weights.nan_graph_weight", "ValueError", "edge 0 -> 1 has weight nan", "is_weighted=True")
    raised(cases, "weights.bool_weight", "TypeError", "self_weight must be a real number")


def test_negative_weights_are_used_as_given(cases):
    assert cases.of("weights.negative_used_as_given") == {r: "OK" for r in range(N)}


def test_one_number_tensors_and_arrays_are_weights_and_ranks(cases):
    assert cases.of("weights.tensor_and_array_scalars_used_as_numbers") == {r: "OK" for r in range(N)}
    raised(cases, "weights.tensor_of_two", "TypeError", "self_weight must be a real number", "tensor([0.5")
    raised(cases, "weights.tensor_rank_twice", "ValueError", "src_weights names rank", "twice")


def test_self_weight_without_src_weights(cases):
    for case in ("weights.self_without_src", "weights.src_without_self", "weights.self_and_dst_without_src"):
        raised(cases, case, "ValueError", "self_weight and src_weights must be given together")


# ---- ranks out of range -------------------------------------------------------------------------

def test_pair_gossip_target_out_of_range_or_self(cases):
    raised(cases, "range.pair_gossip_target", "ValueError", "target_rank 4 is out of range", "ranks 0..3")
    got = raised(cases, "range.pair_gossip_self", "ValueError", "this agent itself")
    assert "target_rank 2 " in got[2]


def test_broadcast_root_out_of_range_or_differing(cases):
    raised(cases, "range.broadcast_root", "ValueError", "root_rank 4 is out of range")
    raised(cases, "range.broadcast_root_negative", "ValueError", "root_rank -1 is out of range")
    raised(cases, "range.broadcast_root_differs", "ValueError", "rank 0: root 0", "rank 1: root 1")


def test_bad_collective_input_on_one_agent_fails_on_every_agent(cases):
    """The agent with bad input raises its own error; the others, which waited for it
    before, raise one naming it; the next collective works."""
    for case, bad, exc, words in (
            ("one_agent.allreduce_dtype", 1, "TypeError", "allreduce supports"),
            ("one_agent.broadcast_root", 2, "ValueError", "root_rank 4 is out of range"),
            ("one_agent.allgather_scalar", 3, "ValueError", "at least one dimension"),
            ("one_agent.allreduce_expanded", 0, "ValueError", "elements share memory"),
            ("one_agent.allreduce_local_flag", 2, "TypeError", "is_hierarchical_local"),
            # checks raising something else: the agent still joins (before: it raised alone)
            ("one_agent.allreduce_unreadable", 1, "RuntimeError", "this tensor cannot be read"),
            ("one_agent.broadcast_unreadable_", 3, "RuntimeError", "this tensor cannot be read"),
            ("one_agent.allgather_unreadable", 0, "RuntimeError", "this tensor cannot be read"),
            ("one_agent.allreduce_unreadable_flag", 2, "RuntimeError", "this flag cannot be read")):
        raised(cases, case, exc, words, ranks=[bad])
        raised(cases, case, "ValueError", "failed on every agent because of bad input",
               f"rank {bad}: {exc}: ", words, ranks=[r for r in range(N) if r != bad])
    assert cases.of("one_agent.next_collective") == {r: "OK" for r in range(N)}


@pytest.mark.parametrize("case,bad,exc,words,receivers", [
    # Exp-2 on 4 agents: r receives from r-1 and r-2; the ring: from r-1
    ("nar_static", 1, "TypeError", "cannot average bool tensors", [2, 3]),
    ("nar_checked", 2, "ValueError", "rank in src_weights 9 is out of range", [0, 1, 3]),
    ("nar_unchecked", 3, "ValueError", "self_weight must be finite", [0]),
    ("nar_huge", 3, "ValueError", "self_weight must be finite, got a number beyond float's range", [0]),
    ("nar_numpy_ranks", 1, "TypeError", "dst_weights must be a dict", [2]),
    ("nar_src_list", 1, "TypeError", "src_weights must be a dict {rank: weight}, got list (a list of ranks would "
     "give each weight 1", [2, 3]),
    ("nar_int_wraps", 3, "ValueError", "would wrap around", [0]),
    ("nag_static", 0, "ValueError", "at least one dimension", [1, 2]),
    ("gossip", 1, "TypeError", "cannot average bool tensors", [0]),
    ("local_allreduce", 2, "TypeError", "allreduce supports", [0, 1, 3]),
    ("local_allreduce_", 0, "ValueError", "elements share memory", [1, 2, 3]),
    ("nar_unreadable", 1, "RuntimeError", "this tensor cannot be read", [2, 3]),
    ("nag_unreadable", 0, "RuntimeError", "this tensor cannot be read", [1, 2]),
    ("gossip_unreadable", 3, "RuntimeError", "this tensor cannot be read", [2]),
    ("local_unreadable", 1, "RuntimeError", "this tensor cannot be read", [0, 2, 3]),
    ("nar_checked_unreadable_rank", 1, "RuntimeError", "this rank cannot be converted", [0, 2, 3]),
    ("nag_unreadable_flag", 2, "RuntimeError", "this flag cannot be read", [0, 1, 3]),
])
def test_bad_neighbor_arguments_on_one_agent_fail_on_its_receivers(cases, case, bad, exc, words, receivers):
    """The agent raises its own error; the agents that receive from it raise one naming
    it and its error (they waited for it before); the others finish; the next call of
    the name is right on every agent (against numpy: no input of the failed round is
    left over)."""
    got = raised(cases, f"one_agent.{case}", exc, words, ranks=[bad])
    # the topology check is collective: there every agent fails
    checked = case.startswith(("nar_checked", "nag_unreadable_flag"))
    why = "failed on every agent because of bad input" if checked else \
        f"rank {bad} sent nothing for it: the call failed there because of bad input"
    raised(cases, f"one_agent.{case}", "ValueError", why, f"{exc}: ", words, ranks=receivers)
    for r in set(range(N)) - set(receivers) - {bad}:
        assert got[r] == "NONE", (case, r, got[r])
    assert cases.of(f"one_agent.{case}.again") == {r: "OK" for r in range(N)}


def test_parameter_helpers_check_every_agents_parameters_first(cases):
    """A model or optimizer that differs on one agent (or bad arguments there) raises on
    every agent, naming the difference, and no parameter is changed; afterwards
    broadcast_parameters / broadcast_optimizer_state work (a wrapper on one agent too)."""
    raised(cases, "params.extra_layer", "ValueError", "broadcast_parameters: agents passed different parameters",
           "rank 1 has '2.bias', '2.weight' that rank 0 has not")
    assert cases.of("params.extra_layer_unchanged") == {r: "OK" for r in range(N)}
    raised(cases, "params.shape", "ValueError", "allreduce_parameters: parameter 'weight' is float32[2, 3] "
           "on rank 0 and float32[2, 4] on rank 2")
    raised(cases, "params.not_params", "TypeError", "params must be a state_dict()", "got Tensor", ranks=[3])
    raised(cases, "params.not_params", "ValueError", "failed on every agent because of bad input",
           "rank 3: TypeError: params must be", ranks=[0, 1, 2])
    raised(cases, "params.storage_unreadable", "RuntimeError", "this tensor's storage cannot be read", ranks=[3])
    raised(cases, "params.storage_unreadable", "ValueError", "failed on every agent because of bad input",
           "rank 3: RuntimeError: this tensor's storage cannot be read", ranks=[0, 1, 2])
    assert cases.of("params.storage_unreadable_unchanged") == {r: "OK" for r in range(N)}
    raised(cases, "params.optimizer_root", "ValueError", "root_rank 4 is out of range", ranks=[3])
    raised(cases, "params.optimizer_root", "ValueError", "failed on every agent because of bad input",
           "rank 3: ValueError: root_rank 4 is out of range", ranks=[0, 1, 2])
    raised(cases, "params.optimizer_kind", "ValueError", "agents passed different optimizers",
           "rank 1: SGD", "rank 2: Adam")
    # optimizers holding other parameters: one error on every agent (torch's load_state_dict
    # failed on some agents only, with its own words)
    raised(cases, "params.optimizer_groups", "ValueError", "the agents' optimizers hold different parameters",
           "rank 0: [2] parameters", "rank 1: [1, 1] parameters", "every agent must build the same model")
    raised(cases, "params.optimizer_shapes", "ValueError", "the agents' optimizers hold different parameters",
           "parameter 0 of group 0 has shape rank 0: [2, 2]", "rank 2: [2, 3]")
    raised(cases, "params.optimizer_module", "TypeError", "broadcast_optimizer_state needs an optimizer, got Linear")
    # a root state that cannot be pickled: named on the root, every agent raises, the job goes on
    raised(cases, "params.optimizer_unpicklable", "TypeError", "broadcast_optimizer_state: the root's optimizer "
           "state cannot be sent: param_groups[0]['fn'] cannot be pickled", ranks=[0])
    raised(cases, "params.optimizer_unpicklable", "ValueError", "failed on every agent because of bad input",
           "rank 0: TypeError", ranks=[1, 2, 3])
    raised(cases, "params.optimizer_hook_fails", "RuntimeError", "hook failed", ranks=[0])
    raised(cases, "params.optimizer_hook_fails", "ValueError", "failed on every agent",
           "rank 0: RuntimeError: hook failed", ranks=[1, 2, 3])
    raised(cases, "params.optimizer_roots", "ValueError", "broadcast_optimizer_state: agents passed different "
           "root_rank (rank 0: 0, rank 1: 1, rank 2: 2, rank 3: 3); all must name the same agent")
    raised(cases, "params.roots", "ValueError", "broadcast_parameters: agents passed different root_rank "
           "(rank 0: 1, rank 1: 0, rank 2: 0, rank 3: 0)")
    raised(cases, "params.dtype_skipped", "ValueError", "allreduce_parameters: parameter 'b' is float32[1] on "
           "rank 0 and bool[1] on rank 1")
    assert cases.of("params.after_errors") == {r: "OK" for r in range(N)}
    raised(cases, "params.expanded", "ValueError", "allreduce_parameters: parameter 'b': the tensor's elements "
           "share memory", ranks=[1])
    raised(cases, "params.expanded", "ValueError", "failed on every agent because of bad input", "rank 1",
           ranks=[0, 2, 3])
    assert cases.of("params.expanded_unchanged") == {r: "OK" for r in range(N)}
    raised(cases, "params.duplicate_names", "ValueError", "params has two entries named 'c'")
    raised(cases, "params.not_tensors", "TypeError", "params entry 'a' must be a tensor, got str")
    assert cases.of("params.names_free_after_errors") == {r: "OK" for r in range(N)}


def test_in_place_into_an_expanded_tensor(cases):
    raised(cases, "inplace.expanded.broadcast_", "ValueError", "broadcast_", "elements share memory", "clone()")
    raised(cases, "inplace.expanded.win_create", "ValueError", "elements share memory", "win_update")


def test_dst_weights_key_out_of_range(cases):
    raised(cases, "range.dst_weights_key", "ValueError", "rank in dst_weights 5 is out of range")
    raised(cases, "range.src_ranks_entry", "ValueError", "rank in src_ranks -1 is out of range")
    for case in ("range.dst_ranks_self", "range.infer_self"):   # no self_weight there to point to
        got = raised(cases, case, "ValueError", "is this agent itself; dst_ranks lists other agents only")
        assert all(f"rank in dst_ranks {r} " in got[r] for r in range(N)), got
    raised(cases, "range.machine_weights", "ValueError", "machine rank in src_machine_weights 1 is out of range",
           "there are 1 machines (machine ranks 0..0)")
    raised(cases, "range.machine_weights_half", "ValueError", "self_weight and src_machine_weights must be given")


# ---- topology ------------------------------------------------------------------------------------

def test_set_topology_with_a_graph_of_the_wrong_size_or_not_a_graph(cases):
    raised(cases, "topology.wrong_size", "ValueError", "nodes 0..3", "got 5 nodes")
    raised(cases, "topology.not_a_graph", "TypeError", "networkx.DiGraph", "got list")
    raised(cases, "topology.multigraph", "TypeError", "networkx.DiGraph", "got MultiDiGraph")
    raised(cases, "topology.float_nodes", "ValueError", "nodes 0..3", "got 4 nodes [0.0, 1.0, 2.0, 3.0]")
    # an edge of weight 0 still makes rank 0 an in-neighbor of rank 2: the graphs differ
    raised(cases, "topology.zero_weight_edge_differs", "ValueError", "agents passed different graphs")
    assert cases.of("topology.weights_ignored_unweighted") == {r: "OK" for r in range(N)}
    raised(cases, "topology.is_weighted_not_bool", "TypeError", "is_weighted must be True or False, got 'no'")
    raised(cases, "topology.is_weighted_differs", "ValueError", "agents passed different is_weighted",
           "rank 0: True, rank 1: False")
    assert cases.of("topology.unchanged_after_refusal") == {r: "OK" for r in range(N)}


def test_bad_topology_input_on_one_agent_fails_on_every_agent(cases):
    """set_topology / InferSourceFromDestinationRanks with bad input on one agent: it
    raises its own error, the others one naming it (they waited for it before)."""
    for case, bad, words in (("one_agent.set_topology", 2, "topology must have nodes 0..3"),
                             ("one_agent.infer_sources", 3, "rank in dst_ranks 4 is out of range")):
        raised(cases, case, "ValueError", words, ranks=[bad])
        raised(cases, case, "ValueError", "failed on every agent because of bad input",
               f"rank {bad}: ValueError: ", words, ranks=[r for r in range(N) if r != bad])
    assert cases.of("one_agent.after_topology") == {r: "OK" for r in range(N)}
    # the same with a graph whose neighbors cannot be read on one agent (before: the others took it)
    raised(cases, "one_agent.set_topology_unreadable", "RuntimeError", "this graph's neighbors cannot be read",
           ranks=[1])
    raised(cases, "one_agent.set_topology_unreadable", "ValueError", "failed on every agent because of bad input",
           "rank 1: RuntimeError: this graph's neighbors cannot be read", ranks=[0, 2, 3])
    assert cases.of("one_agent.set_topology_unreadable_unchanged") == {r: "OK" for r in range(N)}


def test_init_again_with_a_topology_warns_and_keeps_the_topology(cases):
    for r, outcome in cases.of("topology.init_again").items():
        assert outcome.startswith("bf.init() called again while initialized"), outcome
        assert "bf.set_topology" in outcome and outcome.endswith(f" in {sorted([(r - 2) % N, (r - 1) % N])}"), outcome


def test_set_topology_while_a_window_exists_is_refused(cases):
    for outcome in cases.of("topology.while_window_exists").values():
        assert outcome.startswith("returned False: set_topology refused: windows exist"), outcome


def test_set_topology_of_the_graph_in_use_while_a_window_exists_returns_true(cases):
    """Nothing to change: True without a warning, as Bluefog; another is_weighted is a change (refused)."""
    for outcome in cases.of("topology.same_while_window_exists").values():
        assert outcome.startswith("same True, reweighted False, weighted False: set_topology refused: windows"), outcome
        assert outcome.count("refused") == 1, outcome


def test_is_weighted_may_be_0_or_1(cases):
    assert cases.of("topology.is_weighted_int") == {r: "True True True False" for r in range(N)}


# ---- windows by name ------------------------------------------------------------------------------

def test_window_ops_on_an_unknown_window(cases):
    ops = [c for c in cases.cases if c.startswith("window.unknown.")]
    assert len(ops) == 8
    for case in ops:
        op = case.rsplit(".", 1)[1]
        raised(cases, case, "ValueError", f"{op}: no window named 'nope'", "existing windows: ['known']")


def test_win_create_twice_with_one_name(cases):
    raised(cases, "window.create_twice", "ValueError", "already exists")
    # only rank 2 passed a taken name: every agent gets the error naming rank 2
    raised(cases, "window.create_twice_on_one_agent", "ValueError", "failed on every agent",
           "rank 2: a window named 'known' already exists")
    # checks that raise something else on one agent (a tensor that cannot be read): every agent raises
    # (before: that agent alone, while the others waited in win_create); no window is made
    got = raised(cases, "window.create_unreadable_on_one_agent", "RuntimeError", "failed on every agent",
                 "rank 1: RuntimeError while checking the tensor: this tensor cannot be read")
    assert got[1].endswith("(cause: RuntimeError('this tensor cannot be read'))"), got[1]
    assert all(got[r].endswith("(cause: None)") for r in (0, 2, 3)), got
    assert cases.of("window.names_after_errors") == {r: "names known" for r in range(N)}


def test_win_free_of_an_unknown_name(cases):
    raised(cases, "window.free_unknown", "ValueError", "no window named 'nope'")
    raised(cases, "window.free_unknown_on_one_agent", "ValueError", "rank 0: no window named 'nope'")
    # a str subclass whose hash raises, on one agent: freed as its text (it raised there alone before)
    assert cases.of("window.free_str_subclass") == {r: "NONE" for r in range(N)}
    assert cases.of("window.names_after_errors") == {r: "names known" for r in range(N)}


# ---- names and handles ---------------------------------------------------------------------------

def test_the_same_name_twice_while_in_flight(cases):
    for case, name in (("name.twice.neighbor_allreduce", "twice"), ("name.twice.other_kind", "twice"),
                       ("name.twice.allreduce", "twice.ar")):
        raised(cases, case, "ValueError", f"an operation named {name!r} is already in flight",
               "synchronize it before reusing the name")
    assert cases.of("name.reusable_after_synchronize") == {r: "OK" for r in range(N)}


def test_names_the_library_runs_its_own_collectives_under_are_refused(cases):
    """A user operation named like bf.barrier()'s or an unnamed call's would make that
    call fail as "already in flight" (or be matched with it); such names are refused."""
    for reserved, call in (("barrier", "barrier()"), ("set_topology", "set_topology()"),
                           ("win_create", "win_create()")):
        for op in ("allreduce", "neighbor_allreduce", "broadcast", "pair_gossip"):
            raised(cases, f"reserved.{reserved}.{op}", "ValueError", f"name '{reserved}' is reserved",
                   f"bluefog_lite's {call} runs under it")
    for generated in ("allreduce.noname.0", "neighbor_allreduce.noname.7"):
        for op in ("allreduce", "neighbor_allreduce", "broadcast", "pair_gossip"):
            raised(cases, f"reserved.{generated}.{op}", "ValueError", f"'{generated}'",
                   "reserved for the names given to calls without one")
    raised(cases, "reserved.parameter_name.awc", "ValueError", "parameter name", "'barrier' is reserved")
    assert cases.of("reserved.internal_names") == {r: "OK" for r in range(N)}, cases.of("reserved.internal_names")
    assert cases.of("reserved.after") == {r: "NONE" for r in range(N)}


def test_a_handle_synchronized_twice(cases):
    for case in ("handle.twice", "handle.poll_after_synchronize", "handle.win_wait_twice", "handle.unknown",
                 "handle.from_before_shutdown"):
        raised(cases, case, "ValueError", "is unknown or was already synchronized")
    for case in ("handle.float", "handle.list"):
        raised(cases, case, "TypeError", "handle must be the int that a *_nonblocking call returned")
    assert cases.of("handle.after_init") == {r: "OK" for r in range(N)}


# ---- CUDA, non-contiguous, zero-element ------------------------------------------------------------

def test_tensors_without_data_get_a_clear_error(cases):
    # (a CUDA tensor cannot be made with a CPU-only torch: torch itself says so)
    raised(cases, "cuda.torch_without_cuda", "AssertionError", "not compiled with CUDA")
    raised(cases, "cuda.meta", "TypeError", "meta device", "no data")
    raised(cases, "cuda.meta_window", "TypeError", "win_create failed on every agent", "meta device")


def test_flags_must_be_true_or_false(cases):
    """On every agent (the collective and neighbor forms join their negotiation with the
    error, so nobody waits); numpy bools are bools."""
    for case, words in (("flags.average", "average must be True or False, got None"),
                        ("flags.average_local", "average must be True or False, got 'yes'"),
                        ("flags.is_hierarchical_local", "is_hierarchical_local must be True or False"),
                        ("flags.enable_topo_check", "enable_topo_check must be True or False, got 'no'"),
                        ("flags.enable_topo_check_gather", "enable_topo_check must be True or False, got 0")):
        raised(cases, case, "TypeError", words)
    assert cases.of("flags.after") == {r: "OK" for r in range(N)}


def test_layouts_and_dtypes_that_cannot_be_sent_get_a_clear_error(cases):
    """Sparse CSR, nested and quantized tensors are refused by name (raised on every agent
    before anything is sent, so nobody waits); a float8 tensor cannot be averaged; the
    unsigned integers beyond uint8 can."""
    for kind, words in (("sparse_csr", ("is sparse; pass a dense tensor", "sparse_csr")),
                        ("nested", ("nested tensor",)), ("quantized", ("is quantized", "dequantize()"))):
        for op_name in ("neighbor_allreduce", "allreduce", "allgather", "broadcast"):
            raised(cases, f"odd.{kind}.{op_name}", "TypeError", *words)
        raised(cases, f"odd.{kind}.win_create", "TypeError", "win_create failed on every agent")
    raised(cases, "odd.float8.neighbor_allreduce", "TypeError", "cannot average float8_e4m3fn tensors")
    assert cases.of("odd.uint16.neighbor_allreduce") == {r: "OK" for r in range(N)}
    for udt in ("uint16", "uint32", "uint64"):
        raised(cases, f"odd.torch.{udt}.scaled_beyond", "ValueError", f"takes this {udt} tensor's values",
               "where they would wrap around")
        assert cases.of(f"odd.torch.{udt}.scaled_within") == {r: "OK" for r in range(N)}


def test_non_contiguous_tensors_work(cases):
    assert len(worked(cases, "works.noncontiguous.")) == 10


def test_zero_element_and_zero_dim_tensors_work(cases):
    assert len(worked(cases, "works.empty.")) == 10
    assert len(worked(cases, "works.scalar.")) == 8


# ---- jobs that must end ----------------------------------------------------------------------------

def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class BfrunJob:
    """bfrun -np 4 --timeline-filename PREFIX python rel_die.py MODE, in a new session;
    its output is read in the background. Timed from when every agent runs (the
    failure comes a second later)."""

    def __init__(self, prefix, *worker_args):
        cmd = [sys.executable, BFRUN, "-np", str(N), "--timeline-filename", prefix, sys.executable,
               os.path.join(WORKERS, "rel_die.py"), *worker_args]
        self.proc = subprocess.Popen(cmd, env=dict(os.environ, **ENV), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines, self.out = queue.Queue(), []
        self.read_all = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        self.pids = {}

    def _read(self):
        for line in self.proc.stdout:
            self.out.append(line)
            self.lines.put(line)
        self.read_all.set()

    def wait_running(self, timeout=150):
        """True once every agent has said it runs (the job may have ended since)."""
        deadline = time.monotonic() + timeout
        while len(self.pids) < N and time.monotonic() < deadline:
            try:
                m = re.match(r"RUNNING (\d+) (\d+)", self.lines.get(timeout=0.5))
            except queue.Empty:
                if self.read_all.is_set():
                    break
                continue
            if m:
                self.pids[int(m.group(1))] = int(m.group(2))
        self.running = time.monotonic()
        return len(self.pids) == N

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def output(self):
        time.sleep(0.2)
        return "".join(self.out)

    def cleanup(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)      # bfrun takes its launcher and ranks down
            if self.wait(20) is None:
                self.proc.kill()
                self.proc.wait()
        for pid in self.pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def bfrun_job(tmp_path):
    jobs = []

    def start(*worker_args):
        jobs.append(BfrunJob(str(tmp_path / "tl_"), *worker_args))
        return jobs[-1]
    yield start
    for job in jobs:
        job.cleanup()


def assert_everyone_gone_and_timelines_load(job, prefix):
    assert job.pids and [r for r, pid in job.pids.items() if _alive(pid)] == [], job.pids
    for r in range(N):
        events = read_events(f"{prefix}{r}.json")
        assert metadata(events)["rank"] == r
        spans = read_spans(events, complete=False)     # raises if a viewer could not read it
        assert any(s.name == "ITERATION" for s in spans), f"rank {r}: no ITERATION span"


def test_an_exception_on_one_agent_ends_the_job(bfrun_job, tmp_path):
    job = bfrun_job("raise")
    assert job.wait_running(), job.output()
    rc = job.wait(JOB_LIMIT_S - (time.monotonic() - job.running))
    out = job.output()
    assert rc is not None, f"the job did not end within {JOB_LIMIT_S} s:\n{out[-3000:]}"
    assert rc != 0
    assert "RuntimeError: deliberate failure on rank 2" in out
    assert "uncaught exception on rank 2; aborting the job" in out
    assert_everyone_gone_and_timelines_load(job, str(tmp_path / "tl_"))


def test_one_agent_killed_with_sigkill_ends_the_job(bfrun_job, tmp_path):
    job = bfrun_job("kill")
    assert job.wait_running(), job.output()
    rc = job.wait(JOB_LIMIT_S - (time.monotonic() - job.running))
    out = job.output()
    assert rc is not None, f"the job did not end within {JOB_LIMIT_S} s:\n{out[-3000:]}"
    assert rc != 0 and "rank 1 was killed by signal SIGKILL" in out, out[-3000:]
    assert_everyone_gone_and_timelines_load(job, str(tmp_path / "tl_"))


def test_ctrl_c_to_bfrun_stops_every_agent(bfrun_job, tmp_path):
    job = bfrun_job("loop")
    assert job.wait_running(), job.output()
    interrupted = time.monotonic()
    job.proc.send_signal(signal.SIGINT)
    rc = job.wait(JOB_LIMIT_S)
    out = job.output()
    assert rc is not None, f"bfrun did not end within {JOB_LIMIT_S} s of SIGINT:\n{out[-3000:]}"
    assert rc == 128 + signal.SIGINT, out[-3000:]
    assert time.monotonic() - interrupted < JOB_LIMIT_S
    time.sleep(0.5)
    assert_everyone_gone_and_timelines_load(job, str(tmp_path / "tl_"))


@pytest.mark.parametrize("window", [False, True])
def test_sys_exit_on_one_agent_while_others_wait_for_it_ends_the_job(window):
    # plain mpiexec: the library itself, not bfrun's rank guard, must end the job. With a
    # window, the leaving agent waits in shutdown's win_free for the others, which wait
    # for its data: they must learn that it has started to shut down (it hung before)
    rc, out = run_agents(N, "rel_die.py", "exit", "3", timeout=180, expect_ok=False,
                         env={"REL_DIE_WINDOW": "1" if window else "0"})
    elapsed = seconds_since(r"calls sys.exit\(3\) after \d+ iterations at ([\d.]+)", out)
    assert rc != 0 and "rank 2 calls sys.exit(3)" in out, out[-3000:]
    # ranks 0 and 3 receive from rank 2 on the Exp-2 graph: they are the ones that can tell
    waiting = set(re.findall(r"rank (\d): NEIGHBOR_ALLREDUCE 'x' waits for rank 2, which has left the job", out))
    assert waiting and waiting <= {"0", "3"}, out[-3000:]
    assert elapsed < JOB_LIMIT_S, f"took {elapsed:.1f} s"


# ---- timeline prefix -------------------------------------------------------------------------------

@pytest.mark.parametrize("where, words", [
    ("missing", ["does not exist"]),
    ("unwritable", ["cannot write", "Permission denied"]),
])
def test_bad_timeline_prefix_fails_init_everywhere_before_any_work(where, words, tmp_path):
    prefix = str(tmp_path / "no" / "such" / "dir" / "tl_") if where == "missing" else "/sys/bluefog_tl_"
    rc, out = run_agents(N, "rel_init_fails.py", timeout=180, expect_ok=False, env={"BLUEFOG_TIMELINE": prefix})
    elapsed = seconds_since(r"INIT AT ([\d.]+)", out)
    assert rc != 0 and "PAST INIT" not in out, out[-3000:]
    for r in range(N):
        assert f"ValueError: timeline: cannot write '{prefix}{r}.json'" in out, (r, out[-3000:])
    for word in words:
        assert word in out
    assert elapsed < JOB_LIMIT_S, f"took {elapsed:.1f} s"


@pytest.mark.parametrize("where, words", [
    ("missing", ["does not exist", "create it first"]),
    ("unwritable", ["is not writable", "Permission denied"]),
    ("file", ["is not a directory"]),
])
def test_bfrun_refuses_a_bad_timeline_prefix_before_starting_anything(where, words, tmp_path):
    (tmp_path / "file").write_text("")
    prefix = {"missing": str(tmp_path / "no" / "tl_"), "unwritable": "/sys/bluefog_tl_",
              "file": str(tmp_path / "file" / "tl_")}[where]
    rc, err, started = _bfrun_without_job(tmp_path, "-np", "2", "--timeline-filename", prefix)
    assert rc == 2 and not started, err
    assert "bfrun: error: --timeline-filename" in err
    for word in words:
        assert word in err, err


# ---- bfrun arguments -------------------------------------------------------------------------------

def _bfrun_without_job(tmp_path, *argv, env=None, python=sys.executable):
    """Run bfrun with argv and a command that would leave a marker file; (rc, stderr, started)."""
    marker = tmp_path / "started"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"] if argv and argv[-1] != "--" else []
    start = time.monotonic()
    full_env = {k: v for k, v in os.environ.items() if k != "BLUEFOG_MPIEXEC"}
    full_env.update(env or ENV)
    proc = subprocess.run([python, BFRUN, *argv, *command], env=full_env, capture_output=True, text=True,
                          timeout=60)
    assert time.monotonic() - start < JOB_LIMIT_S
    return proc.returncode, proc.stderr, marker.exists()


@pytest.mark.parametrize("argv, words", [
    (["-np", "0"], ["-np", "must be a positive integer, got 0"]),
    (["-np", "4", "--"], ["missing command"]),
    (["--no-such-option", "-np", "2"], ["unrecognized arguments", "--no-such-option"]),
])
def test_bfrun_bad_arguments_exit_2_without_a_job(argv, words, tmp_path):
    rc, err, started = _bfrun_without_job(tmp_path, *argv)
    assert rc == 2 and not started, err
    for word in words:
        assert word in err, err


def test_bfrun_without_an_mpi_launcher(tmp_path):
    # an interpreter in a directory without mpiexec, and a PATH without one
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python3"
    python.symlink_to(os.path.realpath(sys.executable))
    env = dict(ENV, PATH=str(tmp_path / "bin"))
    rc, err, started = _bfrun_without_job(tmp_path, "-np", "2", env=env, python=str(python))
    assert rc == 2 and not started, err
    assert "no MPI launcher found" in err and "pip install mpich" in err


# ---- soak ------------------------------------------------------------------------------------------

def test_soak_nothing_grows_and_nothing_drifts():
    """examples/benchmarks/soak.py with 5,000 neighbor_allreduce and 2,000 window ops
    per agent (the full 100,000 + 20,000 run is in docs/troubleshooting.md)."""
    _, out = run_agents(N, os.path.join(REPO, "examples", "benchmarks", "soak.py"), "--nar", 5000,
                        "--win", 2000, timeout=400)
    samples = {}     # (rank, phase) -> [sample dicts in order]
    for rank, fields in re.findall(r"^SOAK (\d) (phase=.*)$", out, re.M):
        s = dict(kv.split("=") for kv in fields.split())
        samples.setdefault((int(rank), s.pop("phase")), []).append({k: int(v) for k, v in s.items()})
    for rank in range(N):
        for phase, count in (("neighbor_allreduce", 5000), ("window", 2000)):
            warm, *_, last = samples[(rank, phase)]      # post-warm-up, halfway, end
            assert last["done"] == count
            assert last["rss_kb"] <= 1.10 * warm["rss_kb"], (rank, phase, warm, last)
            assert (last["os_threads"], last["py_threads"]) == (warm["os_threads"], warm["py_threads"])
            assert last["handles"] == last["names"] == 0, (rank, phase, last)
            assert last["window_handles"] <= warm["window_handles"], (rank, phase, warm, last)
    summaries = re.findall(r"^SOAK SUMMARY \d: (.*)$", out, re.M)
    assert sum("distance to the average" in s for s in summaries) == N, out[-3000:]
    assert sum("accumulates per agent all counted" in s for s in summaries) == N, out[-3000:]


def test_soak_of_a_few_window_operations_reports_nothing():
    """Fewer than 20 window operations: the baseline sample came before the second window
    was first used, and its handle counted as growth (a false SOAK PROBLEM, exit 1)."""
    _, out = run_agents(2, os.path.join(REPO, "examples", "benchmarks", "soak.py"), "--nar", 100, "--win", 19,
                        timeout=120)
    assert "SOAK PROBLEM" not in out, out[-3000:]


def test_data_no_operation_took_is_reported_at_shutdown():
    """A send nobody receives (dynamic weights that disagree, the topology check off)
    is named at shutdown by the agent it was sent to, and only there."""
    _, out = run_agents(4, "ops_untaken.py", timeout=90, untaken_ok=True)
    warnings = [line for line in out.splitlines() if UNTAKEN in line]
    assert len(warnings) == 1, out[-3000:]
    assert "(rank 1)" in warnings[0] and "1 from rank 0 under 'stray'" in warnings[0], warnings
    assert "enable_topo_check=False" in warnings[0], warnings

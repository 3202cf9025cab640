"""Dynamic send/receive schedules of ``topology``: rules, consistency, errors."""

import itertools
import math

import networkx as nx
import numpy as np
import pytest

import topology


def run_lockstep(generators, steps):
    """Step all generators together; return [[(send, recv) per rank] per step]."""
    return [[next(g) for g in generators] for _ in range(steps)]


def assert_consistent(schedule):
    """At every step j in send(i) <=> i in recv(j); lists sorted, no self."""
    for step in schedule:
        sends = {(i, j) for i, (send, _) in enumerate(step) for j in send}
        recvs = {(i, j) for j, (_, recv) in enumerate(step) for i in recv}
        assert sends == recvs
        for rank, (send, recv) in enumerate(step):
            assert send == sorted(send) and recv == sorted(recv)


def one_peer(G, steps):
    n = G.number_of_nodes()
    return run_lockstep([topology.GetDynamicOnePeerSendRecvRanks(G, r) for r in range(n)], steps)


# ---- GetDynamicOnePeerSendRecvRanks -------------------------------------------


def test_one_peer_exp2_of_8_cycles_through_clockwise_neighbors():
    gen = topology.GetDynamicOnePeerSendRecvRanks(topology.ExponentialTwoGraph(8), 0)
    steps = [next(gen) for _ in range(4)]
    assert steps == [([1], [7]), ([2], [6]), ([4], [4]), ([1], [7])]


def test_one_peer_ring_sends_right_then_left():
    gen = topology.GetDynamicOnePeerSendRecvRanks(topology.RingGraph(5), 2)
    # Clockwise distances from 2: rank 3 at 1, rank 1 at 4.
    assert [next(gen) for _ in range(3)] == [([3], [1]), ([1], [3]), ([3], [1])]


def test_one_peer_star_center_receives_from_all_leaves():
    G = topology.StarGraph(4)
    schedule = one_peer(G, 3)
    # The centre cycles 1, 2, 3; every leaf always sends to the centre.
    assert [step[0] for step in schedule] == [([1], [1, 2, 3]), ([2], [1, 2, 3]), ([3], [1, 2, 3])]
    assert schedule[1][2] == ([0], [0])
    assert schedule[1][1] == ([0], [])


def test_one_peer_rank_without_out_neighbors_sends_nothing():
    G = nx.DiGraph()
    G.add_nodes_from(range(3))
    G.add_edges_from([(0, 0), (1, 1), (2, 2), (0, 1), (1, 2), (0, 2)])
    schedule = one_peer(G, 2)
    assert schedule[0] == [([1], []), ([2], [0]), ([], [1])]
    assert schedule[1] == [([2], []), ([2], []), ([], [0, 1])]
    assert_consistent(schedule)


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_one_peer_exp2_reaches_exact_average_in_log2_n_steps(n):
    steps = int(math.log2(n))
    G = topology.ExponentialTwoGraph(n)
    x = np.random.default_rng(n).normal(size=n)
    mean = x.mean()
    for t, step in enumerate(one_peer(G, steps)):
        assert all(len(recv) == 1 for _, recv in step)
        x = np.array([0.5 * x[r] + 0.5 * x[recv[0]] for r, (_, recv) in enumerate(step)])
        if t < steps - 1:
            assert not np.allclose(x, mean)
    np.testing.assert_allclose(x, mean, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 9, 12, 17])
@pytest.mark.parametrize(
    "build",
    [
        topology.ExponentialTwoGraph,
        topology.SymmetricExponentialGraph,
        topology.MeshGrid2DGraph,
        topology.StarGraph,
        topology.RingGraph,
        lambda n: topology.RingGraph(n, 1),
        topology.FullyConnectedGraph,
    ],
)
def test_one_peer_schedule_is_consistent(build, n):
    G = build(n)
    schedule = one_peer(G, 2 * n)
    assert_consistent(schedule)
    for step in schedule:
        for r, (send, _) in enumerate(step):
            assert len(send) <= 1 and all(G.has_edge(r, d) and d != r for d in send)


def test_one_peer_size_one_idles():
    gen = topology.GetDynamicOnePeerSendRecvRanks(topology.RingGraph(1), 0)
    assert [next(gen) for _ in range(2)] == [([], []), ([], [])]


# ---- GetExp2DynamicSendRecvMachineRanks -----------------------------------------


def test_exp2_machine_ranks_for_8_machines():
    gen = topology.GetExp2DynamicSendRecvMachineRanks(16, 2, 1, 1)  # machine 0
    assert [next(gen) for _ in range(4)] == [([1], [7]), ([2], [6]), ([4], [4]), ([1], [7])]
    gen = topology.GetExp2DynamicSendRecvMachineRanks(16, 2, 7, 1)  # machine 3
    assert [next(gen) for _ in range(3)] == [([4], [2]), ([5], [1]), ([7], [7])]


@pytest.mark.parametrize(
    "machines, distances", [(2, [1]), (3, [1, 2]), (5, [1, 2, 4]), (9, [1, 2, 4, 8])]
)
def test_exp2_machine_distances_cycle(machines, distances):
    gen = topology.GetExp2DynamicSendRecvMachineRanks(machines * 3, 3, 0, 0)
    got = [next(gen)[0][0] for _ in range(2 * len(distances))]
    assert got == distances * 2


def test_exp2_machine_single_machine_idles():
    gen = topology.GetExp2DynamicSendRecvMachineRanks(4, 4, 2, 2)
    assert [next(gen) for _ in range(3)] == [([], [])] * 3


@pytest.mark.parametrize("machines", [1, 2, 3, 4, 5, 7, 8, 13])
@pytest.mark.parametrize("local_size", [1, 3])
def test_exp2_machine_schedule_is_consistent(machines, local_size):
    world = machines * local_size
    per_rank = run_lockstep(
        [topology.GetExp2DynamicSendRecvMachineRanks(world, local_size, r, r % local_size)
         for r in range(world)],
        12,
    )
    for step in per_rank:
        # All ranks of a machine agree; machines form a consistent schedule.
        for r in range(world):
            assert step[r] == step[(r // local_size) * local_size]
    assert_consistent([step[::local_size] for step in per_rank])


@pytest.mark.parametrize(
    "args, name",
    [
        ((10, 4, 0, 0), "world_size"),
        ((0, 4, 0, 0), "world_size"),
        ((8, 0, 0, 0), "local_size"),
        ((8, 4, 8, 0), "self_rank"),
        ((8, 4, 5, 0), "local_rank"),
        ((8, 4, 1, 4), "local_rank"),
    ],
)
def test_exp2_machine_bad_arguments_raise_at_call(args, name):
    with pytest.raises(ValueError, match=name):
        topology.GetExp2DynamicSendRecvMachineRanks(*args)


# ---- inner/outer schedules ------------------------------------------------------

INNER_OUTER = [
    topology.GetInnerOuterRingDynamicSendRecvRanks,
    topology.GetInnerOuterExpo2DynamicSendRecvRanks,
]


def inner_outer(fn, world, local, steps):
    return run_lockstep([fn(world, local, r) for r in range(world)], steps)


@pytest.mark.parametrize("fn", INNER_OUTER)
def test_inner_outer_two_machines_of_four_first_step(fn):
    # Step 0: local rank 0 outside, distance 1 inside and out: ring and expo2 coincide.
    schedule = inner_outer(fn, 8, 4, 1)
    assert schedule[0][:4] == [([4], [4]), ([2], [3]), ([3], [1]), ([1], [2])]


def test_inner_outer_ring_two_machines_of_four_second_step():
    schedule = inner_outer(topology.GetInnerOuterRingDynamicSendRecvRanks, 8, 4, 2)
    assert schedule[1][:4] == [([2], [3]), ([5], [5]), ([3], [0]), ([0], [2])]


def test_inner_outer_expo2_inner_distance_counts_past_the_outside_rank():
    # Step 1: local rank 1 outside; inside d = 2 (distances 1, 2 for 4 - 2 inner ranks).
    # Rank 0: 2 ahead passes rank 1, so 3 -> rank 3; 2 behind -> rank 2.
    # Rank 2: 2 ahead -> rank 0; 2 behind passes rank 1 -> rank 3. Rank 3: both pass it -> 2, 0.
    schedule = inner_outer(topology.GetInnerOuterExpo2DynamicSendRecvRanks, 8, 4, 2)
    assert schedule[1][:4] == [([3], [2]), ([5], [5]), ([0], [3]), ([2], [0])]
    # 8 per machine (d = 1, 2, 4), rank 1: the docstring's example
    gen = topology.GetInnerOuterExpo2DynamicSendRecvRanks(16, 8, 1)
    assert [next(gen) for _ in range(3)] == [([2], [7]), ([9], [9]), ([6], [5])]


def test_inner_outer_ring_uses_next_machine():
    schedule = inner_outer(topology.GetInnerOuterRingDynamicSendRecvRanks, 12, 3, 7)
    rank0 = [step[0] for step in schedule]
    assert rank0[0] == rank0[3] == rank0[6] == ([3], [9])
    assert rank0[1] == ([2], [2])  # inner ring of {0, 2}: 1 is outside
    assert schedule[2][4] == ([3], [3])  # inner ring of {3, 4}: 5 is outside
    assert schedule[2][5] == ([8], [2])


def test_inner_outer_expo2_machine_distance_follows_the_step():
    # 16 ranks, 4 per machine: M = 4 machines, distances 1, 2 by step k % 2 (Bluefog's
    # rule). Local rank 0 goes outside at even steps, so always 1 machine ahead; local
    # rank 1 at odd ones, always 2 ahead.
    schedule = inner_outer(topology.GetInnerOuterExpo2DynamicSendRecvRanks, 16, 4, 12)
    assert [schedule[k][0] for k in (0, 4, 8)] == [([4], [12])] * 3
    assert [schedule[k][5] for k in (1, 5, 9)] == [([13], [13])] * 3


def test_inner_outer_expo2_every_local_rank_visits_every_distance_when_counts_are_coprime():
    # 8 machines of 4: distances 1, 2, 4 (3 of them, coprime with 4 local ranks).
    fn = topology.GetInnerOuterExpo2DynamicSendRecvRanks
    for local in range(4):
        gen = fn(32, 4, local)
        sends = [send for k, (send, _) in enumerate(itertools.islice(gen, 48)) if k % 4 == local]
        assert {(s[0] // 4) for s in sends} == {1, 2, 4}


@pytest.mark.parametrize("fn", INNER_OUTER)
def test_inner_outer_single_machine_outside_rank_idles(fn):
    schedule = inner_outer(fn, 4, 4, 4)
    for k, step in enumerate(schedule):
        assert step[k] == ([], [])
        assert_consistent([step])
        assert sum(len(send) for send, _ in step) == 3


@pytest.mark.parametrize("machines", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("local_size", [3, 4, 5])
@pytest.mark.parametrize("fn", INNER_OUTER)
def test_inner_outer_schedule_is_consistent(fn, machines, local_size):
    world = machines * local_size
    schedule = inner_outer(fn, world, local_size, 3 * local_size)
    assert_consistent(schedule)
    for k, step in enumerate(schedule):
        for r, (send, recv) in enumerate(step):
            outside = r % local_size == k % local_size
            if outside and machines == 1:
                assert (send, recv) == ([], [])
                continue
            assert len(send) == len(recv) == 1
            same_machine = send[0] // local_size == r // local_size
            assert same_machine != outside
            if outside:
                assert send[0] % local_size == recv[0] % local_size == r % local_size


@pytest.mark.parametrize("fn", INNER_OUTER)
@pytest.mark.parametrize(
    "args, name",
    [
        ((8, 2, 0), "GetDynamicOnePeerSendRecvRanks"),
        ((4, 1, 0), "local_size"),
        ((9, 4, 0), "world_size"),
        ((8, 4, 8), "self_rank"),
        ((8, 4, -1), "self_rank"),
        ((8, 0, 0), "local_size"),
        ((8.0, 4, 0), "world_size"),
    ],
)
def test_inner_outer_bad_arguments_raise_at_call(fn, args, name):
    with pytest.raises(ValueError, match=name):
        fn(*args)


def test_one_peer_bad_rank_raises_at_call():
    with pytest.raises(ValueError, match="self_rank"):
        topology.GetDynamicOnePeerSendRecvRanks(topology.RingGraph(4), 4)
    with pytest.raises(ValueError, match="topo"):
        topology.GetDynamicOnePeerSendRecvRanks(None, 0)

"""Dynamic topologies: per-step send/receive schedules.

Each function validates its arguments immediately and returns an infinite
iterator; step ``k`` of the iterator is ``(send_ranks, recv_ranks)``, two
sorted lists.  When every rank steps its own iterator in lockstep the
schedule is consistent: at every step ``j in send(i)`` iff ``i in recv(j)``.
"""

from typing import Iterator, List, Tuple

import networkx as nx

from ._validate import check_int, check_rank, check_topology

__all__ = [
    "GetDynamicOnePeerSendRecvRanks",
    "GetExp2DynamicSendRecvMachineRanks",
    "GetInnerOuterRingDynamicSendRecvRanks",
    "GetInnerOuterExpo2DynamicSendRecvRanks",
]

Schedule = Iterator[Tuple[List[int], List[int]]]


def _num_exp2_distances(num_machines: int) -> int:
    """Number of distances ``2**j`` with ``2**j < num_machines`` (at least 1)."""
    return max(num_machines - 1, 1).bit_length()


def GetDynamicOnePeerSendRecvRanks(topo: nx.DiGraph, self_rank: int) -> Schedule:
    """One-peer schedule: each step, send to one out-neighbor of ``topo``.

    Rule: place the ranks on a clock and sort the out-neighbors of each rank
    ``r`` (self excluded) by clockwise distance ``(d - r) % n``.  At step
    ``k`` rank ``r`` sends to ``sorted_out[r][k % len(sorted_out[r])]`` (to
    nobody if it has no out-neighbor) and receives from every rank that sends
    to it at step ``k``.

    Example: on ``ExponentialTwoGraph(8)`` rank 0 sends to 1, 2, 4, 1, ...
    and receives from 7, 6, 4, 7, ...; averaging ``x <- (x + recv) / 2``
    for 3 steps gives the exact global mean.

    Raises ValueError if ``self_rank`` is not a node of ``topo``.
    """
    topo = check_topology(topo)
    size = topo.number_of_nodes()
    self_rank = check_rank(self_rank, size, "self_rank")
    sorted_out = [
        sorted((d for d in topo.successors(r) if d != r), key=lambda d, r=r: (d - r) % size)
        for r in range(size)
    ]
    return _one_peer_schedule(sorted_out, self_rank)


def _one_peer_schedule(sorted_out: List[List[int]], self_rank: int) -> Schedule:
    step = 0
    while True:
        targets = [peers[step % len(peers)] if peers else None for peers in sorted_out]
        send = [] if targets[self_rank] is None else [targets[self_rank]]
        recv = [src for src, dst in enumerate(targets) if dst == self_rank]
        yield send, recv
        step += 1


def _check_machines(world_size, local_size) -> Tuple[int, int, int]:
    """Validate a homogeneous layout; return (world_size, local_size, machines)."""
    world_size = check_int(world_size, "world_size", minimum=1)
    local_size = check_int(local_size, "local_size", minimum=1)
    if world_size % local_size != 0:
        raise ValueError(
            f"world_size ({world_size}) must be a multiple of local_size ({local_size}): "
            "these schedules need the same number of ranks on every machine"
        )
    return world_size, local_size, world_size // local_size


def GetExp2DynamicSendRecvMachineRanks(
    world_size: int, local_size: int, self_rank: int, local_rank: int
) -> Schedule:
    """One-peer exponential-2 schedule between machines; yields MACHINE ranks.

    Rule: with ``M = world_size // local_size`` machines and this rank on
    machine ``m = self_rank // local_size``, at step ``k`` the distance is
    ``d = 2**(k mod (floor(log2(M - 1)) + 1))``; machine ``m`` sends to
    machine ``(m + d) % M`` and receives from ``(m - d) % M``.  With a single
    machine every step is ``([], [])``.

    Example: ``M = 8``: distances cycle 1, 2, 4, so machine 0 sends to
    machines 1, 2, 4, 1, ... and receives from 7, 6, 4, 7, ...

    Raises ValueError unless the layout is homogeneous
    (``world_size % local_size == 0``) and ``self_rank % local_size == local_rank``.
    """
    world_size, local_size, machines = _check_machines(world_size, local_size)
    self_rank = check_rank(self_rank, world_size, "self_rank")
    local_rank = check_rank(local_rank, local_size, "local_rank")
    if self_rank % local_size != local_rank:
        raise ValueError(
            f"local_rank ({local_rank}) must equal self_rank % local_size "
            f"({self_rank} % {local_size}); only homogeneous layouts are supported"
        )
    return _exp2_machine_schedule(self_rank // local_size, machines)


def _exp2_machine_schedule(machine: int, machines: int) -> Schedule:
    num_distances = _num_exp2_distances(machines)
    step = 0
    while True:
        if machines == 1:
            yield [], []
        else:
            distance = 2 ** (step % num_distances)
            yield [(machine + distance) % machines], [(machine - distance) % machines]
        step += 1


def _check_inner_outer(world_size, local_size, self_rank) -> Tuple[int, int, int]:
    world_size, local_size, machines = _check_machines(world_size, local_size)
    self_rank = check_rank(self_rank, world_size, "self_rank")
    if local_size <= 2:
        raise ValueError(
            f"local_size must be > 2 for the inner ring, got {local_size}; with 1 or 2 "
            "ranks per machine use GetDynamicOnePeerSendRecvRanks (or "
            "hierarchical_neighbor_allreduce) instead"
        )
    return local_size, machines, self_rank


def _inner_outer_schedule(local_size, machines, self_rank, outer_distance, inner_distance) -> Schedule:
    """Shared loop; ``outer_distance(step)`` is the machine distance at a step,
    ``inner_distance(step)`` the distance between local ranks inside a machine,
    counted without the outside rank (a step that would land on it goes one further)."""
    machine, local = divmod(self_rank, local_size)
    step = 0
    while True:
        outside = step % local_size
        if local == outside:
            if machines == 1:
                send, recv = [], []
            else:
                distance = outer_distance(step)
                send = [((machine + distance) % machines) * local_size + local]
                recv = [((machine - distance) % machines) * local_size + local]
        else:
            distance = inner_distance(step)
            ahead = distance + 1 if distance >= (outside - local) % local_size else distance
            behind = distance + 1 if distance >= (local - outside) % local_size else distance
            send = [machine * local_size + (local + ahead) % local_size]
            recv = [machine * local_size + (local - behind) % local_size]
        yield send, recv
        step += 1


def GetInnerOuterRingDynamicSendRecvRanks(
    world_size: int, local_size: int, self_rank: int
) -> Schedule:
    """Inner ring inside each machine plus an outer ring between machines.

    Rule: at step ``k`` the rank with local rank ``o = k % local_size`` on
    every machine ``m`` is *outside*: it sends to local rank ``o`` of machine
    ``(m + 1) % M`` and receives from local rank ``o`` of machine
    ``(m - 1) % M`` (with ``M == 1`` it idles: ``([], [])``).  The other
    ranks of each machine form an inner ring: each sends to the next local
    rank and receives from the previous one, skipping ``o``.

    Example: ``world_size=8, local_size=4`` (machines {0..3}, {4..7}), step 0:
    rank 0 sends to 4 and receives from 4; rank 1 sends to 2 and receives
    from 3; rank 3 sends to 1 (skipping 0) and receives from 2.

    Raises ValueError unless ``world_size % local_size == 0`` and
    ``local_size > 2`` (use GetDynamicOnePeerSendRecvRanks for smaller machines).
    """
    local_size, machines, self_rank = _check_inner_outer(world_size, local_size, self_rank)
    return _inner_outer_schedule(local_size, machines, self_rank, lambda step: 1, lambda step: 1)


def GetInnerOuterExpo2DynamicSendRecvRanks(
    world_size: int, local_size: int, self_rank: int
) -> Schedule:
    """One-peer exponential-2 both inside each machine and between machines
    (Bluefog's Inner-Exp2-Outer-Exp2 schedule, step for step).

    Rule: at step ``k`` the rank with local rank ``o = k % L`` on every machine
    ``m`` is *outside*: it sends to local rank ``o`` of machine ``(m + 2**j) % M``
    and receives from machine ``(m - 2**j) % M``, with ``j = k % J`` and ``J``
    the number of distances ``2**j < M`` (with ``M == 1`` it idles: ``([], [])``).
    The other ranks stay inside: with ``d = 2**(k % I)``, ``I`` the number of
    distances ``2**i <= L - 2``, each sends ``d`` local ranks ahead and receives
    from ``d`` behind, counting past the outside rank (a distance that reaches
    or passes it is one longer). As in Bluefog, ``j`` follows ``k`` while the
    outside rank does too, so a local rank may meet only some of the machine
    distances (``L = 4, M = 16``: local rank 1 always goes 2 machines ahead).

    Example: ``world_size=16, local_size=8`` (``M = 2``; inside ``d`` = 1, 2, 4),
    rank 1: step 0 (rank 0 outside, ``d = 1``) sends to 2 and receives from 7
    (one further back than 0); step 1 (outside itself) sends to and receives
    from 9; step 2 (rank 2 outside, ``d = 4``) sends to 6 (4 ahead, passing 2)
    and receives from 5 (4 behind).

    Raises ValueError unless ``world_size % local_size == 0`` and
    ``local_size > 2`` (use GetDynamicOnePeerSendRecvRanks for smaller machines).
    """
    local_size, machines, self_rank = _check_inner_outer(world_size, local_size, self_rank)
    num_distances = _num_exp2_distances(machines)

    inner_distances = (local_size - 2).bit_length()      # 2**i <= local_size - 2

    def outer_distance(step: int) -> int:
        return 2 ** (step % num_distances)

    def inner_distance(step: int) -> int:
        return 2 ** (step % inner_distances)

    return _inner_outer_schedule(local_size, machines, self_rank, outer_distance, inner_distance)

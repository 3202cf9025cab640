"""Tensor fusion: which of the operations admitted together run as one task.

A neighbor operation that may be fused carries a Fusable (its key: the plan and
dtype; its size). When the loop admits several queued operations at once, the
small ones (at most the inline limit each) with equal keys are grouped, each
group at most BLUEFOG_FUSION_THRESHOLD bytes in all; a group's first operation
(the lead) runs the group's task and the others ride along (a group that waits
long for some members' inputs is split: _stalls.split_group). Before admitting
fusable calls the thread lets a burst of them settle (settle()), so that an
optimizer's launch of every parameter is cut into the same groups on every agent.
"""
import os
import time

_yield = os.sched_yield
_monotonic = time.monotonic
_SETTLE_S = 0.0002


class Fusable:
    """How an op may be fused: ops admitted together with equal ``key`` (and at most
    the fusion threshold of ``nbytes`` in all) run as one task, ``group(eng, lead,
    members)``, where members is [(op, arg)] in submission order. The task sets each
    member's result (or error); the lead's is its return value."""
    __slots__ = ("key", "nbytes", "arg", "group")

    def __init__(self, key, nbytes, arg, group):
        self.key, self.nbytes, self.arg, self.group = key, nbytes, arg, group


def settle(q):
    """Before the thread admits fusable calls: a caller may be in the middle of a
    burst of them (an optimizer launching every parameter's communication). Yield
    while the queue q grows, at most ~0.2 ms, so that the burst runs as one group,
    cut the same way on every agent (a group that crosses a neighbor's boundary
    must be gathered with a copy, _neighbor_tasks._joined). A lone call costs one yield."""
    n, t0 = len(q), _monotonic()
    while True:
        _yield()
        m = len(q)
        if m == n or _monotonic() - t0 > _SETTLE_S:
            return
        n = m


def group(eng, ops, limit, small, stats):
    """Group the small fusable ops of one admission by key (each group at most limit
    bytes, each member at most small); a group's lead gets the group's task (created
    with eng) and its riders. Returns the ops to run, in the order of their first op."""
    if limit == 0:
        return ops
    run, open_groups, members_of = [], {}, {}
    for op in ops:
        f = op.fuse
        if f is None or f.nbytes > small:
            run.append(op)
            continue
        g = open_groups.get(f.key)
        if g is None or g[1] + f.nbytes > limit:
            g = open_groups[f.key] = [[op], 0]
            members_of[op] = g[0]
            run.append(op)
        else:
            g[0].append(op)
        g[1] += f.nbytes
    for lead, members in members_of.items():
        if len(members) > 1:
            stats["fused_groups"] += 1
            stats["fused_ops"] += len(members)
            lead.riders = members[1:]
            lead.task = lead.fuse.group(eng, lead, [(m, m.fuse.arg) for m in members])
    return run

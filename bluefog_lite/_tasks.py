"""What each operation does on the communication thread.

Each task is a generator run by the engine: it queues sends, ``yield``s what it
waits for (``Recv``, ``Turn``, ``Requests``) and returns the result. Inputs were
validated by ops.py; the checks here are the ones only the received data allows
(shapes and dtypes of neighbors, the order of collectives).
"""
import torch

from ._waits import Recv, Requests, Turn
from ._mpi import MPI
from ._stream import MARKED_KINDS, Member, Outgoing, dtype_name, tensor_bytes
from .timeline import _recorder as tl


class _Phase:
    """A timeline sub-phase on the communication thread (stays open across yields),
    on the row of one operation or, for a fused group, of each member. Recorded
    as one complete span when it ends."""
    __slots__ = ("names", "activity", "rec", "begin")

    def __init__(self, names, activity, rec):
        self.names, self.activity, self.rec = names, activity, rec

    def __enter__(self):
        self.begin = tl.now_ns()

    def __exit__(self, *exc):
        self.rec.spans(self.names, self.activity, self.begin)


class _Off:
    """What _phase gives while the timeline is off: nothing to record."""
    __slots__ = ()

    def __enter__(self):
        pass

    def __exit__(self, *exc):
        pass


_OFF = _Off()


def _phase(names, activity):
    """``with _phase(name or [names], activity):`` records the block as a sub-phase."""
    rec = tl.current
    return _OFF if rec is None else _Phase(names, activity, rec)


def _describe(t):
    return f"{dtype_name(t.dtype)}{list(t.shape)}"


def _check_same(op, x, entries, what="shape and dtype"):
    mine = _meta(x)
    expected = op.kind if op.kind in MARKED_KINDS else None
    for e in entries:
        if not e.is_tensor:     # (a tensor is never a refusal: no call per entry)
            _raise_if_refused(op, e)
        if e.sent_by != expected and e.is_tensor:
            _raise_other_kind(op, e)
        if not e.is_tensor or e.meta != mine:
            raise ValueError(f"{op.kind} {op.name!r}: rank {e.src} sent {e.describe()} but this agent "
                             f"has {_describe(x)}; neighbors must pass tensors of the same {what}")


def _raise_if_refused(op, e):
    """e is the note of a neighbor that sends no data for this call (see refused)."""
    if not e.is_tensor and isinstance(e.value, BadInput):
        raise ValueError(f"{op.kind} {op.name!r}: rank {e.src} {e.value.text}")


def _raise_other_kind(op, e):
    """e was sent by another kind of operation than op (see _stream.MARKED_KINDS)."""
    other = e.sent_by or "NEIGHBOR_ALLREDUCE"
    raise ValueError(f"{op.kind} {op.name!r}: rank {e.src} sent its tensor for this name with {other}; "
                     "neighbors must call the same operation for a name")


def _convex(self_weight, terms):
    """True when self_weight and the (positive) term weights sum to 1."""
    total = self_weight
    for _, w in terms:
        if w <= 0:
            return False
        total += w
    return abs(total - 1.0) < 1e-9


def weighted_sum(out, x, self_weight, terms):
    """out = self_weight * x + sum(w * v); integers are summed in float64 and rounded.
    out may be x itself (in place)."""
    floating = out.is_floating_point()
    if floating or out.is_complex():
        terms = [t for t in terms if t[1] != 0]
        if floating and terms and self_weight >= 0 and _convex(self_weight, terms):
            # A convex combination (a mixing matrix's column): a chain of lerps, each
            # the running average of the terms so far. One pass over memory per
            # neighbor where mul + add_ take one more (64 MB, one neighbor: -23%).
            seen = self_weight
            src = out if out.data_ptr() == x.data_ptr() else x
            for v, w in terms:
                seen += w
                if src is out:
                    out.lerp_(v, w / seen)    # out holds the average so far
                else:
                    torch.lerp(src, v, w / seen, out=out)
                    src = out
            return out
        torch.mul(x, self_weight, out=out)
        for v, w in terms:
            out.add_(v, alpha=w)
        return out
    acc = x.to(torch.float64).mul_(self_weight)
    for v, w in terms:
        if w != 0:
            acc.add_(v.to(torch.float64), alpha=w)
    return out.copy_(acc.round_())


def _release(entries):
    for e in entries:
        e.release()


# ---- collective header exchange -------------------------------------------

def exchange_headers(eng, op, payload):
    """All-to-all exchange of a small object among all agents (the negotiation of a
    collective). Raises the same error on every agent when the agents called
    different collectives at this point of their sequence."""
    seq = eng.next_collective(op)
    me = (op.kind, op.name, payload)
    if eng.size == 1:
        return [payload]
    key = ("C", seq)
    others = [r for r in range(eng.size) if r != eng.rank]
    for r in others:
        eng.send_object(r, key, me)
    with _phase(op.name, "NEGOTIATION"):
        entries = yield Recv([(r, key) for r in others])
    views = [None] * eng.size
    views[eng.rank] = me
    for e in entries:
        views[e.src] = e.value
    calls = [(kind, name) for kind, name, _ in views]
    if len(set(calls)) != 1:
        listing = ", ".join(f"rank {r}: {k} {n!r}" for r, (k, n) in enumerate(calls))
        raise RuntimeError(f"collective operations were called in a different order on different "
                           f"agents (collective #{seq}: {listing}); every agent must issue "
                           "collectives in the same order with the same names")
    bad = [(r, v[2].text) for r, v in enumerate(views) if isinstance(v[2], BadInput)]
    if bad:
        listing = "; ".join(f"rank {r}: {text}" for r, text in bad)
        raise ValueError(f"{op.kind} {op.name!r} failed on every agent because of bad input ({listing})")
    return [v[2] for v in views]


class BadInput:
    """What an agent that cannot take part (its arguments to a collective were
    rejected; its machine has no sum) sends instead, so that the others raise too."""
    __slots__ = ("text",)

    def __init__(self, text):
        self.text = text

    def __reduce__(self):
        return BadInput, (self.text,)


def bad_input(eng, op, exc):
    """The collective of an agent whose arguments were rejected with exc: negotiate
    (the others learn why they fail), then raise exc."""
    try:
        yield from exchange_headers(eng, op, BadInput(f"{type(exc).__name__}: {exc}"))
    except ValueError:      # the failure of every agent, this one's included
        pass
    raise exc


def refused(eng, op, exc, tell, forget):
    """The neighbor operation of an agent whose arguments were rejected with exc (see
    ops._refuse): a note to each (rank, key) of tell, the inputs of forget dropped,
    then raise exc."""
    note = BadInput(f"sent nothing for it: the call failed there because of bad input "
                    f"({type(exc).__name__}: {exc})")
    for dst, key in tell:
        eng.send_object(dst, key, note)
    eng.forget_inputs(forget)
    raise exc
    yield    # (a generator)


def allgather_object(eng, op, obj):
    views = yield from exchange_headers(eng, op, obj)
    eng.posted_collective(op)
    return views


def _same_meta_or_raise(op, views, describe):
    if len(set(views)) != 1:
        listing = ", ".join(f"rank {r}: {describe(v)}" for r, v in enumerate(views))
        raise ValueError(f"{op.kind} {op.name!r}: agents passed different tensors ({listing}); "
                         "all agents must pass the same shape and dtype")


def _meta_text(meta):
    return f"{meta[0]}{list(meta[1])}"


def _meta(t):
    return (dtype_name(t.dtype), tuple(t.shape))


# ---- collectives -----------------------------------------------------------

def _collective_call(eng, op, nonempty, post, what):
    """In the global collective order: make the MPI call (none for empty tensors),
    let later collectives go, and wait for it."""
    yield Turn(op.coll_seq)
    with _phase(op.name, "COMMUNICATE"):
        req = post() if nonempty else None
        eng.posted_collective(op)
        if req is not None:
            yield Requests([req], what)


_HALVES = (torch.float16, torch.bfloat16)


def _reduced_in(dtype, average):
    """The dtype allreduce sums in: MPI has no sum of 16-bit floats, so float16 and
    bfloat16 are summed in float32 (and rounded once, at the end); an average of
    narrow integers is summed in int64, where the sum cannot wrap."""
    if dtype in _HALVES:
        return torch.float32
    if average and not (dtype.is_floating_point or dtype.is_complex) and dtype != torch.int64:
        return torch.int64
    return dtype


def allreduce(eng, op, x, average, target):
    """target: the tensor to write into (allreduce_) or None for a new one."""
    views = yield from exchange_headers(eng, op, _meta(x))
    _same_meta_or_raise(op, views, _meta_text)
    dtype = x.dtype
    wide = _reduced_in(dtype, average)
    with _phase(op.name, "ALLOCATE_OUTPUT"):
        if wide != dtype:
            x = out = x.to(wide)
        else:
            out = target if target is not None and target.is_contiguous() else torch.empty_like(x)
    src = MPI.IN_PLACE if out.data_ptr() == x.data_ptr() else x.numpy()
    yield from _collective_call(eng, op, out.numel() > 0,
                                lambda: eng.comm.Iallreduce(src, out.numpy(), MPI.SUM), "MPI_Iallreduce")
    if average:
        with _phase(op.name, "COMPUTE_AVERAGE"):
            if out.is_floating_point() or out.is_complex():
                out.div_(eng.size)
            elif wide != dtype:
                out = torch.div(out, eng.size, rounding_mode="floor")
            else:
                out.copy_(torch.div(out, eng.size, rounding_mode="floor"))
    if target is not None and out is not target:
        target.copy_(out)       # (casts a widened sum back)
        return target
    return out if out.dtype == dtype else out.to(dtype)


def broadcast(eng, op, x, root, target):
    views = yield from exchange_headers(eng, op, (root, _meta(x)))
    _same_meta_or_raise(op, views, lambda v: f"root {v[0]}, {_meta_text(v[1])}")
    with _phase(op.name, "ALLOCATE_OUTPUT"):
        if target is not None and target.is_contiguous():
            out = target
        else:
            out = torch.empty_like(x)
        if eng.rank == root and out.data_ptr() != x.data_ptr():
            out.copy_(x)
    yield from _collective_call(eng, op, out.numel() > 0,
                                lambda: eng.comm.Ibcast([tensor_bytes(out), MPI.BYTE], root=root),
                                "MPI_Ibcast")
    if target is not None and out is not target:
        target.copy_(out)
        return target
    return out


def allgather(eng, op, x):
    views = yield from exchange_headers(eng, op, _meta(x))
    kinds = [(dt, shape[1:]) for dt, shape in views]
    if len(set(kinds)) != 1 or any(len(shape) == 0 for _, shape in views):
        listing = ", ".join(f"rank {r}: {_meta_text(v)}" for r, v in enumerate(views))
        raise ValueError(f"{op.kind} {op.name!r}: tensors must have at least one dimension and agree "
                         f"on dtype and all dimensions but the first ({listing})")
    with _phase(op.name, "ALLOCATE_OUTPUT"):
        firsts = [shape[0] for _, shape in views]
        out = torch.empty((sum(firsts),) + tuple(x.shape[1:]), dtype=x.dtype)
        row = _row_bytes(x)
        counts = [f * row for f in firsts]
        displs = [sum(counts[:r]) for r in range(len(counts))]
    yield from _collective_call(eng, op, out.numel() > 0, lambda: eng.comm.Iallgatherv(
        [tensor_bytes(x), counts[eng.rank], MPI.BYTE], [tensor_bytes(out), (counts, displs), MPI.BYTE]),
        "MPI_Iallgatherv")
    return out


def _row_bytes(x):
    n = x.element_size()
    for d in x.shape[1:]:
        n *= d
    return n


# ---- neighbor operations ---------------------------------------------------

def _topology_check(eng, op, sends, recvs):
    """Every send must have a matching receive and vice versa (collective)."""
    views = yield from exchange_headers(eng, op, (sorted(sends), sorted(recvs)))
    eng.posted_collective(op)
    problems = []
    for i, (s_i, _) in enumerate(views):
        for j in s_i:
            if i not in views[j][1]:
                problems.append(f"rank {i} sends to rank {j} but rank {j} does not receive from it")
    for j, (_, r_j) in enumerate(views):
        for i in r_j:
            if j not in views[i][0]:
                problems.append(f"rank {j} receives from rank {i} but rank {i} does not send to it")
    if problems:
        raise ValueError(f"{op.kind} {op.name!r}: send/receive ranks do not match across agents: "
                         + "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else ""))


def _send_all(eng, op, key, x, send_plan, members=None):
    """Send x to every (dst, scale) of the plan (scaled copies where scale is not None)."""
    same = None
    for dst, scale in send_plan:
        if scale is None:
            if same is None:
                same = Outgoing(x, members)
            eng.send_tensor(op, dst, key, same)
        else:
            eng.send_tensor(op, dst, key, Outgoing(scaled(x, scale), members))
    if members is None:     # a fused group marks each member's row itself
        _mark_sends(op.name, (dst for dst, _ in send_plan))


_SEND_TO = {}    # tuple of destination ranks -> its "SEND_TO r1,r2" activity


def _mark_sends(names, dsts):
    """Timeline: an instant "SEND_TO r1,r2" on the row of each operation in names (a
    name or a list), the ranks the call sent to (bftimeline draws its send -> receive
    arrows from it). dsts may be a generator: nothing is built while the timeline is off."""
    rec = tl.current
    if rec is None:
        return
    dsts = tuple(dsts)
    if not dsts:        # nothing was sent
        return
    activity = _SEND_TO.get(dsts)
    if activity is None:
        if len(_SEND_TO) >= 4096:      # a long run of ever new destination sets
            _SEND_TO.clear()
        activity = _SEND_TO[dsts] = "SEND_TO " + ",".join(map(str, dsts))
    rec.instants(names, activity)


def scaled(x, scale):
    if x.is_floating_point() or x.is_complex():
        return x * scale
    return torch.round(x.to(torch.float64) * scale).to(x.dtype)


def neighbor_allreduce(eng, op, x, self_weight, src_weights, send_plan, recv_from, check):
    """send_plan: [(dst, scale or None)]; src_weights: {src: weight} for src in recv_from."""
    name = op.name
    if check:
        yield from _topology_check(eng, op, [d for d, _ in send_plan], recv_from)
    with _phase(name, "ALLOCATE_OUTPUT"):
        out = torch.empty_like(x)
    with _phase(name, "COMMUNICATE"):
        _send_all(eng, op, name, x, send_plan)
        entries = yield Recv([(src, name) for src in recv_from])
    return average_of(op, x, out, self_weight, src_weights, entries)


def neighbor_allreduce_rest(eng, op, x, out, self_weight, src_weights, keys):
    """The second half of neighbor_allreduce, for a call whose sends are made (_quick.py)."""
    with _phase(op.name, "COMMUNICATE"):
        entries = yield Recv(keys)
    return average_of(op, x, out, self_weight, src_weights, entries)


def average_of(op, x, out, self_weight, src_weights, entries):
    """out = the weighted average of x and the neighbors' entries (released after).
    op: anything with the call's kind and name (for the error message)."""
    try:
        _check_same(op, x, entries)
        with _phase(op.name, "COMPUTE_AVERAGE"):
            return weighted_sum(out, x, self_weight,
                                [(e.value, src_weights.get(e.src, 0.0)) for e in entries])
    finally:
        _release(entries)


def neighbor_allreduce_fused(eng, lead, members, self_weight, src_weights, send_plan, recv_from):
    """Several neighbor_allreduce ops with one plan and dtype, admitted together: their
    inputs are copied into one buffer that goes to each neighbor as one entry, and
    one weighted sum over the buffers gives every result (each a view of the common
    output). Members of a neighbor's group arrive back to back; when the neighbor
    grouped them differently, its parts are gathered into one buffer first."""
    ops = [op for op, _ in members]
    xs = [x for _, x in members]
    names = [op.name for op in ops]
    sizes = [x.numel() for x in xs]
    with _phase(names, "ALLOCATE_OUTPUT"):
        out = torch.empty(sum(sizes), dtype=xs[0].dtype)
    with _phase(names, "MEMCPY_IN_FUSION_BUFFER"):
        flat = torch.cat([x if x.dim() == 1 else x.view(-1) for x in xs])
    shapes = [tuple(x.shape) for x in xs]
    desc = list(zip(names, shapes, sizes))
    with _phase(names, "COMMUNICATE"):
        _send_all(eng, lead, None, flat, send_plan, desc)
        _mark_sends(names, (dst for dst, _ in send_plan))
        entries = yield Recv([(src, name) for src in recv_from for name in names])
    try:
        k = len(names)
        dtype = _meta(xs[0])[0]
        parts = [_joined(entries[j * k:(j + 1) * k], names, dtype, shapes, eng.stream.stats)
                 for j in range(len(recv_from))]
        if any(p is None for p in parts):     # someone sent another shape or dtype
            return _each_alone(ops, xs, entries, self_weight, src_weights, recv_from)
        with _phase(names, "COMPUTE_AVERAGE"):
            weighted_sum(out, flat, self_weight,
                         [(p, src_weights.get(src, 0.0)) for p, src in zip(parts, recv_from)])
        for op, x, part in zip(ops, xs, out.split(sizes)):   # split: ~8x cheaper than slicing
            op.result = part if x.dim() == 1 else part.view(x.shape)
        return lead.result
    finally:
        _release(entries)


def _joined(entries, names, dtype, shapes, stats):
    """One flat tensor of the entries' values in order, or None when a dtype or shape
    differs from ours. When all entries are consecutive members of one slab (the
    neighbor grouped them as we did) it is a view of the slab; otherwise runs of
    consecutive members are taken as regions and concatenated with the rest."""
    first, n = entries[0], len(entries)
    if first.__class__ is Member:
        slab, i = first.slab, first.index
        # names are unique in a slab, so same names at i.. and same slab = consecutive
        if slab.names[i:i + n] == names and all(e.__class__ is Member and e.slab is slab for e in entries):
            if slab.dtype != dtype or slab.shapes[i:i + n] != shapes:
                return None
            stats["fused_joined_views"] += 1
            return slab.region(i, n)
    pieces, i = [], 0
    while i < n:
        e = entries[i]
        if e.__class__ is Member:
            slab, first = e.slab, e.index
            j = i + 1
            while j < n and (f := entries[j]).__class__ is Member and f.slab is slab and f.index == first + j - i:
                j += 1
            if slab.dtype != dtype or slab.shapes[first:first + j - i] != shapes[i:j]:
                return None
            pieces.append(slab.region(first, j - i))
            i = j
        else:
            if not e.is_tensor or e.meta != (dtype, shapes[i]) or e.sent_by is not None:
                return None
            pieces.append(e.value.reshape(-1))
            i += 1
    stats["fused_joined_copies"] += 1
    return torch.cat(pieces)


def _each_alone(ops, xs, entries, self_weight, src_weights, recv_from):
    """The fused group's fallback when some neighbor's data does not match: each
    member is checked and averaged on its own, so only the mismatched ones fail."""
    k = len(ops)
    for i, (op, x) in enumerate(zip(ops, xs)):
        mine = [entries[j * k + i] for j in range(len(recv_from))]
        try:
            _check_same(op, x, mine)
            op.result = weighted_sum(torch.empty_like(x), x, self_weight,
                                     [(e.value, src_weights.get(e.src, 0.0)) for e in mine])
        except ValueError as exc:
            op.error = exc
    if ops[0].error is not None:
        raise ops[0].error
    return ops[0].result


def neighbor_allgather(eng, op, x, send_to, recv_from, check):
    name = op.name
    if check:
        yield from _topology_check(eng, op, send_to, recv_from)
    with _phase(name, "COMMUNICATE"):
        out = Outgoing(x, sent_by=op.kind)
        for dst in send_to:
            eng.send_tensor(op, dst, name, out)
        _mark_sends(name, send_to)
        entries = yield Recv([(src, name) for src in recv_from])
    try:
        trail = (str(x.dtype).replace("torch.", ""), tuple(x.shape[1:]))
        for e in entries:
            _raise_if_refused(op, e)
            if e.is_tensor and e.sent_by != op.kind:
                _raise_other_kind(op, e)
            if not e.is_tensor or (e.meta[0], tuple(e.meta[1][1:])) != trail or not e.meta[1]:
                raise ValueError(f"{op.kind} {op.name!r}: rank {e.src} sent {e.describe()} but this agent "
                                 f"has {_describe(x)}; tensors must agree on dtype and all "
                                 "dimensions but the first")
        with _phase(name, "ALLOCATE_OUTPUT"):
            if not entries:
                return x.new_empty((0,) + tuple(x.shape[1:]))
            return torch.cat([e.value for e in entries], dim=0)
    finally:
        _release(entries)


def pair_gossip(eng, op, x, target, self_weight, pair_weight):
    name = op.name
    with _phase(name, "ALLOCATE_OUTPUT"):
        out = torch.empty_like(x)
    with _phase(name, "COMMUNICATE"):
        eng.send_tensor(op, target, name, Outgoing(x, sent_by=op.kind))
        _mark_sends(name, [target])
        entries = yield Recv([(target, name)])
    try:
        _check_same(op, x, entries)
        with _phase(name, "COMPUTE_AVERAGE"):
            return weighted_sum(out, x, self_weight, [(entries[0].value, pair_weight)])
    finally:
        _release(entries)


def _machine_sum(eng, op, x, local_ranks):
    """The sum of x over the agents of this machine, added in rank order so that
    every local agent gets bitwise the same value: in float32 for 16-bit floats (as
    allreduce adds them), float64 for integers."""
    key = (op.name, "local")
    peers = [r for r in local_ranks if r != eng.rank]
    with _phase(op.name, "ALLOCATE_OUTPUT"):
        total = torch.zeros(x.shape, dtype=torch.float32 if x.dtype in _HALVES else _sum_dtype(x))
    with _phase(op.name, "COMMUNICATE"):
        _send_all(eng, op, key, x, [(r, None) for r in peers])
        local = yield Recv([(r, key) for r in peers])
    try:
        _check_same(op, x, local)
        by_rank = {e.src: e.value for e in local}
        by_rank[eng.rank] = x
        acc_dtype = total.dtype
        with _phase(op.name, "COMPUTE_AVERAGE"):
            for r in sorted(by_rank):
                total.add_(by_rank[r].to(acc_dtype))
        return total
    finally:
        _release(local)


def _sum_dtype(x):
    return x.dtype if x.is_floating_point() or x.is_complex() else torch.float64


def _cast_back(acc, x):
    """acc (a wider sum) in x's dtype: rounded to the nearest integer for integers."""
    if acc.dtype == x.dtype:
        return acc
    return acc.to(x.dtype) if x.is_floating_point() else acc.round_().to(x.dtype)


def local_allreduce(eng, op, x, local_ranks, average):
    total = yield from _machine_sum(eng, op, x, local_ranks)
    if average:
        if x.is_floating_point() or x.is_complex():
            total.div_(len(local_ranks))
        else:
            total = torch.div(total, len(local_ranks), rounding_mode="floor")
    return _cast_back(total, x)


def hierarchical_neighbor_allreduce(eng, op, x, local_ranks, self_weight, src_weights,
                                    send_plan, recv_from, check):
    """Sum within the machine, exchange the machine sums with the same local rank
    of neighbor machines, weight them, divide by the agents per machine."""
    if check:
        yield from _topology_check(eng, op, [d for d, _ in send_plan], recv_from)
    key = (op.name, "machine")
    with _phase(op.name, "ALLOCATE_OUTPUT"):     # the machine sum has one of its own
        acc = torch.empty(x.shape, dtype=_sum_dtype(x))
    try:
        machine_sum = yield from _machine_sum(eng, op, x, local_ranks)
    except ValueError as err:
        # No sum for this machine: the agents waiting for it fail too (instead of
        # waiting forever), and what they send this agent must not feed a later call.
        note = BadInput(f"has no machine sum to send, because on its machine: {err}")
        for dst, _ in send_plan:
            eng.send_object(dst, key, note)
        eng.forget_inputs([(src, key) for src in recv_from])
        raise
    if x.is_floating_point() and machine_sum.dtype != x.dtype:
        # a 16-bit float sum, added in float32, rounded once: machines exchange and
        # average it in the tensor's dtype, as neighbor operations do
        machine_sum = machine_sum.to(x.dtype)
    with _phase(op.name, "COMMUNICATE"):
        _send_all(eng, op, key, machine_sum, send_plan)
        remote = yield Recv([(src, key) for src in recv_from])
    try:
        _check_same(op, machine_sum, remote)
        with _phase(op.name, "COMPUTE_AVERAGE"):
            weighted_sum(acc, machine_sum, self_weight,
                          [(e.value, src_weights.get(e.src, 0.0)) for e in remote])
            acc.div_(len(local_ranks))
            return _cast_back(acc, x)
    finally:
        _release(remote)

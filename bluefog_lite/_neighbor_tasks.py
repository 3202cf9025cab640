"""The tasks of the neighbor operations: neighbor_allreduce (alone or fused with
others of one plan), neighbor_allgather, pair_gossip, and the machine-local ones
(local allreduce, hierarchical_neighbor_allreduce). Each sends its tensor to its
destinations, waits for its sources' (Recv), checks them and averages."""
import torch

from ._devices import copied
from ._stream import Member, Outgoing, dtype_name
from ._tasks import (_HALVES, BadInput, _check_same, _describe, _meta, _phase, _raise_if_refused,
                     _raise_other_kind, _release, exchange_headers, failed_before_sending, rounded_into_range,
                     weighted_sum)
from ._waits import Partial, Recv
from .timeline import _recorder as tl


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


def _send_all(eng, op, key, x, send_plan, tried, members=None):
    """Send x to every (dst, scale) of the plan (a scaled copy per distinct scale that
    is not None: destinations with the same scale share it). Everything is packed
    before the first send; each destination goes into list tried before its send is
    queued (after a failure, the ones not in it are told: see failed_before_sending)."""
    outgoing = {}
    for _, scale in send_plan:
        if scale not in outgoing:
            outgoing[scale] = Outgoing(x if scale is None else scaled(x, scale), members)
    for dst, scale in send_plan:
        tried.append(dst)
        eng.send_tensor(op, dst, key, outgoing[scale])
    if members is None:     # a fused group marks each member's row itself
        mark_sends(op.name, (dst for dst, _ in send_plan))


_SEND_TO = {}    # tuple of destination ranks -> its "SEND_TO r1,r2" activity


def mark_sends(names, dsts):
    """Timeline: an instant "SEND_TO r1,r2" on the row of each operation in names (a
    name or a list), the ranks the call sent to (bftimeline draws its send -> receive
    arrows from it; "SEND_TO " when it sent to nobody). dsts may be a generator:
    nothing is built while the timeline is off."""
    rec = tl.current
    if rec is None:
        return
    dsts = tuple(dsts)
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
    out, entries = yield from _exchange(eng, op, x, lambda tried: _send_all(eng, op, name, x, send_plan, tried),
                                        send_plan, recv_from)
    return average_of(op, x, out, self_weight, src_weights, entries)


def _exchange(eng, op, x, send, send_plan, recv_from):
    """The first half of a neighbor call: wait for the copy of a device input to the
    host, allocate the output (like x), send (send(tried), see _send_all) and receive
    from recv_from. Returns (output, entries). A failure on the way tells the plan's
    destinations not tried and drops what recv_from send for the call
    (failed_before_sending)."""
    name = op.name
    tried = []
    try:
        yield from copied(op)
        with _phase(name, "ALLOCATE_OUTPUT"):
            out = torch.empty_like(x)
        with _phase(name, "COMMUNICATE"):
            send(tried)
            entries = yield Recv([(src, name) for src in recv_from])
    except Exception as exc:
        failed_plan(eng, exc, name, send_plan, recv_from, tried)
        raise
    return out, entries


def failed_plan(eng, exc, name, send_plan, recv_from, tried):
    """failed_before_sending for a call of one name: the plan's destinations not in
    tried are told, recv_from's inputs for it dropped (the general and quick paths)."""
    failed_before_sending(eng, exc, [(d, name) for d, _ in send_plan if d not in tried],
                          [(s, name) for s in recv_from])


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
    tried = []
    try:
        yield from copied(*ops)
        sizes = [x.numel() for x in xs]
        with _phase(names, "ALLOCATE_OUTPUT"):
            out = torch.empty(sum(sizes), dtype=xs[0].dtype)
        with _phase(names, "MEMCPY_IN_FUSION_BUFFER"):
            flat = torch.cat([x if x.dim() == 1 else x.view(-1) for x in xs])
        shapes = [tuple(x.shape) for x in xs]
        desc = list(zip(names, shapes, sizes))
        with _phase(names, "COMMUNICATE"):
            _send_all(eng, lead, None, flat, send_plan, tried, desc)
            mark_sends(names, (dst for dst, _ in send_plan))
            entries = yield Recv([(src, name) for src in recv_from for name in names])
    except Exception as exc:
        # (a note under each member's name: the receivers may group them otherwise)
        failed_before_sending(eng, exc, [(d, n) for d, _ in send_plan if d not in tried for n in names],
                              [(s, n) for s in recv_from for n in names])
        raise
    if entries.__class__ is Partial:      # the group was split (_stalls.py)
        yield from _one_by_one(eng, ops, xs, self_weight, src_weights, recv_from, entries.taken)
        return lead.result
    try:
        k = len(names)
        dtype = _meta(xs[0])[0]
        parts = [_joined(entries[j * k:(j + 1) * k], names, dtype, shapes, eng.stream.stats)
                 for j in range(len(recv_from))]
        if any(p is None for p in parts):     # someone sent another shape or dtype
            return _each_alone(ops, xs, entries, self_weight, src_weights, recv_from)
        with _phase(names, "COMPUTE_AVERAGE"):
            try:
                weighted_sum(out, flat, self_weight,
                             [(p, src_weights.get(src, 0.0)) for p, src in zip(parts, recv_from)])
                fits = True
            except ValueError:      # (integers out of their range: each alone, so that only those fail)
                fits = False
        if not fits:
            return _each_alone(ops, xs, entries, self_weight, src_weights, recv_from)
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
    """The fused group's fallback when some neighbor's data does not match, or an
    integer average does not fit in its dtype: each member is checked and averaged on
    its own, so only the mismatched (out of range) ones fail."""
    k = len(ops)
    for i, (op, x) in enumerate(zip(ops, xs)):
        _alone(op, x, [entries[j * k + i] for j in range(len(recv_from))], self_weight, src_weights)
    if ops[0].error is not None:
        raise ops[0].error
    return ops[0].result


def _alone(op, x, mine, self_weight, src_weights):
    """Member op's result (or error) from its own entries, mine (released by the caller)."""
    try:
        _check_same(op, x, mine)
        op.result = weighted_sum(torch.empty_like(x), x, self_weight,
                                 [(e.value, src_weights.get(e.src, 0.0)) for e in mine])
    except ValueError as exc:
        op.error = exc


def _one_by_one(eng, ops, xs, self_weight, src_weights, recv_from, taken):
    """The rest of a fused group after the stall inspector split it (Engine.split_group):
    each member is averaged alone and completed as soon as all its inputs are in.
    taken: {(src, name): entry} of the members complete so far."""
    left = list(range(len(ops)))
    while True:
        done = [i for i in left if all((src, ops[i].name) in taken for src in recv_from)]
        for i in done:
            mine = [taken.pop((src, ops[i].name)) for src in recv_from]
            try:
                with _phase(ops[i].name, "COMPUTE_AVERAGE"):
                    _alone(ops[i], xs[i], mine, self_weight, src_weights)
            finally:
                _release(mine)
            eng.complete_early(ops[i])
        left = [i for i in left if i not in done]
        if not left:
            return
        names = [ops[i].name for i in left]
        keys = [(src, name) for src in recv_from for name in names]
        with _phase(names, "COMMUNICATE"):
            got = yield Recv(keys)
        taken = got.taken if got.__class__ is Partial else dict(zip(keys, got))


def neighbor_allgather(eng, op, x, send_to, recv_from, check):
    name = op.name
    if check:
        yield from _topology_check(eng, op, send_to, recv_from)
    tried = []
    try:
        yield from copied(op)
        with _phase(name, "COMMUNICATE"):
            out = Outgoing(x, sent_by=op.kind)
            for dst in send_to:
                tried.append(dst)
                eng.send_tensor(op, dst, name, out)
            mark_sends(name, send_to)
            entries = yield Recv([(src, name) for src in recv_from])
    except Exception as exc:
        failed_before_sending(eng, exc, [(d, name) for d in send_to if d not in tried],
                              [(s, name) for s in recv_from])
        raise
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
    def send(tried):
        out = Outgoing(x, sent_by=op.kind)
        tried.append(target)
        eng.send_tensor(op, target, op.name, out)
        mark_sends(op.name, [target])
    out, entries = yield from _exchange(eng, op, x, send, [(target, None)], [target])
    try:
        _check_same(op, x, entries)
        with _phase(op.name, "COMPUTE_AVERAGE"):
            return weighted_sum(out, x, self_weight, [(entries[0].value, pair_weight)])
    finally:
        _release(entries)


def _machine_sum(eng, op, x, local_ranks, weighted):
    """The sum of x over the agents of this machine, added in rank order so that
    every local agent gets bitwise the same value: in float32 for 16-bit floats (as
    allreduce adds them); for integers, in float64 if it is to be weighted
    (hierarchical_neighbor_allreduce), else in int64 (exact; cast back to a narrower
    dtype it wraps around as allreduce's MPI sum does; allreduce refuses uint64)."""
    key = (op.name, "local")
    peers = [r for r in local_ranks if r != eng.rank]
    tried = []
    try:
        yield from copied(op)
        with _phase(op.name, "ALLOCATE_OUTPUT"):
            total = torch.empty(x.shape, dtype=_machine_sum_dtype(x, weighted))
        with _phase(op.name, "COMMUNICATE"):
            _send_all(eng, op, key, x, [(r, None) for r in peers], tried)
            local = yield Recv([(r, key) for r in peers])
    except Exception as exc:
        failed_before_sending(eng, exc, [(r, key) for r in peers if r not in tried], [(r, key) for r in peers])
        raise
    try:
        _check_same(op, x, local)
        by_rank = {e.src: e.value for e in local}
        by_rank[eng.rank] = x
        with _phase(op.name, "COMPUTE_AVERAGE"):
            first, *rest = sorted(by_rank)
            total.copy_(by_rank[first])
            widened = None      # a term cast to the sum's dtype (adding mixed dtypes is slower)
            for r in rest:
                term = by_rank[r]
                if term.dtype != total.dtype:
                    widened = torch.empty_like(total) if widened is None else widened
                    term = widened.copy_(term)
                total.add_(term)
        return total
    finally:
        _release(local)


def _machine_sum_dtype(x, weighted):
    if x.dtype in _HALVES:
        return torch.float32
    if x.is_floating_point() or x.is_complex():
        return x.dtype
    # integers: for a weighted average float64, the dtype it is weighted in (an int64 sum of
    # int64 values near 2**62, or of uint64 ones above 2**63, wraps around); for allreduce's
    # arithmetic int64
    return torch.float64 if weighted else torch.int64


def _weighted_dtype(x):
    """The dtype a neighbor average of x is computed in: float64 for integers."""
    return x.dtype if x.is_floating_point() or x.is_complex() else torch.float64


def local_allreduce(eng, op, x, local_ranks, average):
    """allreduce within the machine, with allreduce's arithmetic: an integer average
    is the floor of the int64 sum's quotient, a sum wraps in x's dtype."""
    total = yield from _machine_sum(eng, op, x, local_ranks, weighted=False)
    if average:
        if x.is_floating_point() or x.is_complex():
            total.div_(len(local_ranks))
        else:
            total.div_(len(local_ranks), rounding_mode="floor")
    return total if total.dtype == x.dtype else total.to(x.dtype)


def machine_keys(name):
    """The keys under which hierarchical_neighbor_allreduce name's agent sends the
    agents of other machines its machine sum and the dtype of its input (machine sums
    go in a dtype of their own, float64 for every integer input, which would not show
    that inputs differ)."""
    return (name, "machine"), (name, "machine dtype")


def hierarchical_neighbor_allreduce(eng, op, x, local_ranks, self_weight, src_weights,
                                    send_plan, recv_from, check):
    """Sum within the machine, exchange the machine sums with the same local rank
    of neighbor machines, weight them, divide by the agents per machine."""
    if check:
        yield from _topology_check(eng, op, [d for d, _ in send_plan], recv_from)
    key, dtype_key = machine_keys(op.name)
    for dst, _ in send_plan:
        eng.send_object(dst, dtype_key, dtype_name(x.dtype))
    tried = []
    machine_stage = False

    def no_machine_sum(why):
        """The agents waiting for this machine sum (those not sent it) fail too, instead
        of waiting forever; what the other machines send this agent must not feed a
        later call."""
        note = BadInput(f"has no machine sum to send{why}")
        for dst, _ in send_plan:
            if dst not in tried:
                eng.send_object(dst, key, note)
        eng.forget_inputs([(src, k) for src in recv_from for k in (key, dtype_key)])

    try:
        machine_sum = yield from _machine_sum(eng, op, x, local_ranks, weighted=True)
        with _phase(op.name, "ALLOCATE_OUTPUT"):     # the machine sum has one of its own
            acc = torch.empty(x.shape, dtype=_weighted_dtype(x))
        averaged = False
        if machine_sum.dtype != acc.dtype:
            # a 16-bit float sum, added in float32: its machine average, rounded once, is
            # what machines exchange and average in the tensor's dtype, as neighbor
            # operations do (the sum itself overflows float16 past 65504 / agents per machine;
            # an integer sum is float64 already, the dtype it is weighted in)
            machine_sum = machine_sum.div_(len(local_ranks)).to(acc.dtype)
            averaged = True
        with _phase(op.name, "COMMUNICATE"):
            _send_all(eng, op, key, machine_sum, send_plan, tried)
            machine_stage = True
            entries = yield Recv([(src, k) for k in (key, dtype_key) for src in recv_from])
    except GeneratorExit:
        # Timed out (closed by the stall inspector, which forgets the inputs it waited
        # for): in the machine stage those were the machine keys; before it, the other
        # machines' sums and dtypes are forgotten here, and the agents waiting for this
        # machine sum are told (else one that timed out waiting would drop this agent's
        # next sum in its place)
        if not machine_stage:
            no_machine_sum(f": its call timed out on its machine (rank {eng.rank})")
        raise
    except Exception as err:
        why = err if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
        no_machine_sum(f", because on its machine: {why}")
        raise
    remote, dtypes = entries[:len(recv_from)], entries[len(recv_from):]
    try:
        mine = dtype_name(x.dtype)
        for e, dt in zip(remote, dtypes):
            if not e.is_tensor:
                _raise_if_refused(op, e)
            if dt.value != mine:
                raise ValueError(f"{op.kind} {op.name!r}: rank {e.src} passed a tensor of dtype {dt.value} "
                                 f"but this agent has {_describe(x)}; neighbors must pass tensors of the same "
                                 "shape and dtype")
        _check_same(op, machine_sum, remote)
        with _phase(op.name, "COMPUTE_AVERAGE"):
            weighted_sum(acc, machine_sum, self_weight,
                          [(e.value, src_weights.get(e.src, 0.0)) for e in remote])
            if not averaged:
                acc.div_(len(local_ranks))
            return acc if acc.dtype == x.dtype else rounded_into_range(acc, x.dtype).to(x.dtype)
    finally:
        _release(entries)

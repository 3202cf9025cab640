"""The parts every operation's task uses (the tasks: _collective_tasks.py,
_neighbor_tasks.py, _win_tasks.py).

A task is a generator run by the engine on the communication thread: it queues
sends, ``yield``s what it waits for (``Recv``, ``Turn``, ``Requests``) and returns
the result. Inputs were validated by ops.py; the checks here are the ones only
the received data allows (shapes and dtypes of neighbors, the order of
collectives). Here: timeline sub-phases, those checks, the weighted average,
and the header exchange of collectives with the notes of agents whose input
was refused.
"""
import math

import torch

from ._stalls import OpTimeout, mpi_collectives_end
from ._stream import MARKED_KINDS, dtype_name
from ._waits import Recv, Turn, Until
from .timeline import _recorder as tl


_HALVES = (torch.float16, torch.bfloat16)   # MPI cannot add them


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
    """True when self_weight and the (positive) term weights sum to 1, but for the
    rounding of their sum: the lerp chain divides by the sum, so weights further
    from 1 would come back normalized."""
    total = self_weight
    for _, w in terms:
        if w <= 0:
            return False
        total += w
    return abs(total - 1.0) <= 4 * (len(terms) + 1) * _EPS64


_EPS64 = 2.0 ** -52


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
            acc.add_(v, alpha=w)     # (v is cast inside the kernel: no float64 copy of it)
    return out.copy_(rounded_into_range(acc, out.dtype))


def rounded_into_range(acc, dtype):
    """acc (float64) rounded in place, for integer dtype: ValueError if a value lies
    outside dtype's range (weights summing to more than 1, or negative ones: cast, it
    would wrap around silently). Values past a bound by float64's rounding of weights
    that sum to 1 (64 units in the last place: at the ends of int64 and uint64, where
    float64 is coarser than the integers) are clamped to the bound (the largest
    float64 within it)."""
    acc.round_()
    if acc.numel():
        info = torch.iinfo(dtype)
        lo, hi = (v.item() for v in torch.aminmax(acc))
        top, bottom = float(info.max), float(info.min)
        # (each end's own: float64 is exact at 0, the bottom of the unsigned dtypes)
        if not (bottom * (1 + 2.0 ** -46) <= lo and hi <= top * (1 + 2.0 ** -46)):     # (a NaN fails it too)
            raise ValueError(f"the weighted average ranges from {lo:.0f} to {hi:.0f}, which does not fit in "
                             f"{dtype_name(dtype)} ({info.min} .. {info.max}): the weights (self_weight and the "
                             "source weights) take it out of the dtype's range; use a wider dtype or weights that "
                             "sum to at most 1")
        if lo < bottom or hi > info.max:    # (top is info.max rounded up for 64 bits: 2**63 for int64)
            acc.clamp_(min=bottom, max=top if top <= info.max else math.nextafter(top, 0.0))
    return acc


def _release(entries):
    for e in entries:
        e.release()


# ---- collective header exchange -------------------------------------------

def exchange_headers(eng, op, payload, mpi_call=False):
    """All-to-all exchange of a small object among all agents (the negotiation of a
    collective; mpi_call: an MPI collective call follows, see Engine.next_collective).
    Raises the same error on every agent when the agents called different collectives
    at this point of their sequence."""
    seq = eng.next_collective(op, mpi_call)
    me = (op.kind, op.name, payload)
    if eng.size == 1:
        return [payload]
    key = ("C", seq)
    others = [r for r in range(eng.size) if r != eng.rank]
    eng.send_to_others(key, me)
    with _phase(op.name, "NEGOTIATION"):
        entries = yield Recv([(r, key) for r in others])
    views = [None] * eng.size
    views[eng.rank] = me
    for e in entries:
        views[e.src] = e.value
    calls = [(kind, name) for kind, name, _ in views]
    agreed = len(set(calls)) == 1 and not any(isinstance(v[2], BadInput) for v in views)
    _refuse_withdrawn(eng, op, seq, others, agreed)
    if len(set(calls)) != 1:
        listing = ", ".join(f"rank {r}: {k} {n!r}" for r, (k, n) in enumerate(calls))
        raise RuntimeError(f"collective operations were called in a different order on different "
                           f"agents (collective #{seq}: {listing}); every agent must issue "
                           "collectives in the same order with the same names (an optimizer wrapper "
                           "starts the allreduce or topology check of a parameter that an agent's pass did not "
                           "use only in step(): run no other collective between such a pass and step())")
    bad = [(r, v[2].text) for r, v in enumerate(views) if isinstance(v[2], BadInput)]
    if bad:
        raise failed_everywhere(f"{op.kind} {op.name!r}", bad)
    return [v[2] for v in views]


def _refuse_withdrawn(eng, op, seq, others, agreed):
    """Raise OpTimeout if some agent timed out in its collective #seq (its word
    ("W", seq): see StallInspector.withdraw): the header this agent got from it is
    of that call, which it gave up (the same one, if this agent is late; if this
    agent never called it, this is its next collective, which must not pair with
    it). Refusing uses up #seq here too: the agents' later collectives stay in
    step. As after a timeout, an MPI collective refused so ends those on this agent
    where the headers agreed (another agent may have agreed on it before the word
    came and made its call; headers that do not agree fail on every agent)."""
    withdrawn = [r for r in others if eng.stream.has(r, ("W", seq))]
    if not withdrawn:
        return
    calls = {}
    for r in withdrawn:
        entry = eng.stream.take(r, ("W", seq))
        calls[r] = entry.value
        entry.release()
    listing = ", ".join(f"rank {r}: {kind} {name!r}" for r, (kind, name) in calls.items())
    why = (f"ranks {withdrawn} timed out in their collective #{seq} ({listing}) and gave it up before this "
           f"agent (rank {eng.rank}) reached its own #{seq}, {op.kind} {op.name!r}")
    if op.collective and agreed:
        eng.collectives_broken = mpi_collectives_end(
            why, "an agent that agreed on it before their word came may have made its MPI call, which would "
            "pair with this agent's next one")
    raise OpTimeout(f"{op.kind} {op.name!r} was refused: {why} (this call would have paired with theirs; "
                    "refused, it keeps the agents' collectives in step)")


def mpi_turn(eng, op):
    """Wait until op, which makes an MPI collective call, may make it: the earlier
    ones of this agent have made theirs (Turn). If some of them failed instead, after
    the agents agreed on them (Engine.skipped_collectives), op waits for the word of
    every other agent that each failed there too: then no agent waits in those calls,
    and op's call pairs with theirs. An agent that made one waits in it for good, and
    op's call would pair with it (mixing their data): op waits too (stall warning)."""
    yield Turn(op.coll_seq)
    skipped = sorted(seq for seq in eng.skipped_collectives if seq < op.coll_seq)
    if skipped:
        others = [r for r in range(eng.size) if r != eng.rank]
        words = [(r, ("S", seq)) for seq in skipped for r in others]
        has = eng.stream.has
        what = ", ".join(eng.skipped_collectives[seq] for seq in skipped)
        with _phase(op.name, "NEGOTIATION"):
            yield Until(lambda: all(has(*w) for w in words),
                        f"the word of every other agent that {what} failed there too (after the agents agreed on "
                        f"{'it' if len(skipped) == 1 else 'them'}, before the MPI call), as on this agent (an agent "
                        "that made that MPI call waits in it for good, and this call would pair with it)")
        for w in words:
            eng.stream.take(*w).release()
        for seq in skipped:
            del eng.skipped_collectives[seq]


def skipped_collective(eng, op, exc):
    """exc raised after the agents agreed on collective op, before its MPI call was
    made on this agent (op.coll_seq is cleared when it is): the later MPI collectives
    wait until every other agent says it failed there too (mpi_turn)."""
    if op.coll_seq is not None and eng.size > 1:
        eng.skipped_collectives[op.coll_seq] = f"{op.kind} {op.name!r}"
        eng.send_to_others(("S", op.coll_seq), None)


def failed_everywhere(what, bad, kind=ValueError, because="bad input"):
    """The error every agent raises when the input of some was bad: bad = [(rank, its error's text)]."""
    listing = "; ".join(f"rank {r}: {text}" for r, text in bad)
    return kind(f"{what} failed on every agent because of {because} ({listing})")


class BadInput:
    """What an agent that cannot take part (its arguments were rejected; its machine
    has no sum; its call failed before sending) sends instead, so that the others
    raise too."""
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
    except OpTimeout as refusal:    # (others gave this collective up: _refuse_withdrawn)
        raise exc from refusal
    raise exc


def refused(eng, op, exc, tell, forget):
    """The neighbor operation of an agent whose arguments were rejected with exc (see
    ops._refuse): a note to each (rank, key) of tell, the inputs of forget dropped,
    then raise exc."""
    _tell(eng, f"because of bad input ({type(exc).__name__}: {exc})", tell, forget)
    raise exc
    yield    # (a generator)


def failed_before_sending(eng, exc, tell, forget):
    """A neighbor operation whose arguments were accepted failed with exc before it
    sent its data (an allocation, the packing of a tensor, a GPU error at the copy
    to the host): each (rank, key) of tell is told instead of waiting for it, and the
    inputs of forget (what its neighbors send for the call) are dropped. The task
    raises exc after."""
    _tell(eng, f"({type(exc).__name__}: {exc})", tell, forget)


def _tell(eng, why, tell, forget):
    note = BadInput(f"sent nothing for it: the call failed there {why}")
    for dst, key in tell:
        eng.send_object(dst, key, note)
    eng.forget_inputs(forget)


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

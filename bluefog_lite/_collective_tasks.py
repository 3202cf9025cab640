"""The tasks of the collectives (all agents, in one order): allreduce, broadcast,
allgather. Each negotiates first (_tasks.exchange_headers: the same call on every
agent, the same shapes), then makes one MPI collective in the global order of
collectives (Turn)."""
import torch

from ._devices import copied
from ._mpi import MPI
from ._neighbor_tasks import mark_sends
from ._stream import copy_into, dtype_name, tensor_bytes
from ._tasks import (_HALVES, _meta, _meta_text, _phase, _same_meta_or_raise, exchange_headers, mpi_turn,
                     skipped_collective)
from ._waits import Requests


def _collective_call(eng, op, nonempty, post, what, sends_to=None):
    """In the global collective order: make the MPI call (none for empty tensors),
    let later collectives go, and wait for it. sends_to: the ranks it sends to, marked
    for the timeline once the call is posted."""
    yield from mpi_turn(eng, op)
    with _phase(op.name, "COMMUNICATE"):
        req = post() if nonempty else None
        if sends_to is not None:
            mark_sends(op.name, sends_to)
        eng.posted_collective(op)
        if req is not None:
            yield Requests([req], what)


def _reduced_in(dtype, average):
    """The dtype allreduce sums in: MPI has no sum of 16-bit floats, so float16 and
    bfloat16 are summed in float32 (and rounded once, at the end); an average of
    narrow integers is summed in int64, where the sum cannot wrap."""
    if dtype in _HALVES:
        return torch.float32
    if average and not (dtype.is_floating_point or dtype.is_complex) and dtype != torch.int64:
        return torch.int64
    return dtype


def _writes_in_place(target):
    """True if MPI can write an in-place form's result straight into target: its
    memory holds its values in order (contiguous, no lazy conjugate or negation:
    into the others the result is copied, which applies their view)."""
    return (target is not None and target.is_contiguous() and not target.is_conj()
            and not target.is_neg())


def allreduce(eng, op, x, average, target):
    """target: the tensor to write into (allreduce_) or None for a new one."""
    dtype = x.dtype
    wide = _reduced_in(dtype, average)
    views = yield from exchange_headers(eng, op, (_meta(x), dtype_name(wide)), mpi_call=True)
    _same_meta_or_raise(op, [v[0] for v in views], _meta_text)
    if len({v[1] for v in views}) != 1:
        # (MPI would be given buffers of different types: it aborted the job)
        listing = ", ".join(f"rank {r}: summed in {v[1]}" for r, v in enumerate(views))
        raise ValueError(f"{op.kind} {op.name!r}: agents passed different average= for {dtype_name(dtype)} "
                         f"tensors ({listing}); an average of narrow integers is summed in int64, a sum in the "
                         "tensor's dtype: pass the same average on every agent")
    try:
        yield from copied(op)
        with _phase(op.name, "ALLOCATE_OUTPUT"):
            if wide != dtype:
                x = out = x.to(wide)
            else:
                out = target if _writes_in_place(target) else torch.empty_like(x)
        src = MPI.IN_PLACE if out.data_ptr() == x.data_ptr() else x.numpy()
        yield from _collective_call(eng, op, out.numel() > 0,
                                    lambda: eng.comm.Iallreduce(src, out.numpy(), MPI.SUM), "MPI_Iallreduce")
    except Exception as exc:
        skipped_collective(eng, op, exc)
        raise
    if average:
        with _phase(op.name, "COMPUTE_AVERAGE"):
            if out.is_floating_point() or out.is_complex():
                out.div_(eng.size)
            else:
                out.div_(eng.size, rounding_mode="floor")
    if target is not None and out is not target:
        copy_into(target, out)      # (casts a widened sum back)
        return target
    return out if out.dtype == dtype else out.to(dtype)


def broadcast(eng, op, x, root, target):
    views = yield from exchange_headers(eng, op, (root, _meta(x)), mpi_call=True)
    _same_meta_or_raise(op, views, lambda v: f"root {v[0]}, {_meta_text(v[1])}")
    try:
        yield from copied(op)
        with _phase(op.name, "ALLOCATE_OUTPUT"):
            if _writes_in_place(target):
                out = target
            else:
                out = torch.empty_like(x)
            if eng.rank == root and out.data_ptr() != x.data_ptr():
                out.copy_(x)
        yield from _collective_call(
            eng, op, out.numel() > 0, lambda: eng.comm.Ibcast([tensor_bytes(out), MPI.BYTE], root=root),
            # timeline: the data goes from the root to every other agent
            "MPI_Ibcast", [r for r in range(eng.size) if r != root] if eng.rank == root else None)
    except Exception as exc:
        skipped_collective(eng, op, exc)
        raise
    if target is not None and out is not target:
        target.copy_(out)
        return target
    return out


def allgather(eng, op, x):
    views = yield from exchange_headers(eng, op, _meta(x), mpi_call=True)
    kinds = [(dt, shape[1:]) for dt, shape in views]
    if len(set(kinds)) != 1 or any(len(shape) == 0 for _, shape in views):
        listing = ", ".join(f"rank {r}: {_meta_text(v)}" for r, v in enumerate(views))
        raise ValueError(f"{op.kind} {op.name!r}: tensors must have at least one dimension and agree "
                         f"on dtype and all dimensions but the first ({listing})")
    try:
        yield from copied(op)
        with _phase(op.name, "ALLOCATE_OUTPUT"):
            firsts = [shape[0] for _, shape in views]
            out = torch.empty((sum(firsts),) + tuple(x.shape[1:]), dtype=x.dtype)
            row = _row_bytes(x)
            counts = [f * row for f in firsts]
            displs = [sum(counts[:r]) for r in range(len(counts))]
        yield from _collective_call(eng, op, out.numel() > 0, lambda: eng.comm.Iallgatherv(
            [tensor_bytes(x), counts[eng.rank], MPI.BYTE], [tensor_bytes(out), (counts, displs), MPI.BYTE]),
            "MPI_Iallgatherv")
    except Exception as exc:
        skipped_collective(eng, op, exc)
        raise
    return out


def _row_bytes(x):
    n = x.element_size()
    for d in x.shape[1:]:
        n *= d
    return n

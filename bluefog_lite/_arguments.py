"""The checks of the public calls' arguments (ops.py, windows.py, parameters.py):
tensors, dtypes, weights, ranks, and a neighbor operation's plan (weights and
peers, from the topology or the arguments). Each raises TypeError or ValueError
with a message naming the argument."""
import math
import numbers

import numpy as np
import torch

from ._devices import to_host
from ._stream import plain

REDUCIBLE = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
             torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8}    # what allreduce sums
# what neighbor operations average (their weighted sums are torch's, in float64 for integers)
_AVERAGEABLE = REDUCIBLE | {getattr(torch, u) for u in ("uint16", "uint32", "uint64") if hasattr(torch, u)}


def _dense(t, what="tensor"):
    """t, if it is a dense tensor with data (on any device)."""
    _dense_on_host(t, what)
    return t


def _dense_on_host(t, what):
    """_dense; True if t's memory is the host's. (Each torch call counts: on the cold
    caches of a loop of large calls one costs several microseconds.)"""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    host = t.is_cpu
    if not host and t.is_meta:
        raise TypeError(f"{what} is on the meta device (it has no data); pass a tensor with values")
    if t.is_nested:
        raise TypeError(f"{what} is a nested tensor; pass a dense tensor")
    if t.layout != torch.strided:
        raise TypeError(f"{what} is sparse; pass a dense tensor (layout {t.layout})")
    if t.is_quantized:
        raise TypeError(f"{what} is quantized ({t.dtype}); pass t.dequantize()")
    if torch._C._functorch.is_functorch_wrapped_tensor(t):
        raise TypeError(f"{what} is a tensor inside a torch.func transform (grad, vmap, jacrev, ...), which has no "
                        "data of its own; communicate outside the transform")
    return host


def _tensor(t, name, what="tensor", later=False):
    """The contiguous CPU tensor that operation name sends: t itself, or a copy if t
    is not contiguous, is a lazily negated/conjugated view, or is on an accelerator
    (see _devices.py; later: the copy is only queued)."""
    return plain(t) if _dense_on_host(t, what) else to_host(t, name, later)


def _flag(value, what):
    """value as a bool; a flag given anything but True or False (or a numpy bool) is
    refused instead of being read by its truth value (average=None would sum)."""
    if value.__class__ is bool:
        return value
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{what} must be True or False, got {value!r}")


def _numeric(t, op):
    dtype = t.dtype
    if dtype == torch.bool:
        raise TypeError(f"{op} cannot average bool tensors; convert to a numeric dtype")
    if dtype not in _AVERAGEABLE:
        raise TypeError(f"{op} cannot average {str(dtype).replace('torch.', '')} tensors; convert to "
                        "float32 (averaging takes floating-point, complex and integer tensors of the "
                        f"dtypes {sorted(str(d).replace('torch.', '') for d in _AVERAGEABLE)})")
    return t


def _item(x):
    """x's value when x is a tensor or array holding one number (a weight or rank
    computed with torch or numpy), else x."""
    if isinstance(x, (torch.Tensor, np.ndarray)) and x.ndim == 0:
        return x.item()
    return x


def _weight(w, what):
    w = _item(w)
    if isinstance(w, bool) or not isinstance(w, numbers.Real):
        raise TypeError(f"{what} must be a real number, got {w!r}")
    try:
        w = float(w)
    except OverflowError:       # (an int or Fraction)
        raise ValueError(f"{what} must be finite, got a number beyond float's range") from None
    if not math.isfinite(w):
        raise ValueError(f"{what} must be finite, got {w}")
    return w


# How argument errors name ranks, weights and self: among agents, or among machines
# (hierarchical ops): (a rank, the source and destination weights' names, self).
_UNITS = {"agent": ("rank", "src_weights", "dst_weights", "this agent itself"),
          "machine": ("machine rank", "src_machine_weights", "dst_machine_weights", "this agent's own machine")}


_SENDER_SCALES = ("the sender scales in the tensor's dtype): weight on the receiving side instead, or use a "
                  "wider dtype")


_UNREDUCED = {torch.uint16, torch.uint32, torch.uint64}    # torch has no min()/max() for these (numpy has)


def _fits_scaled(t, weights, what, why=_SENDER_SCALES):
    """Raise ValueError if integer tensor t times one of weights (rounded to t's dtype,
    as a sender scales it: _neighbor_tasks.scaled) leaves t's range: the values would
    wrap around (int8 100 * 2 arrived as 36). why: the end of the message, after "where
    they would wrap around (": who scales, and what to do."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or not t.numel():
        return
    weights = [w for w in weights if w is not None and not 0.0 <= w <= 1.0]      # (those keep the values in)
    if not weights:
        return
    if t.dtype in _UNREDUCED:
        a = t.cpu().numpy()
        lo, hi = a.min().item(), a.max().item()
    else:
        lo, hi = t.min().item(), t.max().item()
    info = torch.iinfo(t.dtype)
    for w in weights:
        a, b = sorted((round(lo * w), round(hi * w)))
        if a < info.min or b > info.max:
            dtype = str(t.dtype).replace("torch.", "")
            raise ValueError(f"{what}: weight {w} takes this {dtype} tensor's values [{lo}, {hi}] to [{a}, {b}], "
                             f"outside {dtype}'s range [{info.min}, {info.max}], where they would wrap around ({why}")


def _rank(r, what, size, me=None, unit="agent", why_not_me="self is weighted with self_weight"):
    """r as an int rank among size agents (unit "machine": machine ranks among size
    machines), not me (why_not_me: the end of that error)."""
    r = _item(r)
    if isinstance(r, bool) or not isinstance(r, numbers.Integral):
        raise TypeError(f"{what} must be an integer rank, got {r!r}")
    r = int(r)
    rank, _, _, itself = _UNITS[unit]
    if not 0 <= r < size:
        raise ValueError(f"{what} {r} is out of range: there are {size} {unit}s ({rank}s 0..{size - 1})")
    if me is not None and r == me:
        raise ValueError(f"{what} {r} is {itself}; {why_not_me}")
    return r


def _weight_dict(d, what, size, me, unit="agent", lists=True):
    """{rank: weight} from a dict, or (lists) from a list of ranks, weight 1 each."""
    rank_in = f"{_UNITS[unit][0]} in {what}"
    if isinstance(d, dict):
        weights = {_rank(r, rank_in, size, me, unit): _weight(w, f"{what}[{r}]") for r, w in d.items()}
        if len(weights) < len(d):      # keys that are one rank (0-d tensors hash by identity)
            ranks = [_rank(r, rank_in, size, me, unit) for r in d]
            twice = next(r for r in ranks if ranks.count(r) > 1)
            raise ValueError(f"{what} names rank {twice} twice")
        return weights
    if isinstance(d, (list, tuple, set, range)):
        if not lists:
            raise TypeError(f"{what} must be a dict {{rank: weight}}, got {type(d).__name__} (a list of ranks "
                            "would give each weight 1, which is not an average: name the weights)")
        ranks = [_rank(r, rank_in, size, me, unit) for r in d]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{what} lists a rank twice: {sorted(ranks)}")
        return {r: 1.0 for r in ranks}
    raise TypeError(f"{what} must be a dict {{rank: weight}}{' or a list of ranks' if lists else ''}, "
                    f"got {type(d).__name__}")


def _rank_list(ranks, what, size, me):
    return sorted(_ordered_ranks(ranks, what, size, me))


def _ordered_ranks(ranks, what, size, me):
    """The ranks in the order given (it is the order of the result); each at most once."""
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise TypeError(f"{what} must be a list of ranks, got {ranks!r}")
    ranks = [_rank(r, f"rank in {what}", size, me, why_not_me=f"{what} lists other agents only") for r in ranks]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{what} lists a rank twice: {ranks}")
    return ranks


def _reducible(t, kind):
    if t.dtype not in REDUCIBLE:
        raise TypeError(f"{kind.lower()} supports {sorted(str(d) for d in REDUCIBLE)}, got {t.dtype}")
    return t


def _ranks_named(ranks, size, me):
    """(the possible peers that ranks (a dict's keys or a list) names, read leniently,
    sorted; whether it read whole as ranks other than me): what an agent whose
    arguments were rejected can still tell about its peers."""
    if ranks is None:
        return [], False
    try:
        items = [_item(r) for r in (ranks.keys() if isinstance(ranks, dict) else ranks)]   # (0-d tensors: _rank)
        good = [r for r in items if isinstance(r, numbers.Integral) and not isinstance(r, bool)
                and 0 <= r < size and r != me]
        return sorted({int(r) for r in good}), len(good) == len(items)
    except Exception:       # anything: the caller is already reporting bad arguments
        return [], False


def _peers(topo, static, srcs, dsts, size, me):
    """(ranks sent to, ranks received from, whether those are all of them) of a
    neighbor operation whose arguments may be bad: the topology's in static mode,
    else the ranks the arguments name."""
    if static:
        return topo.out_ranks, topo.in_ranks, True
    recvs, srcs_whole = _ranks_named(srcs, size, me)
    sends, dsts_whole = _ranks_named(dsts, size, me)
    return sends, recvs, srcs_whole and dsts_whole


def _overlaps(t):
    """True when elements of t share memory (an expand()ed tensor: stride 0), so
    that a result cannot be written into it."""
    return t.numel() > 1 and any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))


def _writable(t, what):
    """Raise unless an in-place result can be written into tensor t (_overlaps)."""
    if _overlaps(t):
        raise ValueError(f"{what}: the tensor's elements share memory (stride 0, e.g. from expand()), "
                         "so a result cannot be written into it; pass tensor.clone(), or use the "
                         "out-of-place form")


def _static_or_given_weights(self_weight, src_weights, topo, size, me, kind, unit="agent"):
    src = _UNITS[unit][1]
    if (self_weight is None) != (src_weights is None):
        raise ValueError(f"{kind}: self_weight and {src} must be given together (or neither)")
    if self_weight is None:
        return topo.self_weight, dict(topo.src_weights)
    return _weight(self_weight, "self_weight"), _weight_dict(src_weights, src, size, me, unit, lists=False)


def _plan(self_weight, src_weights, dst_weights, topo, size, me, kind, unit="agent"):
    """(self_weight, src_weights, send_plan, recv_from, dynamic) for a neighbor op
    (unit "machine": among machines, with the argument names of hierarchical ops)."""
    if self_weight is None and src_weights is None and dst_weights is None:
        return topo.default_plan
    sw, srcw = _static_or_given_weights(self_weight, src_weights, topo, size, me, kind, unit)
    rank, src, dst, _ = _UNITS[unit]
    if dst_weights is None:
        stray = sorted(set(srcw) - set(topo.in_ranks))
        if stray:
            raise ValueError(f"{kind}: {src} names {rank}s {stray} that are not in-neighbors "
                             f"{topo.in_ranks} of this {unit} in the static topology; pass {dst} "
                             "for a dynamic topology")
        return sw, srcw, [(d, None) for d in topo.out_ranks], list(topo.in_ranks), False
    if self_weight is None:
        raise ValueError(f"{kind}: dynamic mode ({dst} given) needs self_weight and {src} too")
    dstw = _weight_dict(dst_weights, dst, size, me, unit)
    plan = [(d, None if w == 1.0 else w) for d, w in sorted(dstw.items())]
    return sw, srcw, plan, sorted(srcw), True

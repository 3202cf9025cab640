"""Model and optimizer helpers: broadcast or average all parameters, share optimizer state."""
import pickle

import torch

from . import _arguments, _devices, _tasks, ops
from ._runtime import state


def _named(params):
    """params as a list of (name, tensor), names unique; TypeError or ValueError
    naming the entry that is not a tensor or not a (name, tensor) pair."""
    if isinstance(params, dict):
        items = sorted(((str(n), p) for n, p in params.items()), key=lambda item: item[0])
    elif hasattr(params, "named_parameters"):
        items = list(params.named_parameters())
    elif isinstance(params, (torch.Tensor, str, bytes)) or not hasattr(params, "__iter__"):
        raise TypeError("params must be a state_dict(), named_parameters() or a list of tensors, "
                        f"got {type(params).__name__}")
    else:
        items = list(params)
        if items and not isinstance(items[0], (tuple, list)):
            items = [(str(i), p) for i, p in enumerate(items)]
    seen = set()
    for k, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TypeError(f"params entry {k} must be a (name, tensor) pair, got {item!r:.60}")
        name, p = item
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params entry {name!r} must be a tensor, got {type(p).__name__}")
        if str(name) in seen:
            raise ValueError(f"params has two entries named {str(name)!r}; names must be unique")
        seen.add(str(name))
    return [(str(n), p) for n, p in items]


def _difference(call, views):
    """None when every agent listed the same (name, (dtype, shape)), else what differs."""
    first = dict(views[0])
    for r, view in enumerate(views[1:], 1):
        if view == views[0]:
            continue
        mine = dict(view)
        only_r = [n for n in mine if n not in first]
        only_0 = [n for n in first if n not in mine]
        if only_r or only_0:
            parts = [f"rank {r} has {_names(only_r)} that rank 0 has not"] if only_r else []
            parts += [f"rank 0 has {_names(only_0)} that rank {r} has not"] if only_0 else []
            return f"{call}: agents passed different parameters ({'; '.join(parts)})"
        for n, t in mine.items():
            if t != first[n]:
                return (f"{call}: parameter {n!r} is {_tasks._meta_text(first[n])} on rank 0 and "
                        f"{_tasks._meta_text(t)} on rank {r}; all agents must pass the same shapes and dtypes")
        return f"{call}: agents passed the parameters in a different order (rank 0 and rank {r})"
    return None


def _names(names, most=4):
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _agreed(call, params, root_rank=None, keep=lambda p: True):
    """This agent's (name, tensor) pairs of params that keep() accepts, after checking
    with every agent (collective) that all pass the same names, shapes and dtypes and
    the same valid root_rank. Bad input on one agent raises on every agent, before any tensor
    is changed."""
    st = state()

    def validated():
        root = None if root_rank is None else _arguments._rank(root_rank, "root_rank", st.size)
        named = _named(params)
        items = [(n, p) for n, p in named if keep(p)]
        for n, p in items:       # what the in-place operations would refuse, before any runs
            _arguments._dense(p, f"parameter {n!r}")
            _arguments._writable(p, f"{call}: parameter {n!r}")
        items = _distinct(items)
        # every entry compared, kept or not (a dtype kept on one agent only is named as such)
        return items, (root, [(n, _tasks._meta(p)) for n, p in named])
    items, views = ops._negotiate(f"{call}.check", validated)
    wrong = _different_roots(call, [root for root, _ in views]) or _difference(call, [v for _, v in views])
    if wrong is not None:
        raise ValueError(wrong)
    return items


def _different_roots(call, roots):
    """None when every agent named the same root_rank, else what they named."""
    if len(set(roots)) < 2:
        return None
    return (f"{call}: agents passed different root_rank ("
            + ", ".join(f"rank {r}: {root}" for r, root in enumerate(roots)) + "); all must name the same agent")


def _distinct(items):
    """items without the entries that are an earlier entry's memory (a state_dict
    lists tied weights under each name): two in-place operations in flight on one
    tensor would each add the other agents' values into it."""
    seen, out = set(), []
    for n, p in items:
        if p.numel():
            where = (p.untyped_storage().data_ptr(), p.storage_offset(), p.dtype, tuple(p.shape), p.stride())
            if where in seen:
                continue
            seen.add(where)
        out.append((n, p))
    return out


def broadcast_parameters(params, root_rank):
    """Overwrite params (a state_dict, named_parameters() or a list) with root_rank's, in place.
    Every agent must pass the same names, shapes and dtypes (checked first: a difference
    raises on every agent and changes nothing)."""
    items = _agreed("broadcast_parameters", params, root_rank)
    ops._finish_all([ops.broadcast_nonblocking_(p, root_rank, name=f"broadcast.param.{name}")
                     for name, p in items], ops.synchronize)


def allreduce_parameters(params):
    """Replace params by their average over all agents, in place (tensors that cannot be
    averaged, e.g. bool buffers, are left as they are). Checked like broadcast_parameters."""
    items = _agreed("allreduce_parameters", params,
                    keep=lambda p: p.is_floating_point() or p.dtype in _arguments.REDUCIBLE)
    ops._finish_all([ops.allreduce_nonblocking_(p, average=True, name=f"allreduce.param.{name}")
                     for name, p in items], ops.synchronize)


def _host_copies(state):
    """A state_dict with host copies of its device tensors, taken on the caller's thread
    (the communication thread pickles it; load_state_dict moves the state to the
    parameters' devices)."""
    if isinstance(state, torch.Tensor):
        return _devices.to_host(state, "broadcast.optimizer_state") if _devices.on_device(state) else state
    if isinstance(state, dict):
        return {k: _host_copies(v) for k, v in state.items()}
    if type(state) in (list, tuple):
        return type(state)(_host_copies(v) for v in state)
    return state


def broadcast_optimizer_state(optimizer, root_rank):
    """Give every agent root_rank's optimizer state (state and hyper-parameters)."""
    st = state()

    def validated():
        root = _arguments._rank(root_rank, "root_rank", st.size)
        if not all(hasattr(optimizer, a) for a in ("state_dict", "load_state_dict", "param_groups")):
            raise TypeError(f"broadcast_optimizer_state needs an optimizer, got {type(optimizer).__name__}")
        kind = type(getattr(optimizer, "optimizer", optimizer)).__name__   # a wrapper's inner one
        shapes = [[tuple(p.shape) for p in g["params"]] for g in optimizer.param_groups]
        return root, (root, kind, shapes, _pickled_state(optimizer) if st.rank == root else None)
    root, views = ops._negotiate("broadcast.optimizer_state", validated)
    wrong = _different_roots("broadcast_optimizer_state", [r for r, _, _, _ in views])
    if wrong is not None:
        raise ValueError(wrong)
    kinds = {r: kind for r, (_, kind, _, _) in enumerate(views)}
    if len(set(kinds.values())) > 1:
        raise ValueError("broadcast_optimizer_state: agents passed different optimizers ("
                         + ", ".join(f"rank {r}: {k}" for r, k in kinds.items()) + ")")
    _same_parameters([shapes for _, _, shapes, _ in views])
    if st.rank != root:
        optimizer.load_state_dict(pickle.loads(views[root][3]))


def _pickled_state(optimizer):
    """The root's state_dict, pickled once on the caller's thread (the communication
    thread sends the bytes to every agent). TypeError naming the entry that cannot be."""
    sd = _host_copies(optimizer.state_dict())
    try:
        return pickle.dumps(sd, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        where = next((w for w, v in _entries(sd) if not _picklable(v)), "an entry of its state_dict()")
        raise TypeError(f"broadcast_optimizer_state: the root's optimizer state cannot be sent: {where} "
                        f"cannot be pickled ({type(exc).__name__}: {exc})") from None


def _entries(sd):
    """(where, value) of a torch state_dict's hyper-parameters and per-parameter state."""
    try:
        yield from ((f"param_groups[{g}][{k!r}]", v) for g, group in enumerate(sd["param_groups"])
                    for k, v in group.items())
        yield from ((f"state[{i!r}][{k!r}]", v) for i, s in sd["state"].items() for k, v in s.items())
    except (KeyError, TypeError, AttributeError):     # not laid out as torch's
        return


def _picklable(value):
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


def _same_parameters(shapes_of):
    """Raise on every agent unless all optimizers (rank r's parameter shapes per group:
    shapes_of[r]) hold the same parameters: torch's load_state_dict would fail on some
    agents only, or load state of one shape into a parameter of another."""
    if all(shapes == shapes_of[0] for shapes in shapes_of):
        return
    counts = [[len(g) for g in shapes] for shapes in shapes_of]
    if any(c != counts[0] for c in counts):
        what = "parameter groups of " + ", ".join(f"rank {r}: {c} parameters" for r, c in enumerate(counts))
    else:
        g, i = next((g, i) for g, group in enumerate(shapes_of[0]) for i in range(len(group))
                    if len({shapes[g][i] for shapes in shapes_of}) > 1)
        what = (f"parameter {i} of group {g} has shape "
                + ", ".join(f"rank {r}: {list(shapes[g][i])}" for r, shapes in enumerate(shapes_of)))
    raise ValueError(f"broadcast_optimizer_state: the agents' optimizers hold different parameters ({what}); "
                     "every agent must build the same model and optimizer")

"""Model and optimizer helpers: broadcast or average all parameters, share optimizer state."""
import torch

from . import ops
from ._runtime import state


def _named(params):
    if isinstance(params, dict):
        return sorted(params.items())
    if hasattr(params, "named_parameters"):
        return list(params.named_parameters())
    items = list(params)
    if items and not isinstance(items[0], (tuple, list)):
        return [(str(i), p) for i, p in enumerate(items)]
    return items


def broadcast_parameters(params, root_rank):
    """Overwrite params (a state_dict, named_parameters() or a list) with root_rank's, in place."""
    handles = [ops.broadcast_nonblocking_(p, root_rank, name=f"broadcast.param.{name}")
               for name, p in _named(params) if isinstance(p, torch.Tensor)]
    for h in handles:
        ops.synchronize(h)


def allreduce_parameters(params):
    """Replace params by their average over all agents, in place."""
    handles = [ops.allreduce_nonblocking_(p, average=True, name=f"allreduce.param.{name}")
               for name, p in _named(params)
               if isinstance(p, torch.Tensor) and (p.is_floating_point() or p.dtype in ops._REDUCIBLE)]
    for h in handles:
        ops.synchronize(h)


def broadcast_optimizer_state(optimizer, root_rank):
    """Give every agent root_rank's optimizer state (state and hyper-parameters)."""
    st = state()
    root = ops._rank(root_rank, "root_rank", st.size)
    mine = optimizer.state_dict() if st.rank == root else None
    views = ops._allgather_object(mine, name=f"broadcast.optimizer_state.{type(optimizer).__name__}")
    if st.rank != root:
        optimizer.load_state_dict(views[root])

"""Compute spans for the timeline: FORWARD and BACKWARD of each parameter, from hooks.

``timeline_install_hooks(model)`` records, on the row of every parameter (named
as in ``model.named_parameters()``, the names the optimizer wrappers use for its
communication, so that a layer's compute and communication share a row):

- FORWARD: the forward of the module that owns the parameter (forward pre-hook
  to forward hook);
- BACKWARD: from the moment the gradient of that module's output is known (a
  hook on the output tensor) to the moment the parameter's gradient is (a hook
  on the parameter) -- the part of backpropagation that produces it.

Only the public hook API is used and every handle is kept, so ``remove()``
undoes everything. A module's output tensor hook is used instead of
``register_full_backward_hook`` because the latter rejects outputs that a later
layer modifies in place (``ReLU(inplace=True)`` after a BatchNorm).
The hooks cost a few microseconds per module call even while the timeline is
not recording; the optimizer wrappers install them only when a timeline is
configured.
"""
import threading

import torch

from .timeline import _recorder

_ident = threading.get_ident


class TimelineHooks:
    """The handles installed by timeline_install_hooks; ``remove()`` removes them all."""

    def __init__(self, handles):
        self.handles = handles

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __len__(self):
        return len(self.handles)

    def __iter__(self):
        return iter(self.handles)


def timeline_install_hooks(model, prefix=""):
    """Install FORWARD/BACKWARD timeline hooks on model; returns a TimelineHooks.

    prefix is prepended to every parameter name (use the same prefix as the
    names of the parameters' communication)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a string, got {prefix!r}")
    names = {id(p): prefix + n for n, p in model.named_parameters()}
    backward_open = {}   # parameter name -> thread ident of its open BACKWARD span
    handles = []
    for module in model.modules():
        own = [p for _, p in module.named_parameters(recurse=False) if id(p) in names]
        if not own:
            continue
        fwd = tuple(names[id(p)] for p in own)
        bwd = tuple(names[id(p)] for p in own if p.requires_grad)
        handles.append(module.register_forward_pre_hook(_forward_begin(fwd, bwd, backward_open)))
        handles.append(module.register_forward_hook(_forward_end(fwd, bwd, backward_open),
                                                    always_call=True))
    for name, p in model.named_parameters():
        if p.requires_grad:
            handles.append(p.register_hook(_gradient_ready(prefix + name, backward_open)))
    return TimelineHooks(handles)


def _forward_begin(names, grad_names, backward_open):
    def hook(module, args):
        rec = _recorder.current
        if rec is None:
            return
        if backward_open:
            # a parameter that got no gradient last backward: end its span here
            for name in grad_names:
                tid = backward_open.pop(name, None)
                if tid is not None:
                    rec.end(name, tid, "BACKWARD")
        tid = _ident()
        for name in names:
            rec.begin(name, "FORWARD", tid)
    return hook


def _forward_end(names, grad_names, backward_open):
    def begin_backward(grad):
        rec = _recorder.current
        if rec is not None:
            tid = _ident()
            for name in grad_names:
                if name not in backward_open:
                    backward_open[name] = tid
                    rec.begin(name, "BACKWARD", tid)

    def hook(module, args, output):
        rec = _recorder.current
        if rec is None:
            return
        tid = _ident()
        for name in reversed(names):
            rec.end(name, tid, "FORWARD")
        if grad_names:
            out = _first_grad_tensor(output)
            if out is not None:
                out.register_hook(begin_backward)
    return hook


def _gradient_ready(name, backward_open):
    def hook(grad):
        tid = backward_open.pop(name, None)
        rec = _recorder.current
        if tid is not None and rec is not None:
            rec.end(name, tid, "BACKWARD")
    return hook


def _first_grad_tensor(output):
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor) and item.requires_grad:
                return item
    return None

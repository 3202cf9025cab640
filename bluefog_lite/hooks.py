"""Compute spans for the timeline: FORWARD and BACKWARD of each parameter, from hooks.

``timeline_install_hooks(model)`` records, on the row of every parameter (named
as in ``model.named_parameters()``, the names the optimizer wrappers use for
its communication, so that a layer's compute and communication share a row):

- FORWARD: the stretch of the model's forward pass that ends with the forward
  of the module that owns the parameter (its forward hook). It begins at that
  module's forward pre-hook or where the previous stretch of the same forward
  pass ended (the previous module's forward; for the first, the model's forward
  pre-hook), whichever is earlier, so the FORWARD spans of one pass tile it:
  work between modules that own parameters (activations, pooling, reshapes)
  counts as compute of the next one, as it does in BACKWARD (an optimizer
  wrapper's launch of a module's communication does not: see launched()). A module called
  outside the model's forward gets its own forward only. The end hook runs
  before the module's other forward hooks, even ones registered earlier (an
  optimizer wrapper's launch of the parameter's communication), so the ENQUEUE
  span those start follows FORWARD on the row instead of overlapping it (the
  writer would cut FORWARD, recorded once it ends, at that ENQUEUE's begin);
- BACKWARD: the stretch of back-propagation that ends with the parameter's
  gradient (a hook on the parameter). It begins where the previous stretch of
  the same backward pass ended -- when the previous module's gradients were
  ready, or, for the first module, when the backward pass reached the model's
  output -- so the BACKWARD spans of one pass tile it without gaps, each
  module's parameters sharing one begin.

Both are recorded once they end, as one complete event per parameter.
The begin of BACKWARD is known only once the parameter's gradient is, so the
span is recorded then, with a timestamp in the past. Finding it this way costs
one autograd-node hook per forward pass (on the model's output) instead of one
per module, which matters: registering a node hook costs ~15 µs here. If
another span on the same row ended inside that stretch (a communication
launched during forward finishing during backward), the writer cuts
BACKWARD there into adjacent pieces, each nested where it lies (Perfetto drops
slices that overlap partially).

Only the public hook API is used and every handle is kept, so ``remove()``
undoes everything (the per-pass node hook lives and dies with its graph).
Hooks cost a few microseconds per module call even while the timeline is not
recording; the optimizer wrappers install them only while a timeline file is
open (from its start to its stop, or through its step window), and not on a
model that has them already. Hooks installed with this call replace the ones a
wrapper or an earlier call installed on the same model, so a model never records
its spans twice.
"""
import threading
import weakref

import torch

from .timeline import _recorder

_ident = threading.get_ident
_now_ns = _recorder.now_ns


_installed = weakref.WeakKeyDictionary()   # model -> the set of TimelineHooks in place on it
_forwards = set()          # the _Pass of each model whose forward is in progress (while recording)


class TimelineHooks:
    """The handles installed by timeline_install_hooks; ``remove()`` removes them all."""

    def __init__(self, handles, model=None):
        self.handles = handles
        self._model = weakref.ref(model) if model is not None else None
        if model is not None:
            _installed.setdefault(model, set()).add(self)

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []
        model = self._model() if self._model is not None else None
        if model is not None:
            _installed.get(model, set()).discard(self)

    def __len__(self):
        return len(self.handles)

    def __iter__(self):
        return iter(self.handles)


class _Pass:
    """Where the current backward pass stands: the end of its last stretch, and
    the begin shared by each module's parameters; and where the model's forward
    pass stands: the end of its last FORWARD stretch."""
    __slots__ = ("last", "begun", "forward", "thread")

    def __init__(self):
        self.last = 0          # perf_counter_ns; 0 = unknown
        self.begun = {}        # module index -> begin of its BACKWARD in this pass
        self.forward = 0       # in the model's forward: the end of its last FORWARD stretch; else 0
        self.thread = None     # the thread running that forward


def timeline_install_hooks(model, prefix=""):
    """Install FORWARD/BACKWARD timeline hooks on model; returns a TimelineHooks.

    prefix is prepended to every parameter name (use the same prefix as the
    names of the parameters' communication)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a string, got {prefix!r}")
    for hooks in list(_installed.get(model, ())):
        hooks.remove()         # a wrapper's or an earlier call's: these take their place
    return _install(model, prefix)


def install_unless_present(model, prefix=""):
    """An optimizer wrapper's hooks (prefix: of the names its communication runs
    under): installed unless the model has timeline hooks already (then None)."""
    if _installed.get(model):
        return None
    return _install(model, prefix)


def _install(model, prefix):
    keep_out_of_compiled_graphs()
    names = {id(p): prefix + n for n, p in model.named_parameters()}
    owner = {}                 # parameter id -> index of the module that owns it
    state = _Pass()
    handles = []
    for index, module in enumerate(model.modules()):
        own = [p for _, p in module.named_parameters(recurse=False) if id(p) in names]
        if not own:
            continue
        for p in own:
            owner.setdefault(id(p), index)
        fwd = tuple(names[id(p)] for p in own)
        begins = []            # begin times of this module's forward calls in progress
        handles.append(module.register_forward_pre_hook(_ForwardBegin(state, begins)))
        handles.append(module.register_forward_hook(_ForwardEnd(fwd, state, begins), always_call=True,
                                                     prepend=True))
    handles.append(model.register_forward_pre_hook(_PassForwardBegin(state), prepend=True))
    handles.append(model.register_forward_hook(_PassForwardEnd(state), always_call=True))
    for name, p in model.named_parameters():
        if p.requires_grad:
            handles.append(p.register_hook(_GradientReady(prefix + name, owner[id(p)], state)))
    return TimelineHooks(handles, model)


class CopiedInert:
    """Base of hooks that a model carries for this process only: a copy of the model
    (copy.deepcopy) or a pickled one (torch.save(model), then torch.load) gets an
    _Inert hook in their place, which does nothing. (Closures would make the copy
    record, or communicate, for the original; and they cannot be pickled.)"""
    __slots__ = ()

    def __deepcopy__(self, memo):
        return _Inert()

    def __reduce__(self):
        return (_Inert, ())


def keep_out_of_compiled_graphs():
    """Make the forward hooks (CopiedInert's subclasses) run as plain Python under
    torch.compile: Dynamo would otherwise trace into them as part of the compiled
    model (they launch communication and record the timeline; it breaks the graph
    there anyway, and warns once per process where they reach a C function it
    cannot trace). Done once, at the first installation (creating any torch
    optimizer has imported Dynamo already). Costs ~0.3 us per hook call. Hooks whose
    class has a true ``traceable`` only count passes (no communication, no timeline):
    Dynamo traces them, so that a model compiled with fullgraph=True still compiles
    with ATC's."""
    if _kept_out[0]:
        return
    _kept_out[0] = True
    todo = list(CopiedInert.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if "__call__" in vars(cls) and not getattr(cls, "traceable", False):
            cls.__call__ = torch.compiler.disable(cls.__call__)


_kept_out = [False]


class _Inert:
    """What a copied or unpickled model has in place of a CopiedInert hook."""

    def __call__(self, *args):
        return None


class _ForwardBegin(CopiedInert):
    __slots__ = ("state", "begins")

    def __init__(self, state, begins):
        self.state, self.begins = state, begins

    def __call__(self, module, args):
        if _recorder.current is None:
            return
        if self.state.begun:
            self.state.begun.clear()    # a new pass began without the model's own hooks seeing it
        self.begins.append(_now_ns())


class _ForwardEnd(CopiedInert):
    __slots__ = ("names", "state", "begins")

    def __init__(self, names, state, begins):
        self.names, self.state, self.begins = names, state, begins

    def __call__(self, module, args, output):
        begins = self.begins
        if not begins:             # its begin was not recorded
            return
        begin = begins.pop()       # (a module called inside its own forward nests)
        rec = _recorder.current
        if rec is None:
            return
        state = self.state
        if 0 < state.forward < begin:
            begin = state.forward  # the stretch since the previous module's forward
        state.last = end = rec.spans(self.names, "FORWARD", begin)
        if state.forward:
            state.forward = end


class _PassForwardBegin(CopiedInert):
    __slots__ = ("state",)

    def __init__(self, state):
        self.state = state

    def __call__(self, module, args):
        rec = _recorder.current
        if rec is None:
            self.state.forward = 0
        else:
            self.state.forward = _now_ns()
            self.state.thread = me = _ident()
            rec.know_thread(me)     # (a thread whose only events are FORWARD/BACKWARD keeps its name)
            _forwards.add(self.state)


def launched():
    """An optimizer wrapper's forward hook has started a module's communication: the
    next FORWARD stretch of each model forward in progress on this thread begins now
    (the launch is the operation's ENQUEUE_, not compute)."""
    if _forwards and _recorder.current is not None:
        now, me = _now_ns(), _ident()
        for state in tuple(_forwards):      # (other threads add and remove theirs)
            if state.forward and state.thread == me:
                state.forward = now


class _PassForwardEnd(CopiedInert):
    __slots__ = ("state",)

    def __init__(self, state):
        self.state = state

    def _backward_starts(self, grad_outputs):
        self.state.last = _now_ns()
        rec = _recorder.current
        if rec is not None:
            rec.know_thread(_ident())
        self.state.begun.clear()

    def __call__(self, module, args, output):
        self.state.forward = 0
        _forwards.discard(self.state)
        if _recorder.current is None:
            return
        self.state.begun.clear()
        node = _grad_node(output)     # (None if the forward raised)
        if node is not None:
            node.register_prehook(self._backward_starts)


class _GradientReady(CopiedInert):
    __slots__ = ("name", "module_index", "state")

    def __init__(self, name, module_index, state):
        self.name, self.module_index, self.state = name, module_index, state

    def __call__(self, grad):
        rec = _recorder.current
        if rec is None:
            return
        now = _now_ns()
        state = self.state
        begin = state.begun.get(self.module_index)
        if begin is None:
            begin = state.begun[self.module_index] = state.last
        state.last = now
        if begin:
            rec.events.append(("X", (begin, now), self.name, "BACKWARD", _ident()))


def _grad_node(output):
    """The autograd node that produced the model's (first differentiable) output."""
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        output = next((o for o in output if isinstance(o, torch.Tensor) and o.grad_fn is not None), None)
    return output.grad_fn if isinstance(output, torch.Tensor) else None

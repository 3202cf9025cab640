"""Optimizer wrappers: hooks launch nonblocking communication, step() completes it.

- AdaptWithCombine (AWC):  x <- W x - lr * g(x); parameters are sent right after
  each module's forward, so communication overlaps the backward pass.
- AdaptThenCombine (ATC):  x <- W (x - lr * g(x)); each parameter is updated and
  sent the moment its gradient is ready, overlapping the rest of backward.
- GradientAllreduce: Horovod-style averaging of gradients, then the local step.
- WinPut: parameters are put into neighbors' windows after forward; step()
  combines what has arrived (asynchronous, one-sided).

Wrappers are torch.optim.Optimizer objects sharing param_groups and state with
the wrapped optimizer, so schedulers, checkpoints and loops keep working.
"""
import contextlib
import enum
import functools
import numbers
import weakref
import warnings

import torch
from torch.nn.utils import parametrize

from . import ops, windows
from ._mpi import MPI
from ._local_steps import NoStepRule, check_step_function, step_function_for
from ._runtime import state
from .hooks import CopiedInert, install_unless_present, keep_out_of_compiled_graphs, launched
from .timeline import _control as _timeline


class CommunicationType(enum.Enum):
    neighbor_allreduce = "neighbor.allreduce"
    hierarchical_neighbor_allreduce = "hierarchical.neighbor.allreduce"
    allreduce = "allreduce"
    empty = "empty"


def _one_model(model):
    """(the module a wrapper works on, [(each model the user passed, the prefix of its
    parameters' names)]). A list or tuple of modules (Bluefog's other form: a GAN's
    generator and discriminator, say) is held in one torch.nn.ModuleList; each model's
    parameters keep the names its own named_parameters() gives them, as in Bluefog,
    unless two models have a parameter of the same name: then every name gets its
    model's index in front (0.weight, 1.weight), where Bluefog refused the list."""
    if isinstance(model, (list, tuple)):
        if not model or not all(isinstance(m, torch.nn.Module) for m in model):
            raise TypeError("model must be a torch.nn.Module or a non-empty list of them, got "
                            f"[{', '.join(type(m).__name__ for m in model)}]")
        if len({id(m) for m in model}) != len(model):
            raise ValueError("model lists the same module twice")
        names = [n for m in model for n, _ in m.named_parameters()]
        clash = len(set(names)) != len(names)
        return torch.nn.ModuleList(model), [(m, f"{i}." if clash else "") for i, m in enumerate(model)]
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or a list of them, got {type(model).__name__}")
    return model, [(model, "")]


def _parameters_of(models):
    """(name, parameter) of every parameter of the models ((module, prefix) pairs, as
    _one_model gives them), each once."""
    seen, named = set(), []
    for m, prefix in models:
        for n, p in m.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                named.append((prefix + n, p))
    return named


def _named_params(model, every, optimizer):
    """every: _parameters_of the model(s). Returns (those the wrapper trains: they require
    gradients and the optimizer holds them, those that require gradients but that it does
    not hold). The optimizer may hold part of the model, as in Bluefog (a head fine-tuned
    on a backbone): the rest is neither stepped nor communicated."""
    trainable = [(n, p) for n, p in every if p.requires_grad]
    held = _held_ids(optimizer.param_groups)
    named = [(n, p) for n, p in trainable if id(p) in held]
    if trainable and not named:
        raise ValueError(f"none of the model's parameters that require gradients ({[n for n, _ in trainable][:5]}"
                         f"{' ...' if len(trainable) > 5 else ''}) is in the optimizer: the wrapper would have "
                         "nothing to train or communicate (build the optimizer from the model's parameters)")
    if not named:
        raise ValueError(f"the model ({type(model).__name__}) has no parameters that require gradients: "
                         "the wrapper would have nothing to communicate")
    return named, [(n, p) for n, p in trainable if id(p) not in held]


def _held_ids(groups):
    """The ids of the parameters in param_groups groups."""
    return {id(p) for g in groups for p in g["params"]}


# (each reentrant checkpoint runs a backward pass of its own inside backward())
_REENTRANT_HINT = (". A layer used in several torch.utils.checkpoint.checkpoint(..., use_reentrant=True) calls "
                   "gets one gradient per call: checkpoint with use_reentrant=False")


def _forward_owners(model):
    """(module, the parameters its forward uses as its own) for each module of model.
    A parametrization's parameters (weight_norm's original0/1, ...) belong to the module
    they parametrize: the parametrization's own modules run whenever the weight is
    read, also outside a training pass (logging its norm on one agent)."""
    inside = set()
    for module in model.modules():
        if parametrize.is_parametrized(module):
            inside.update(id(m) for m in module.parametrizations.modules())
    for module in model.modules():
        if id(module) not in inside:
            params = list(module.parameters(recurse=False))
            if parametrize.is_parametrized(module):
                params += module.parametrizations.parameters()
            yield module, params


def _training_pass(module):
    """module runs in a training pass: training mode, grad enabled, and not inside a
    torch.func transform (grad, vmap, ...: per-sample gradients, an input gradient),
    whose tensors have no data to communicate and whose passes are not the model's."""
    return module.training and torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active()


_registered = [0]      # parameters and submodules registered on any module since import (torch's hooks)


def _count_registration(module, name, added):
    _registered[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
torch.nn.modules.module.register_module_module_registration_hook(_count_registration)   # (a layer built earlier)


def _rewrites_weight(module):
    """module changes its own weight in its forward (nn.Embedding and EmbeddingBag with
    max_norm renormalize the rows they look up, in place): a second call while the
    weight's communication is in flight would change what is being sent, so step()
    starts it (the weight as the pass left it, as in Bluefog)."""
    return isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.max_norm is not None


class _AfterForward(CopiedInert):
    """A module's forward hook: start the communication of its own parameters, once
    per communicating step. A copy of the module (copy.deepcopy of the model: a
    lookahead or "best so far" model) or a pickled one (torch.save(model)) gets a hook
    that does nothing (CopiedInert): it must not start the original parameters'
    communication."""
    __slots__ = ("wrapper", "own", "launch")

    def __init__(self, wrapper, own, launch):
        self.wrapper, self.own, self.launch = wrapper, own, launch

    def __call__(self, module, inputs, output):
        wrapper = self.wrapper
        if not _training_pass(module) or not wrapper._communicating() or _rewrites_weight(module):
            return
        frozen = wrapper._round_frozen()
        for name, p in self.own:
            if name not in wrapper._launched and name not in frozen:
                self.launch(name, p)
                wrapper._launched.add(name)     # (not if the launch raised: step() starts it then)
        launched()      # (timeline: the next layer's FORWARD begins after the launch)


class _CountForward(CopiedInert):
    """A model's forward pre-hook: count its training passes (grad enabled) since
    the wrapper last communicated (see _ForwardCounted); each begins a new round.
    A pass while all of the model's wrapped parameters are frozen (a GAN generator's
    pass through the frozen discriminator) does not count, as in Bluefog."""
    __slots__ = ("wrapper", "counts", "index", "params")
    traceable = True    # (see hooks.keep_out_of_compiled_graphs)

    def __init__(self, wrapper, counts, index, params):
        self.wrapper, self.counts, self.index, self.params = wrapper, counts, index, params

    def __call__(self, module, inputs):
        if _training_pass(module):
            if any(p.requires_grad for p in self.params):
                self.counts[self.index] += 1
                self.counts[-1] += 1    # passes since the last step
            else:
                self.wrapper._frozen_pass = True    # (a step that saw only such passes counts none)
            self.wrapper._activity()
            self.wrapper._pass_begins()


class _BeginRound(CopiedInert):
    """A model's forward pre-hook (ATC's): a training pass begins (see _pass_begins)."""
    __slots__ = ("wrapper",)
    traceable = True    # (see hooks.keep_out_of_compiled_graphs)

    def __init__(self, wrapper):
        self.wrapper = wrapper

    def __call__(self, module, inputs):
        if _training_pass(module):
            # a new round (synchronize() after a pass that raised, or whose loss the user
            # skipped, ends it: without this it did nothing, as right after step())
            self.wrapper._activity()
            self.wrapper._pass_begins()


class _Holds(CopiedInert):
    """Held by each of a wrapper's parameters (an attribute of the parameter), it holds
    the wrapper, so that a wrapper whose only hooks are gradient hooks (_GradientHook,
    holding it weakly) lives as long as its parameters, as the other wrappers live as
    long as their model: freed by Python's garbage collector at its own time on each
    agent, its hooks would have gone on communicating on some agents and not on
    others. (Not a module hook: torch.jit.script refuses a model with one.) A copied
    or pickled parameter gets an _Inert in its place. remove() takes it off."""
    __slots__ = ("wrapper", "params")
    _ATTRIBUTE = "_bluefog_lite_wrapper"

    def __init__(self, wrapper, params):
        self.wrapper, self.params = wrapper, params
        for p in params:
            setattr(p, self._ATTRIBUTE, self)

    def remove(self):
        for p in self.params:
            if getattr(p, self._ATTRIBUTE, None) is self:
                delattr(p, self._ATTRIBUTE)
        self.params = ()


class _GradientHook:
    """A parameter's gradient hook: wrapper._on_gradient(p, *args) while the wrapper
    lives. Autograd keeps a tensor's hooks where Python's garbage collector does not
    look, so a hook holding the wrapper kept it alive after the program dropped it,
    with its model, gradients and optimizer state (~16 MB per wrapper of a 4 MB model
    built and dropped in a loop). The model holds the wrapper instead (ATC's
    _BeginRound hook, gradient allreduce's parameters' _Holds): a cycle the collector sees."""
    __slots__ = ("wrapper", "args")

    def __init__(self, wrapper, *args):
        self.wrapper, self.args = weakref.ref(wrapper), args

    def __call__(self, p):
        wrapper = self.wrapper()
        if wrapper is not None:
            wrapper._on_gradient(p, *self.args)


class _InOrder:
    """Starts the allreduce of each parameter in one fixed order, the same on every
    agent: collectives are matched across agents by their order, while the hooks
    that make parameters ready fire in an order that can depend on the data (a
    branch of the model taken on some agents only). A ready parameter starts as
    soon as every parameter before it in the order has; finish() (in step())
    starts the rest. Where the hooks fire in the fixed order, nothing waits."""

    def __init__(self, names, start, refuse, param_of, left_out=None):
        """refuse(name) raises: the parameter became ready twice in one round.
        left_out(): the names left out of this round (frozen parameters)."""
        self.order, self.start, self.refuse = names, start, refuse
        self.param_of, self.left_out = param_of, left_out
        self.next = 0           # index in order of the next parameter to start
        self.waiting = {}       # name -> param: ready, waiting for earlier ones

    def _left_out(self, name):
        return self.left_out is not None and name in self.left_out()

    def ready(self, name, p):
        if name in self.waiting:
            self.refuse(name)
        self.waiting[name] = p
        order, waiting = self.order, self.waiting
        while self.next < len(order) and (order[self.next] in waiting or self._left_out(order[self.next])):
            n = order[self.next]
            self.next += 1
            if n in waiting:
                self.start(n, waiting.pop(n))

    def finish(self):
        """Start every parameter not started yet this round, in the order."""
        while self.next < len(self.order):
            n = self.order[self.next]
            self.next += 1
            if not self._left_out(n):
                self.start(n, self.waiting.pop(n) if n in self.waiting else self.param_of[n])

    def started(self):
        """Something of this round was started or is waiting to be."""
        return bool(self.next or self.waiting)

    def new_round(self):
        self.next = 0
        self.waiting.clear()


_wrapper_of = weakref.WeakKeyDictionary()     # model -> weakref to the wrapper whose hooks are on it


def _prefix(value, what):
    """value + "." (what a wrapper puts before its names), or "" for None."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, got {value!r}")
    if not value:
        raise ValueError(f"{what} must be a non-empty string, or None for none")
    return value + "."


def _check_not_wrapped(model):
    """One model, one wrapper (its hooks count the model's passes and start its
    communication): refuse a second while the first's hooks are in place."""
    ref = _wrapper_of.get(model)
    other = ref() if ref is not None else None
    if other is not None and other._hooks:
        raise ValueError(f"the model already has a {type(other).__name__} (one model takes one wrapper); call its "
                         "remove_hooks() before wrapping the model again. To train parts of one model with "
                         "different optimizers, wrap each part as its own model, with its own name_prefix (e.g. "
                         "wrapper(opt_a, model.encoder, name_prefix='enc') and wrapper(opt_b, model.decoder, "
                         "name_prefix='dec'))")


def _check_not_shared(named):
    """A parameter that another wrapper communicates already (this model is part of
    that one's, or shares a layer with it) would be averaged twice per step: refused
    while that wrapper's hooks are in place. named: this wrapper's (name, param)."""
    mine = {id(p): n for n, p in named}
    for ref in list(_wrapper_of.values()):
        other = ref()
        if other is not None and other._hooks:
            shared = [mine[id(p)] for _, p in other._named if id(p) in mine]
            if shared:
                raise ValueError(
                    f"parameters {shared[:5]} of the model are communicated by a {type(other).__name__} already "
                    "(its model contains them or shares them), so they would be averaged twice per step: wrap "
                    "the models in one wrapper (a list of models), or call the other's remove_hooks() first")


class _ReadThrough:
    """An attribute of a wrapper that is the wrapped optimizer's, read and written
    through to it (before the wrapping, while Optimizer.__init__ runs, the wrapper's
    own: kept as _own_<name>)."""

    def __set_name__(self, owner, name):
        self.name, self.own = name, "_own_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        inner = obj.__dict__.get("optimizer")
        return obj.__dict__[self.own] if inner is None else getattr(inner, self.name)

    def __set__(self, obj, value):
        inner = obj.__dict__.get("optimizer")
        if inner is None:
            obj.__dict__[self.own] = value
        else:
            setattr(inner, self.name, value)


_COUNTERS = "bluefog_lite"      # the wrappers' own entry in their state_dict


def _returned(result, state_dict):
    """A state-dict hook's result: a new dict, or None for 'keep state_dict'."""
    return state_dict if result is None else result


class _DistributedOptimizer(torch.optim.Optimizer):
    """Shares param_groups/state with ``optimizer``; subclasses add the communication."""
    _prefix = ""    # of the names a parameter's communication runs under (WinPut: its window's)
    _named_ops = True   # a parameter's operations run under its name (not WinPut's windows)
    counts_own_timeline_steps = True    # its step() counts for the timeline's step window (wrapper_step)
    _REWRAP = "call remove_hooks() and wrap the optimizer again"    # (for parameters it does not know)

    def __init__(self, optimizer, model, num_steps_per_communication=1, name_prefix=None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("torch.optim.LBFGS is not supported by the optimizer wrappers: its step(closure) "
                            "evaluates the model several times per step, and a wrapper's step runs the closure "
                            "once (the communication it launches belongs to that one pass)")
        if isinstance(num_steps_per_communication, bool) \
                or not isinstance(num_steps_per_communication, numbers.Integral) or num_steps_per_communication < 1:
            raise ValueError(f"num_steps_per_communication must be a positive integer, "
                             f"got {num_steps_per_communication!r}")
        state()   # before init() this raises the usual clear error
        model, self._model_names = _one_model(model)
        self._models = [m for m, _ in self._model_names]
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer = optimizer      # from here on, param_groups and state are the optimizer's
        del self.__dict__["_own_param_groups"], self.__dict__["_own_state"]
        self.model = model
        self.num_steps_per_communication = int(num_steps_per_communication)
        every = _parameters_of(self._model_names)
        self._named, self._outside = _named_params(model, every, optimizer)
        self._frozen = [(n, p) for n, p in every if not p.requires_grad]   # (checked per step)
        self._registered_seen = _registered[0]     # parameters registered on modules (anywhere) by then
        if self._named_ops:
            self._prefix = _prefix(name_prefix, "name_prefix")  # (another wrapped model may have the same names)
            self._named = [(self._prefix + n, p) for n, p in self._named]
            for n, _ in self._named:
                ops.check_name(n, "parameter name", "rename the parameter or give the wrapper a name_prefix "
                               "(the wrapper runs its communication under the name)")
        for m in self._models:
            _check_not_wrapped(m)
        _check_not_shared(self._named)
        for m in self._models:
            _wrapper_of[m] = weakref.ref(self)
        self._name_of = {id(p): n for n, p in self._named}
        self._param_of = dict(self._named)
        self._handles = {}          # param name -> (param, handle)
        self._steps = 0
        self._skip_sync = False
        self._rest_started = False  # _launch_rest has run in this step
        self._frozen_in_round = None    # see _round_frozen
        self._launched = set()      # names whose communication a pass started this round
        self._synced = False        # synchronize() ended the round; no step() or new pass since
        self._stepped = False       # step() ended the round; no pass, gradient or zero_grad() since
        self._in_order = None       # an _InOrder where collectives must start in one order
        self._hooks = []
        keep_out_of_compiled_graphs()
        # per-step knobs for dynamic topologies (read when communication launches)
        self.self_weight = None
        self.src_weights = None
        self.dst_weights = None
        self.enable_topo_check = False      # Bluefog's default for its wrappers (the ops' is True)
        self.src_machine_weights = None
        self.dst_machine_weights = None
        self._timeline_hooks = None     # FORWARD/BACKWARD hooks while a timeline is open
        self._timeline_wanted = True    # turn_off_timeline() / turn_on_timeline()
        _timeline.follow(self)
        self.timeline_changed()

    _wait = staticmethod(ops.synchronize)     # waits for one of the wrapper's handles

    def __getstate__(self):
        raise TypeError("distributed optimizers cannot be pickled; save state_dict() instead")

    def __repr__(self):
        return f"{type(self).__name__}({self.optimizer!r})"

    # torch.optim.Optimizer contract, delegated to the wrapped optimizer. param_groups and
    # state are read through to it: its load_state_dict (also broadcast_optimizer_state
    # on it) replaces both, and a scheduler on the wrapper must set the rates it steps with.
    param_groups = _ReadThrough()
    state = _ReadThrough()
    # Bluefog's names of the machine knobs, and the older names of its README's dynamic example
    neighbor_machine_weights = property(lambda self: self.src_machine_weights,
                                        lambda self, v: setattr(self, "src_machine_weights", v))
    send_neighbor_machines = property(lambda self: self.dst_machine_weights,
                                      lambda self, v: setattr(self, "dst_machine_weights", v))
    neighbor_weights = property(lambda self: self.src_weights, lambda self, v: setattr(self, "src_weights", v))
    send_neighbors = property(lambda self: self.dst_weights, lambda self, v: setattr(self, "dst_weights", v))

    # The state is the wrapped optimizer's, plus (under _COUNTERS) where the wrapper
    # stands in its communication period, so that a run resumed from a checkpoint
    # communicates in the same steps (torch.optim ignores the key). Hooks registered on
    # the wrapper run around it as torch.optim.Optimizer runs them (a post or load-pre
    # hook may return a new dict).
    def state_dict(self):
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state_dict = dict(self.optimizer.state_dict(), **{_COUNTERS: self._counters()})
        for hook in self._optimizer_state_dict_post_hooks.values():
            state_dict = _returned(hook(self, state_dict), state_dict)
        return state_dict

    def load_state_dict(self, state_dict):
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = _returned(hook(self, state_dict), state_dict)
        state_dict = dict(state_dict)
        counters = state_dict.pop(_COUNTERS, None)
        # checked before anything is loaded: a refused state changes nothing
        values = None if counters is None else self._checked_counters(counters)
        self.optimizer.load_state_dict(state_dict)
        if values is not None:
            self._set_counters(values)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _counters(self):
        return {"steps": self._steps}

    def _checked_counters(self, counters):
        """The counters of a state dict, checked: {name: value} for _set_counters."""
        steps = counters.get("steps") if isinstance(counters, dict) else None
        if not isinstance(steps, int) or steps < 0:
            raise ValueError(f"load_state_dict: {_COUNTERS!r} must hold the wrapper's step count, got {counters!r}")
        return {"steps": steps}

    def _set_counters(self, values):
        self._steps = values["steps"]

    def _activity(self):
        """Something of a new round happened: a pass, a gradient, zero_grad(), a launch."""
        self._synced = self._stepped = False

    def zero_grad(self, set_to_none=True):
        self._activity()        # a new pass (even one that starts nothing)
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):
        """Added to the wrapped optimizer (as ``base.add_param_group``): its parameters
        are stepped; those of the model are communicated only if they were in it
        when the wrapper was created (a layer added since makes step() raise)."""
        if "optimizer" not in self.__dict__:       # called by Optimizer.__init__ on shared groups
            return super().add_param_group(param_group)
        return self.optimizer.add_param_group(param_group)

    def _communicating(self):
        """Steps k, 2k, ... communicate (k = num_steps_per_communication; 1-based)."""
        return (self._steps + 1) % self.num_steps_per_communication == 0

    @contextlib.contextmanager
    def _named_after(self, name):
        """Around starting an operation named after a parameter: if it is refused because
        another wrapped model has a parameter of that name, say so (both communicate
        under it)."""
        try:
            yield
        except ValueError as exc:
            for ref in list(_wrapper_of.values()):
                other = ref()
                if other is not None and other is not self and other._hooks and name in other._param_of:
                    same = self._prefix and other._prefix == self._prefix
                    fix = (f"give them different name_prefix values (both have {self._prefix[:-1]!r}), or call "
                           "remove_hooks() on the one no longer used" if same else
                           "give one of them a name_prefix (e.g. name_prefix='D')")
                    raise ValueError(f"{exc}. The model of another {type(other).__name__} has a parameter "
                                     f"named {name!r} too, and both wrappers communicate under that name: "
                                     + fix) from None
            raise

    def _check_no_pending(self, name):
        if name in self._handles:
            self._refuse_second_pass(name)

    def _refuse_second_pass(self, name):
        raise RuntimeError(f"parameter {name!r} already has communication in flight; call step() "
                           "(or synchronize()) once per forward/backward pass")

    def _launch_rest(self):
        """Start the communication that the pass did not (parameters it did not use)."""

    def _rest_once(self):
        if not self._rest_started:
            self._rest_started = True
            self._launch_rest()

    def synchronize(self):
        """Start what the pass did not (its unused parameters), wait for all
        communication of this step and install the results. That ends the round:
        whether or not step() follows (a gradient scaler skips it when gradients
        overflow), the next pass starts the next one. Nothing started since the last
        synchronize() (step() after it without skip_synchronize()) or step() (no
        pass, gradient or zero_grad() since): does nothing, as in Bluefog (but for the
        gradient-allreduce wrapper). (It began a round of its own: ATC stepped again
        with the last gradient, and an agent calling it alone, say before saving a
        checkpoint, went a round out of step.)"""
        if not self._stepped:
            self._synchronize()

    def _synchronize(self):
        """synchronize(); step() calls it even with no pass since the last step (that
        step counts as one pass)."""
        if self._synced:
            return
        self._rest_once()
        self._all_handles(lambda p, handle: self._apply(p, self._wait(handle)))
        self._end_round()

    def _end_round(self):
        """After this round's communication: the next pass starts a new one, one step
        further in the communication period (also when step() does not follow)."""
        self._round_over()
        self._synced = True
        self._advance_period()

    def _round_over(self):
        """This round's communication is done (or dropped): the next pass begins another."""
        self._rest_started = False
        self._frozen_in_round = None
        self._launched = set()
        if self._in_order is not None:
            self._in_order.new_round()

    def _not_started(self):
        """(name, param) of each parameter this round has not started and does not leave
        out (frozen): what synchronize() starts (those a pass did not use)."""
        frozen = self._round_frozen()
        return [(n, p) for n, p in self._named if n not in self._handles and n not in self._launched
                and n not in frozen]

    def _round_begun(self):
        """This round's communication has started (or waits in the fixed order)."""
        return bool(self._handles or (self._in_order is not None and self._in_order.started()))

    def _round_frozen(self):
        """The parameters frozen since the wrapper was created (requires_grad_(False)),
        as they were when the last training pass before this round's communication
        began (_pass_begins): AWC, ATC and WinPut leave them out of the round. Kept from
        there, so that every agent leaves out the same ones whenever in the step they
        are frozen or unfrozen."""
        if self._frozen_in_round is None:
            self._frozen_in_round = frozenset(n for n, p in self._named if not p.requires_grad)
        return self._frozen_in_round

    def _pass_begins(self):
        """A training pass of the model begins (its forward pre-hook). A pass that starts
        no communication (another model's pass through this one while it is frozen, as
        a GAN's generator step does) does not settle what is frozen for the round."""
        if not self._round_begun():
            self._frozen_in_round = None
        self._round_frozen()

    def _advance_period(self):
        """Once per round: one step more (num_steps_per_communication counts them)."""
        self._steps += 1

    def _drop_round(self):
        """Finish this round's communication and drop its results (a pass not followed
        by step()). Collectives started in the fixed order are all started first, so
        that every agent makes the same calls whichever parameters its pass used."""
        try:
            if self._in_order is not None and self._in_order.started():
                self._in_order.finish()
            self._all_handles(lambda p, handle: self._wait(handle))
        finally:
            self._round_over()

    def _started(self, name, p, handle):
        """Keep a handle of this round (something new to synchronize)."""
        self._handles[name] = (p, handle)
        self._activity()

    def _all_handles(self, finish):
        """finish(p, handle) for every handle of this step (ops._finish_all); after an
        error the next step starts afresh."""
        pairs = list(self._handles.values())
        self._handles.clear()
        try:
            ops._finish_all(pairs, lambda pair: finish(*pair))
        except Exception:
            self._round_over()
            raise

    def _step_synchronize(self):
        """step()'s synchronize; inside skip_synchronize() the caller has synchronized
        already (which started the rest), or must: only the rest is started then."""
        if not self._skip_sync:
            self._synchronize()
        elif not self._synced:
            self._rest_once()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside, step() does not synchronize (the caller did, with synchronize())."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def _apply(self, p, result):
        with torch.no_grad():
            p.copy_(result)

    def _refusal(self):
        """(message, parameters) of a step that must not step parameters the wrapper
        does not communicate but that have a gradient, or (None, ()). step() leaves those
        parameters alone (their gradients hidden from the wrapped optimizer), steps the
        others as usual, so that agents that refuse and agents that do not still agree on
        them, and raises the message once its communication is done. (Refused after the
        update, the wrapped optimizer had moved them on each agent's own gradient, and
        wrapping again went on from copies that no longer agreed.)"""
        thawed = [(n, p) for n, p in self._frozen if p.requires_grad and p.grad is not None]
        joined = [(n, p) for n, p in self._outside if p.grad is not None]
        if thawed or joined:        # (those the optimizer does not hold are not stepped: no harm)
            held = _held_ids(self.optimizer.param_groups)     # (as the groups are now: not cached)
            thawed = [(n, p) for n, p in thawed if id(p) in held]
            joined = [(n, p) for n, p in joined if id(p) in held]
        if thawed:
            return (f"parameters {[n for n, _ in thawed][:5]} of the model did not require gradients when "
                    f"{type(self).__name__} was created and now have them: the wrapper does not communicate them, "
                    f"so the agents' copies would drift apart (this step did not step them). After unfreezing, "
                    f"{self._REWRAP}", [p for _, p in thawed])
        if joined:
            return (f"parameters {[n for n, _ in joined][:5]} of the model were not in the optimizer when "
                    f"{type(self).__name__} was created and now are (add_param_group): the wrapper does not "
                    f"communicate them, so the agents' copies would drift apart (this step did not step them). "
                    f"{self._REWRAP[0].upper()}{self._REWRAP[1:]}", [p for _, p in joined])
        if _registered[0] != self._registered_seen:
            return self._new_parameters()
        return None, ()

    @staticmethod
    @contextlib.contextmanager
    def _hidden(params):
        """Inside, params have no gradient (the wrapped optimizer skips them)."""
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            yield
        finally:
            for p, g in zip(params, grads):
                p.grad = g

    def _finish_step(self, refusal=None):
        self._round_over()
        if not self._synced:        # (no synchronize() ended this step's round)
            self._advance_period()
        self._synced, self._stepped = False, True
        _timeline.wrapper_step(self)
        if refusal is not None:
            raise RuntimeError(refusal)

    def _new_parameters(self):
        """A parameter or module was registered somewhere since the last look: the refusal
        (as _refusal) if the model has one the wrapper does not know that has a gradient (a
        layer added or replaced after wrapping: never communicated, silently)."""
        known = {id(p) for _, p in self._named + self._frozen + self._outside}
        new = [(n, p) for n, p in _parameters_of(self._model_names) if id(p) not in known]
        used = [(n, p) for n, p in new if p.grad is not None]
        if used:
            return (f"parameters {[n for n, _ in used][:5]} were added to the model after {type(self).__name__} "
                    "was created: the wrapper does not communicate them, so the agents' copies would drift apart "
                    f"(this step did not step them). {self._REWRAP[0].upper()}{self._REWRAP[1:]} (with the new "
                    "parameters in its groups)", [p for _, p in used])
        if not new:     # (else look again: they may get gradients later)
            self._registered_seen = _registered[0]
        return None, ()

    @staticmethod
    def _run_closure(closure):
        """step(closure): the closure's forward/backward come first, so that the
        communication they launch completes in this step (grad enabled, as torch does)."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _launch_after_forward(self, model, launch):
        """launch(name, p) for each module's own parameters right after its forward,
        once per communicating step (even when forward runs several times); after the
        forward of each model (self._models), for those whose module's forward did not
        run (nn.MultiheadAttention reads its out_proj's weight without calling it; a
        module unused in this pass), so that they go before backward rather than in
        step() (where WinPut combined them before the neighbors' puts could come)."""
        rest = {}
        for module, params in _forward_owners(model):
            own = [(self._name_of[id(p)], p) for p in params if id(p) in self._name_of]
            if own:
                self._hooks.append(module.register_forward_hook(_AfterForward(self, own, launch)))
                if not _rewrites_weight(module):
                    rest.update((id(p), (n, p)) for n, p in own)
        for m in self._models:
            after = [rest[id(p)] for p in m.parameters() if id(p) in rest]
            if after:
                self._hooks.append(m.register_forward_hook(_AfterForward(self, after, launch)))

    def timeline_changed(self):
        """Called when a timeline file opens or closes on this agent (and at creation):
        the model's compute spans are recorded while one is open, by hooks this
        wrapper installs unless the model has them already (hooks.py)."""
        if _timeline.configured() and self._hooks is not None and self._timeline_wanted:
            if not any(h.handles for h in self._timeline_hooks or ()):
                self._timeline_hooks = [h for h in (install_unless_present(m, prefix)
                                                    for m, prefix in self._hooked_models()) if h is not None] or None
        elif self._timeline_hooks is not None:
            for h in self._timeline_hooks:
                h.remove()
            self._timeline_hooks = None

    def turn_on_timeline(self):
        """Record the model's FORWARD/BACKWARD spans whenever a timeline is open (the
        default; Bluefog's switch)."""
        self._timeline_wanted = True
        self.timeline_changed()

    def turn_off_timeline(self):
        """Do not record the model's FORWARD/BACKWARD spans (the communication's
        phases are still recorded while a timeline is open)."""
        self._timeline_wanted = False
        self.timeline_changed()

    def _hooked_models(self):
        """(module, prefix of its parameters' names) that get the timeline's hooks: each
        model the user passed (a ModuleList is never called: its models are)."""
        return [(m, self._prefix + prefix) for m, prefix in self._model_names]

    def remove_hooks(self):
        """Remove every hook this wrapper installed (for good: a timeline opened later
        does not install compute hooks either). Communication still in flight (a pass
        not followed by step(), e.g. after an error) is waited for and its results
        dropped, so that its names are free for a new wrapper."""
        try:
            self._drop_round()
        finally:
            for h in self._hooks or ():
                h.remove()
            self._hooks = None
            self.timeline_changed()


def _check_communication_type(value):
    if not isinstance(value, CommunicationType):
        raise TypeError(f"communication_type must be a bf.CommunicationType, got {value!r}")


class _ParameterCommunicator(_DistributedOptimizer):
    """Common part of AWC and ATC: communicate a parameter with the chosen op."""

    def __init__(self, optimizer, model, communication_type, num_steps_per_communication, backward=False,
                 name_prefix=None):
        """backward: parameters become ready in backward order (else forward order)."""
        _check_communication_type(communication_type)
        super().__init__(optimizer, model, num_steps_per_communication, name_prefix)
        self._next_type = None      # set during a round: the communication_type of the next
        names = [n for n, _ in self._named]
        if not backward:    # the weights that start in step() (_rewrites_weight) last: they hold none back
            late = {self._name_of[id(p)] for m, params in _forward_owners(self.model) if _rewrites_weight(m)
                    for p in params if id(p) in self._name_of}
            names = [n for n in names if n not in late] + [n for n in names if n in late]
        # (used in a round whose collectives must start in one order: see _set_round)
        self._ordered = _InOrder(names[::-1] if backward else names, self._start, self._refuse_second_pass,
                                 self._param_of, self._round_frozen)
        self._round_set = False     # _set_round has run in this round
        self._refused = None        # the error of a round refused before it sent anything
        self.communication_type = communication_type

    @property
    def communication_type(self):
        return self._communication_type if self._next_type is None else self._next_type

    @communication_type.setter
    def communication_type(self, value):
        """Bluefog's setter: set between steps, the next pass uses it; set during a
        step (after its forward pass), the next round does, so that this round's
        communication stays the same on every agent."""
        _check_communication_type(value)
        self._next_type = value
        if not self._round_begun():
            self._switch_type()

    def _switch_type(self):
        value, self._next_type = self._next_type, None
        self._communication_type = value
        self._launched = set()      # (nothing was started: with "empty", a pass marks its parameters)
        self._in_order, self._round_set, self._refused = None, False, None     # (decided again: _set_round)

    def _round_over(self):
        super()._round_over()
        self._in_order, self._round_set, self._refused = None, False, None
        if self._next_type is not None:
            self._switch_type()

    def _set_round(self):
        """At the round's first launch, from the step's knobs (the same on every agent):
        collectives start in the fixed order (_InOrder): allreduces, and a dynamic step's
        topology check (enable_topo_check), both matched across agents by their order.
        Knobs whose source or destination ranks cannot be read refuse the round before
        anything is sent (see ops.refusal_without_peers): set so on every agent, the
        step fails everywhere and the next one starts afresh."""
        if self._round_set:
            return
        self._round_set = True
        ct = self._communication_type
        if ct is CommunicationType.allreduce:
            self._in_order = self._ordered
        elif ct is not CommunicationType.empty:
            hierarchical = ct is CommunicationType.hierarchical_neighbor_allreduce
            src, dst = ((self.src_machine_weights, self.dst_machine_weights) if hierarchical else
                        (self.src_weights, self.dst_weights))
            self._refused = ops.refusal_without_peers(self.self_weight, src, dst, self.enable_topo_check,
                                                        hierarchical)
            if dst is not None and self.enable_topo_check:
                self._in_order = self._ordered

    def _launch(self, name, p):
        self._activity()        # a new round (even while the fixed order holds it back)
        self._set_round()
        if self._refused is not None:
            return
        if self._in_order is not None:
            self._in_order.ready(name, p)
        else:
            self._start(name, p)

    def _start(self, name, p):
        self._check_no_pending(name)
        ct = self._communication_type
        x = p.detach()
        if ct is CommunicationType.empty:
            return
        with self._named_after(name):
            if ct is CommunicationType.neighbor_allreduce:
                h = ops.neighbor_allreduce_nonblocking(
                    x, self_weight=self.self_weight, src_weights=self.src_weights,
                    dst_weights=self.dst_weights, enable_topo_check=self.enable_topo_check, name=name)
            elif ct is CommunicationType.hierarchical_neighbor_allreduce:
                h = ops.hierarchical_neighbor_allreduce_nonblocking(
                    x, self_weight=self.self_weight, src_machine_weights=self.src_machine_weights,
                    dst_machine_weights=self.dst_machine_weights, enable_topo_check=self.enable_topo_check,
                    name=name)
            else:
                h = ops.allreduce_nonblocking(x, average=True, name=name)
        self._started(name, p, h)

    def _launch_rest(self):
        """Communicate parameters whose hook did not fire (unused in this pass), in a fixed order."""
        if not self._communicating():
            return
        self._set_round()
        if self._refused is not None:
            refused = self._refused
            self._round_over()      # (nothing was sent)
            raise refused
        if self._in_order is not None:
            self._in_order.finish()
        else:
            for name, p in self._not_started():
                self._start(name, p)
        self._launched = set()


class _ForwardCounted:
    """AWC and WinPut count forward passes, as Bluefog does: with
    num_steps_per_communication=k they communicate in the step that follows every
    k-th training pass of the model (k passes per step, i.e. gradient accumulation:
    every step; one pass per step: steps k, 2k, ...). The passes are counted where
    the model itself is called (a forward pre-hook); with a list of models, those
    of the one called most (a GAN's generator and discriminator, each called once
    per step: one pass per step). k=1: every step."""

    _frozen_pass = False    # a pass with every wrapped parameter frozen since the last step

    def _count_forwards(self):
        self._forwards = [0] * (len(self._models) + 1)    # per model; the last: passes since the last step
        for i, m in enumerate(self._models):
            params = [p for p in m.parameters() if id(p) in self._name_of]
            self._hooks.append(m.register_forward_pre_hook(_CountForward(self, self._forwards, i, params)))

    def _communicating(self):
        """A step that sees no pass of the model (its submodules are called, not the
        model) counts as one, so that it still communicates every k steps; one that
        saw only passes with the model frozen counts none."""
        passes = max(self._forwards[:-1]) + (not self._forwards[-1] and not self._frozen_pass)
        return self.num_steps_per_communication == 1 or passes >= self.num_steps_per_communication

    def _counters(self):
        return dict(super()._counters(), forwards=list(self._forwards))

    def _checked_counters(self, counters):
        values = super()._checked_counters(counters)
        forwards = counters.get("forwards")
        if (isinstance(forwards, list) and len(forwards) == len(self._forwards)
                and all(isinstance(c, int) and c >= 0 for c in forwards)):
            values["forwards"] = forwards
        elif forwards is not None:
            raise ValueError(f"load_state_dict: {_COUNTERS!r} holds forward counts {forwards!r} for "
                             f"{len(forwards) - 1 if isinstance(forwards, list) else '?'} model(s); this wrapper "
                             f"has {len(self._forwards) - 1}")
        return values

    def _set_counters(self, values):
        super()._set_counters(values)
        if "forwards" in values:
            self._forwards[:] = values["forwards"]      # (the hooks hold this list)

    def _advance_period(self):
        communicated = self._communicating()
        super()._advance_period()
        self._count_step(communicated)

    _warned_extra_passes = False

    def _count_step(self, communicated):
        """At the end of each round."""
        if communicated:
            k = self.num_steps_per_communication
            if k > 1 and max(self._forwards[:-1]) > k and not self._warned_extra_passes:
                self._warned_extra_passes = True
                warnings.warn(
                    f"{type(self).__name__}: {max(self._forwards[:-1])} training passes of the model since its "
                    f"last communication, with num_steps_per_communication={k}: the passes beyond {k} in this "
                    "step are not carried over, so the agents communicate less often than every "
                    f"{k} passes. Make num_steps_per_communication a multiple of the passes per step "
                    "(Bluefog warns likewise)", stacklevel=4)
            self._forwards[:] = [0] * len(self._forwards)
        else:
            if not self._forwards[-1] and not self._frozen_pass:
                self._forwards[:-1] = [c + 1 for c in self._forwards[:-1]]
            self._forwards[-1] = 0
        self._frozen_pass = False


class DistributedAdaptWithCombineOptimizer(_ForwardCounted, _ParameterCommunicator):
    """x <- W x - lr * grad f(x): each module's parameters start their
    communication right after its forward, overlapping the backward pass."""

    def __init__(self, optimizer, model, communication_type=CommunicationType.neighbor_allreduce,
                 num_steps_per_communication=1, name_prefix=None):
        super().__init__(optimizer, model, communication_type, num_steps_per_communication, name_prefix=name_prefix)
        self._count_forwards()
        self._launch_after_forward(self.model, self._launch)

    def step(self, closure=None):
        loss = self._run_closure(closure)
        refusal, refused = self._refusal()
        self._step_synchronize()
        with self._hidden(refused):
            self.optimizer.step()
        self._finish_step(refusal)
        return loss


def _no_step_rule(exc):
    """A stand-in per-parameter rule that raises exc (the optimizer has none) when used."""
    def step(p, grad, group, state):
        raise NoStepRule(f"{exc} (or, after wrapping, with the wrapper's register_step_function(f))")
    return step


def _own_version(g):
    """g's version counter, to see in-place changes of a gradient; None for a view into a
    larger buffer (parameters joined by torch.cat or stack in the model, or gradients
    kept in one flat buffer), which shares its version with the other views, changed
    without it: only its replacement is seen."""
    if g.layout is not torch.strided:      # (sparse: no storage of its own to compare)
        return g._version
    return None if g.untyped_storage().nbytes() != g.numel() * g.element_size() else g._version


def _aliased(grad, grads):
    """True if another of grads is in grad's memory (torch.stack's backward can give two
    parameters one gradient buffer, each a whole tensor of it): they share a version
    counter, so a change of either (copying its average in, a rule's in-place weight
    decay) changes the other's version."""
    if grad.layout is not torch.strided:
        return False
    ptr = grad.untyped_storage().data_ptr()
    return any(g is not None and g is not grad and g.layout is torch.strided
               and g.untyped_storage().data_ptr() == ptr for g in grads)


class DistributedAdaptThenCombineOptimizer(_ParameterCommunicator):
    """x <- W (x - lr * grad f(x)): each parameter is updated in its gradient hook
    and its communication starts at once, overlapping the rest of backward."""

    def __init__(self, optimizer, model, communication_type=CommunicationType.neighbor_allreduce,
                 num_steps_per_communication=1, name_prefix=None):
        super().__init__(optimizer, model, communication_type, num_steps_per_communication, backward=True,
                         name_prefix=name_prefix)
        try:
            self._local_step = step_function_for(optimizer)
        except NoStepRule as exc:      # no rule for it: Bluefog's opt.register_step_function(f) may come next
            self._local_step = _no_step_rule(exc)
        self._updated = set()
        self._grads_used = {}    # name -> (parameter, gradient, its version) its hook stepped with (_own_version)
        self._stepped_with = {}  # name -> (weak reference to the gradient its last local step used, its version)
        self._fresh_only = False     # (in synchronize(): see there)
        # by index: load_state_dict (broadcast_optimizer_state) replaces the group dicts
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._group_of = {name: group_of[id(p)] for name, p in self._named}
        for name, p in self._named:
            self._hooks.append(p.register_post_accumulate_grad_hook(_GradientHook(self, name, self._group_of[name])))
        for m in self._models:
            self._hooks.append(m.register_forward_pre_hook(_BeginRound(self)))

    def _extra(self):
        """The optimizer's parameters outside the model, (param, group index): step()
        steps them locally, as the wrapped optimizer would (no communication, as in
        AWC). Found at each step, as the groups are then (add_param_group, a group's
        params replaced or changed in place)."""
        return [(p, i) for i, g in enumerate(self.optimizer.param_groups) for p in g["params"]
                if id(p) not in self._name_of]

    def _on_gradient(self, p, name, group):
        self._activity()
        if name in self._updated:
            # The first gradient has been applied and sent already: the sum of
            # several passes cannot be, and silently dropping one would be wrong.
            raise RuntimeError(
                f"parameter {name!r} received a second gradient before step(): "
                "DistributedAdaptThenCombineOptimizer updates and sends each parameter as soon as its "
                "gradient is ready, so it cannot accumulate gradients over several backward passes. "
                "Call step() after every backward pass (num_steps_per_communication=k gives local "
                "steps between communications), or use DistributedAdaptWithCombineOptimizer, which "
                "steps on the accumulated gradient. After a backward pass that raised, or one made for "
                "another purpose (an input gradient: use torch.autograd.grad(loss, inputs), which leaves "
                "the parameters alone), call step() or synchronize() to finish its round" + _REENTRANT_HINT)
        grad = p.grad
        with torch.no_grad():
            self._local_step(p, grad, self.optimizer.param_groups[group], self.optimizer.state[p])
        if not self._updated:   # (a new round: what an earlier one's hooks used is past)
            self._grads_used.clear()
        self._updated.add(name)
        self._grads_used[name] = (p, grad, _own_version(grad))
        self._stepped_with[name] = (weakref.ref(grad), grad._version)
        if self._communicating():
            self._launched.add(name)
            self._launch(name, p)

    def register_step_function(self, step_func):
        """Bluefog's form: step_func(self, param, grad, param_group) updates param in
        place (self is this wrapper: self.state[param] is the parameter's state). It
        replaces the rule for this wrapper only; bf.register_step_function(cls, fn)
        teaches every wrapper of an optimizer class."""
        check_step_function(step_func, "step_func", "step_func(optimizer, param, grad, group)")
        self._local_step = lambda p, grad, group, state: step_func(self, p, grad, group)

    def _launch_rest(self):
        """Before the rest's communication: the local step of each model parameter that
        has a gradient its hook did not see in this step (not used by this pass, but
        given a gradient earlier or by hand: the wrapped optimizer steps every parameter
        whose gradient is not None, momentum and weight decay included)."""
        with torch.no_grad():
            for name, p in self._named:
                if name not in self._updated and p.grad is not None and not (
                        self._fresh_only and self._stepped_before(name, p.grad)):
                    self._local_step(p, p.grad, self.optimizer.param_groups[self._group_of[name]],
                                     self.optimizer.state[p])
                    self._stepped_with[name] = (weakref.ref(p.grad), p.grad._version)
                    self._updated.add(name)
        super()._launch_rest()

    def _stepped_before(self, name, grad):
        """A local step has used grad already (the same tensor, unchanged since)."""
        ref, version = self._stepped_with.get(name, (None, None))
        return ref is not None and ref() is grad and grad._version == version

    def synchronize(self):
        """As the other wrappers' (see there). Its local steps of the parameters this
        round's backward pass did not reach take only gradients no local step has used:
        after a pass whose loss was skipped (NaN) or whose backward raised before the
        gradients were cleared, or a forward pass for logging, the previous step's
        gradients are still there, and stepping with them again was a step the agent
        never took (step() does, as torch's optimizers step with whatever gradient is
        there)."""
        self._fresh_only = True
        try:
            super().synchronize()
        finally:
            self._fresh_only = False

    def _round_over(self):
        super()._round_over()
        self._updated.clear()

    def zero_grad(self, set_to_none=True):
        """Refused after a backward pass not followed by step() (as Bluefog refuses it
        with communication pending): that pass has updated and sent the parameters whose
        gradients were ready, which dropping its gradients cannot undo, and a later pass
        would raise at its first gradient. synchronize() finishes that round (as step()
        would, without the optimizer's other parameters), then zero_grad() works."""
        if self._updated and self._hooks is not None:
            raise RuntimeError(
                f"zero_grad() after a backward pass that was not followed by step(): {type(self).__name__} "
                f"has updated and sent the parameters whose gradients were ready ({sorted(self._updated)[:3]}"
                f"{' ...' if len(self._updated) > 3 else ''}), which dropping the gradients cannot undo. Call "
                "synchronize() (or step()) to finish that pass's round first, e.g. after a backward pass that "
                "raised; for an input gradient, use torch.autograd.grad(loss, inputs), which leaves the "
                "parameters alone")
        super().zero_grad(set_to_none)
        self._grads_used.clear()

    def step(self, closure=None):
        if self._hooks is None:
            raise RuntimeError("this DistributedAdaptThenCombineOptimizer's hooks were removed (remove_hooks()): "
                               "its local steps ran in them, so it no longer trains the model; wrap the "
                               "optimizer again")
        loss = self._run_closure(closure)
        refusal, refused = self._refusal()
        with torch.no_grad(), self._hidden(refused):
            for p, group in self._extra():
                if p.grad is not None:
                    self._local_step(p, p.grad, self.optimizer.param_groups[group], self.optimizer.state[p])
        try:
            self._step_synchronize()
        finally:
            self._updated.clear()
            changed = self._changed_grads()
        # the wrapped optimizer's step() never runs (its rule ran per parameter): tell a
        # learning-rate scheduler made on it that it stepped, as torch's step() would
        self.optimizer._opt_called = True
        self._finish_step("; and ".join(m for m in (refusal, changed) if m) or None)
        return loss

    def _changed_grads(self):
        """The error for gradients changed after their hook stepped with them (clipped,
        unscaled by a GradScaler, replaced or zeroed between backward() and step()): the
        change came too late and would be silently ignored. None if there are none."""
        used, self._grads_used = self._grads_used, {}
        changed = sorted(name for name, (p, grad, version) in used.items()
                         if p.grad is not grad or (version is not None and grad._version != version
                                                   and not _aliased(grad, (g for _, g, _ in used.values()))))
        if not changed:
            return None
        return (f"the gradients of {changed[:3]}{' ...' if len(changed) > 3 else ''} were changed after backward() "
                "(clip_grad_norm_, GradScaler.unscale_, replaced or zeroed), but DistributedAdaptThenCombineOptimizer "
                "steps each parameter inside backward(), as soon as its gradient is ready: this step used them as "
                "backward() left them. Change gradients inside backward (p.register_hook(lambda g: ...) on the "
                "parameter), or use DistributedAdaptWithCombineOptimizer, which steps in step()")


class DistributedGradientAllreduceOptimizer(_DistributedOptimizer):
    """Horovod-style: gradients are averaged over all agents (allreduce, launched
    from gradient hooks), then the wrapped optimizer steps. With
    num_steps_per_communication=k, gradients of k backward passes accumulate
    and step() is called once per k passes.

    Every agent averages every parameter's gradient in every step, in one order
    (backward order: reversed model.parameters()), whichever parameters its
    forward pass used: an agent without a gradient for a parameter (a branch it
    did not take) contributes zeros and gets the average as its gradient, as in
    Horovod. Where no agent had one, the gradient stays None, so the wrapped
    optimizer skips the parameter as it would alone: in a step where some
    averages are exactly zero, one small allreduce counts, for those parameters,
    the agents that had a gradient (every agent sees the same averages, so all
    take part; no step pays for it otherwise)."""

    def __init__(self, optimizer, model, num_steps_per_communication=1, name_prefix=None):
        super().__init__(optimizer, model, num_steps_per_communication, name_prefix)
        self._passes = {}
        self._filled = set()        # ids of parameters given a zero gradient this step
        self._index = {id(p): i for i, (_, p) in enumerate(self._named)}
        self._zero_averages = []    # (index, parameter, had a gradient here) whose average is all zeros
        self._averaged = {}         # id of a parameter -> (name, its gradient, version) sent this step
        self._in_order = _InOrder([n for n, _ in self._named][::-1], self._start, self._refuse_second_pass,
                                  self._param_of)   # (frozen ones too: zeros, as in Bluefog)
        for name, p in self._named:
            self._hooks.append(p.register_post_accumulate_grad_hook(_GradientHook(self, name)))
        self._hooks.append(_Holds(self, [p for _, p in self._named]))

    def synchronize(self):
        """Average every gradient not yet averaged and install the averages. After
        step() too, as in Bluefog: gradients set by hand (p.grad = ..., from
        torch.autograd.grad or torch.func) start no hook, so no pass is seen."""
        self._synchronize()

    def _on_gradient(self, p, name):
        self._activity()
        n, k = self._passes.get(name, 0) + 1, self.num_steps_per_communication
        if n > k:
            # The average of the first k passes is in flight: this gradient (already
            # added to p.grad) cannot join it, and would be overwritten by it.
            self._averaged.pop(id(p), None)     # (said here: not again at synchronize)
            raise RuntimeError(
                f"parameter {name!r} received gradient {n} before step(), with "
                f"num_steps_per_communication={k}: DistributedGradientAllreduceOptimizer averages "
                f"the gradients of {k} backward pass(es) and then needs step(). Call step() after "
                "every k backward passes, or set num_steps_per_communication to the number of "
                "passes to accumulate. A backward pass through this model for another optimizer (a GAN "
                "generator's step through the discriminator) counts too: drop its gradients with this "
                "wrapper's zero_grad() (the model's zero_grad() does not tell the wrapper)" + _REENTRANT_HINT)
        self._passes[name] = n
        if n == k:
            self._in_order.ready(name, p)

    def _start(self, name, p):
        self._check_no_pending(name)
        if p.grad is None:          # unused on this agent this step
            p.grad = torch.zeros_like(p)
            self._filled.add(id(p))
        elif p.grad.layout is not torch.strided:
            # refused inside the allreduce (raised at step() or synchronize()), which the other
            # agents make too: one with a dense gradient here (unused: zeros) would wait for it
            error = TypeError(f"parameter {name!r} has a {p.grad.layout} gradient: "
                              f"{type(self).__name__} averages dense gradients only (e.g. nn.Embedding(..., "
                              "sparse=False)), or use an optimizer that communicates parameters (AWC, ATC, "
                              "WinPut)")
            with self._named_after(name):
                self._started(name, p, ops._collective("ALLREDUCE", name, functools.partial(_raise, error)))
            return
        g = p.grad
        with self._named_after(name):
            h = ops.allreduce_nonblocking(g, average=True, name=name)
        self._averaged[id(p)] = (name, g, _own_version(g))
        self._started(name, p, h)

    def _launch_rest(self):
        self._in_order.finish()

    def _end_round(self):
        super()._end_round()
        self._passes.clear()

    def zero_grad(self, set_to_none=True):
        """Gradients of a pass whose average is in flight (zero_grad() after backward()
        without step(): a skipped batch, or a GAN's generator pass through this model):
        the averages are waited for and dropped, and the next pass starts afresh."""
        if self._handles or self._passes:
            self._drop_round()
        super().zero_grad(set_to_none)

    def _drop_round(self):
        try:
            super()._drop_round()
        finally:
            self._passes.clear()
            self._filled.clear()
            self._averaged.clear()

    def _apply(self, p, result):
        name, grad, version = self._averaged.pop(id(p), (None, p.grad, None))
        had = id(p) not in self._filled
        self._filled.discard(id(p))
        flat = result.reshape(-1)
        if not (flat.numel() and flat[0]) and not flat.any():    # (the first element: a quick no)
            self._zero_averages.append((self._index[id(p)], p, had))    # (counted even if raising below)
        if p.grad is not grad or (version is not None and grad._version != version
                                  and not _aliased(grad, (q.grad for _, q in self._named))):
            # The allreduce reads the gradient until it is done: a change made meanwhile
            # (clip_grad_norm_ before step()) would be lost or half taken.
            raise _GradientChanged(
                f"the gradient of {name!r} was changed after backward() started averaging it (clipped or "
                "replaced before step()), so its average would undo the change or take part of it. "
                "Call opt.synchronize() first, then change the averaged gradients, then step() inside "
                "`with opt.skip_synchronize():`")
        p.grad.copy_(result)

    def _synchronize(self):
        self._zero_averages = []
        try:
            super()._synchronize()
        except _GradientChanged:
            # (on this agent only, perhaps: a clip that depends on its data) the others
            # count the users of the all-zero averages next, and wait for it there
            self._drop_unused_gradients()
            raise
        self._drop_unused_gradients()

    def _drop_unused_gradients(self):
        """Set the gradient to None where no agent had one. Only the parameters whose
        average is all zeros can be such (the same ones on every agent: an allreduce
        gives every agent the same result); for them, one allreduce counts the agents
        that had a gradient. (Deciding from the zeros alone left the gradient of an
        agent whose own gradient was zero in place while the others dropped theirs:
        weight decay and momentum then moved that agent's copy only.)"""
        zeros, self._zero_averages = sorted(self._zero_averages, key=lambda z: z[0]), []
        if not zeros:
            return
        had = torch.tensor([z[2] for z in zeros], dtype=torch.int32)
        users = ops.allreduce(had, average=False, name=self._prefix + "#gradient_users")
        for (_, p, _), n in zip(zeros, users.tolist()):
            if n == 0:
                p.grad = None

    def step(self, closure=None):
        loss = self._run_closure(closure)
        refusal, refused = self._refusal()
        try:
            self._step_synchronize()
        finally:
            self._passes.clear()
        with self._hidden(refused):
            self.optimizer.step()
        self._finish_step(refusal)
        return loss


def _raise(error):
    raise error


class _GradientChanged(RuntimeError):
    """A gradient was changed while its allreduce read it (see _apply)."""


class DistributedWinPutOptimizer(_ForwardCounted, _DistributedOptimizer):
    """Asynchronous, one-sided: each parameter lives in a window; after each module's
    forward its parameters are put into the out-neighbors' windows (nonblocking),
    and step() combines whatever has arrived (win_update), then takes the local
    gradient step. Per step, ``dst_weights`` steers the puts and
    ``self_weight``/``src_weights`` the combination. Call free_windows() (or
    bf.win_free()) when done."""
    _named_ops = False
    _wait = staticmethod(windows.win_wait)
    _REWRAP = "call remove_hooks() and free_windows(), then wrap the optimizer again"

    def __init__(self, optimizer, model, num_steps_per_communication=1, window_prefix=None):
        self._prefix = _prefix(window_prefix, "window_prefix")
        super().__init__(optimizer, model, num_steps_per_communication)
        self.window_prefix = self._prefix       # Bluefog's attribute: what the window names start with
        self.force_barrier = False              # Bluefog's knob: step() starts with bf.barrier()
        created = []
        for name, p in self._named:
            try:
                windows.win_create(p.detach(), self._prefix + name)
            except (ValueError, TypeError, RuntimeError) as exc:
                if isinstance(exc, MPI.Exception):
                    raise       # (one agent's: the others may wait in win_create, which win_free would join)
                for made in created:      # raised on every agent: not left behind for the wrapper made instead
                    windows.win_free(made)
                if "already exists" not in str(exc):
                    raise
                raise ValueError(f"{exc}. {type(self).__name__} names its windows after the parameters: an "
                                 "earlier wrapper of this model whose windows were not freed (call its "
                                 "free_windows()), or another wrapper's model with parameters of the same names "
                                 "(give one of them a window_prefix, e.g. window_prefix='D')") from None
            created.append(self._prefix + name)
        self._count_forwards()
        self._launch_after_forward(self.model, self._put)

    def _put(self, name, p):
        self._check_no_pending(name)
        h = windows.win_put_nonblocking(p.detach(), self._prefix + name, dst_weights=self.dst_weights)
        self._started(name, p, h)

    def _synchronize(self):
        """Finish this round's puts and combine what has arrived; once per round (a
        second call, e.g. step() after synchronize() without skip_synchronize(), does
        nothing until the next pass)."""
        if self._synced:
            return
        if not self._communicating():   # (no puts were made: the forward hooks put only in k-th steps)
            self._end_round()
            return
        if (self.self_weight is None) != (self.src_weights is None):
            # (win_update would refuse them after the puts; without self_weight, src_weights
            # were ignored: the default weights were used, silently)
            raise ValueError(f"{type(self).__name__}: self_weight and src_weights must be set together (or "
                             f"neither, for the topology's weights), got self_weight={self.self_weight!r} and "
                             f"src_weights={self.src_weights!r}")
        self._check_memory()
        frozen = self._round_frozen()
        for name, p in self._not_started():
            self._put(name, p)
        self._launched = set()
        self._all_handles(lambda p, h: self._wait(h))
        for name, _ in self._named:
            if name in frozen:      # frozen since the wrapper was created: left as it is
                continue
            if self.self_weight is None:
                windows.win_update(self._prefix + name)
            else:
                windows.win_update(self._prefix + name, self_weight=self.self_weight,
                                   neighbor_weights=self.src_weights)
        self._end_round()

    def _check_memory(self):
        """Each window combines into the parameter's memory as it was at creation: a
        model moved or converted since (model.to(memory_format=...)) would never see
        the combination."""
        for name, p in self._named:
            win = windows._window(self._prefix + name, "synchronize")[1]
            held = win.tensor if win.device_tensor is None else win.device_tensor
            if held.data_ptr() != p.data_ptr():
                raise RuntimeError(
                    f"parameter {name!r} is no longer in the memory its window {self._prefix + name!r} was "
                    f"created on (the model was moved or converted after {type(self).__name__} was created, e.g. "
                    "model.to(memory_format=...) or vector_to_parameters): the combination would not reach the "
                    "model. Create the wrapper after moving the model")

    _barrier_made = False     # force_barrier: this round's barrier is made (see _forced_barrier)

    def _forced_barrier(self):
        """force_barrier: one barrier per round, made by step(), or by the synchronize()
        that ends a round after a pass of the model (an agent that skips step(), the
        gradient-scaler pattern), whichever comes first; not by a synchronize() after
        only zero_grad() (one agent's before saving a checkpoint)."""
        if self.force_barrier:
            self._barrier_made = True
            ops.barrier()

    def _activity(self):
        if self._synced:    # (a synchronize() ended the last round: this begins the next)
            self._barrier_made = False
        super()._activity()

    def _finish_step(self, refusal=None):
        self._barrier_made = False
        super()._finish_step(refusal)

    def synchronize(self):
        if not (self._stepped or self._synced or self._barrier_made) and (self._forwards[-1] or self._frozen_pass):
            self._forced_barrier()
        super().synchronize()

    def step(self, closure=None):
        if closure is not None and self._synced:
            self._activity()    # (the closure's pass begins the round after one synchronize() ended)
        if not self._barrier_made:      # (else the synchronize() that ended this round made it)
            self._forced_barrier()
        loss = self._run_closure(closure)
        refusal, refused = self._refusal()
        if self._communicating() and not self._skip_sync:
            self._synchronize()
        with self._hidden(refused):
            self.optimizer.step()
        self._finish_step(refusal)
        return loss

    def free_windows(self):
        for name, _ in self._named:
            if self._prefix + name in windows.get_current_created_window_names():
                windows.win_free(self._prefix + name)

    unregister_window = free_windows      # Bluefog's name


def DistributedAllreduceOptimizer(optimizer, model, num_steps_per_communication=1):
    """Deprecated alias of DistributedAdaptWithCombineOptimizer with allreduce."""
    warnings.warn("DistributedAllreduceOptimizer is deprecated; use DistributedAdaptWithCombineOptimizer "
                  "with communication_type=CommunicationType.allreduce", DeprecationWarning, stacklevel=2)
    return DistributedAdaptWithCombineOptimizer(optimizer, model, CommunicationType.allreduce,
                                                num_steps_per_communication)


def DistributedNeighborAllreduceOptimizer(optimizer, model, num_steps_per_communication=1):
    """Deprecated alias of DistributedAdaptWithCombineOptimizer with neighbor_allreduce."""
    warnings.warn("DistributedNeighborAllreduceOptimizer is deprecated; use "
                  "DistributedAdaptWithCombineOptimizer", DeprecationWarning, stacklevel=2)
    return DistributedAdaptWithCombineOptimizer(optimizer, model, CommunicationType.neighbor_allreduce,
                                                num_steps_per_communication)


def DistributedHierarchicalNeighborAllreduceOptimizer(optimizer, model, num_steps_per_communication=1):
    """Deprecated alias of DistributedAdaptWithCombineOptimizer with hierarchical_neighbor_allreduce."""
    warnings.warn("DistributedHierarchicalNeighborAllreduceOptimizer is deprecated; use "
                  "DistributedAdaptWithCombineOptimizer", DeprecationWarning, stacklevel=2)
    return DistributedAdaptWithCombineOptimizer(
        optimizer, model, CommunicationType.hierarchical_neighbor_allreduce, num_steps_per_communication)

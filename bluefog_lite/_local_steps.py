"""Single-parameter update rules for the adapt-then-combine optimizer.

ATC updates each parameter the moment its gradient is ready (in a gradient hook),
so it needs the optimizer's rule for one parameter at a time. These follow
torch.optim's defaults-compatible math and keep state under torch's own keys, so
that state_dict()/load_state_dict() of the wrapped optimizer keep working.
"""
import functools
import inspect
import math

import torch


def _signed(grad, group):
    """maximize=True: torch steps along the gradient, i.e. against its negation."""
    return -grad if group.get("maximize", False) else grad


def _decayed(p, grad, group):
    grad = _signed(grad, group)
    wd = group.get("weight_decay", 0)
    return grad.add(p, alpha=wd) if wd else grad


def _parts_of_complex(rule):
    """rule as torch.optim applies it to a complex parameter: to the pairs of real
    numbers the parameter, its gradient and its state hold (view_as_real), so that
    squares and roots are taken per part (complex arithmetic would mix them). State
    the rule creates is kept complex, as torch keeps it. A sparse gradient goes to the
    rule as it is (torch's sparse Adagrad works in complex arithmetic)."""
    @functools.wraps(rule)
    def step(p, grad, group, state):
        if not torch.is_complex(p) or grad.is_sparse:
            return rule(p, grad, group, state)
        real_p = torch.view_as_real(p)
        views = {k: torch.view_as_real(v) for k, v in state.items() if torch.is_tensor(v) and v.is_complex()}
        parts = {**state, **views}
        rule(real_p, torch.view_as_real(grad), group, parts)
        for k, v in parts.items():
            if v is views.get(k):
                continue          # (updated in place)
            if torch.is_tensor(v) and v.shape == real_p.shape and not v.is_complex():
                v = torch.view_as_complex(v)
            state[k] = v
    return step


def sgd_step(p, grad, group, state):
    grad = _decayed(p, grad, group)
    momentum = group.get("momentum", 0)
    if momentum:
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = grad.clone()
        else:
            buf.mul_(momentum).add_(grad, alpha=1 - group.get("dampening", 0))
        grad = grad.add(buf, alpha=momentum) if group.get("nesterov", False) else buf
    p.add_(grad, alpha=-group["lr"])


def _refuse_sparse(grad, optimizer):
    if grad.is_sparse:
        raise TypeError(f"{optimizer} does not take sparse gradients (nor does torch.optim.{optimizer}): "
                        "make them dense (nn.Embedding(..., sparse=False)), or use SGD or Adagrad")


@_parts_of_complex
def adam_step(p, grad, group, state):
    _refuse_sparse(grad, "Adam")
    amsgrad = group.get("amsgrad", False)
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)
    if amsgrad and "max_exp_avg_sq" not in state:     # (also when amsgrad was turned on later)
        state["max_exp_avg_sq"] = torch.zeros_like(p)
    beta1, beta2 = group["betas"]
    state["step"] += 1
    t = float(state["step"])
    grad = _signed(grad, group)
    wd = group.get("weight_decay", 0)
    if wd and group.get("decoupled_weight_decay", False):   # AdamW
        p.mul_(1 - group["lr"] * wd)
    elif wd:
        grad = grad.add(p, alpha=wd)
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    second = state["exp_avg_sq"]
    if amsgrad:     # the largest second moment so far
        second = torch.maximum(state["max_exp_avg_sq"], second, out=state["max_exp_avg_sq"])
    denom = (second.sqrt() / math.sqrt(1 - beta2 ** t)).add_(group["eps"])
    p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** t))


@_parts_of_complex
def rmsprop_step(p, grad, group, state):
    _refuse_sparse(grad, "RMSprop")
    if not state:
        state["step"] = torch.tensor(0.0)
        state["square_avg"] = torch.zeros_like(p)
        if group.get("momentum", 0) > 0:
            state["momentum_buffer"] = torch.zeros_like(p)
        if group.get("centered", False):
            state["grad_avg"] = torch.zeros_like(p)
    state["step"] += 1
    grad = _decayed(p, grad, group)
    alpha = group["alpha"]
    sq = state["square_avg"].mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
    if group.get("centered", False):
        ga = state["grad_avg"].lerp_(grad, 1 - alpha)
        avg = sq.addcmul(ga, ga, value=-1).sqrt_().add_(group["eps"])
    else:
        avg = sq.sqrt().add_(group["eps"])
    if group.get("momentum", 0) > 0:
        buf = state["momentum_buffer"].mul_(group["momentum"]).addcdiv_(grad, avg)
        p.add_(buf, alpha=-group["lr"])
    else:
        p.addcdiv_(grad, avg, value=-group["lr"])


@_parts_of_complex
def adagrad_step(p, grad, group, state):
    if grad.is_sparse and group.get("weight_decay", 0):
        raise TypeError("Adagrad takes a sparse gradient only without weight_decay (as torch.optim.Adagrad)")
    if not state:
        state["step"] = torch.tensor(0.0)
        start = group.get("initial_accumulator_value", 0)    # (complex: in both parts, as torch)
        state["sum"] = torch.full_like(p, complex(start, start) if torch.is_complex(p) else start)
    state["step"] += 1
    clr = group["lr"] / (1 + (float(state["step"]) - 1) * group.get("lr_decay", 0))
    if grad.is_sparse:      # (nn.Embedding(sparse=True)): only the rows it has
        grad = _signed(grad, group).coalesce()
        index, values = grad._indices(), grad._values()
        state["sum"].add_(torch.sparse_coo_tensor(index, values * values, grad.shape, check_invariants=False))
        root = state["sum"].sparse_mask(grad)._values().sqrt_().add_(group["eps"])
        p.add_(torch.sparse_coo_tensor(index, values / root, grad.shape, check_invariants=False), alpha=-clr)
        return
    grad = _decayed(p, grad, group)
    state["sum"].addcmul_(grad, grad, value=1)
    p.addcdiv_(grad, state["sum"].sqrt().add_(group["eps"]), value=-clr)


@_parts_of_complex
def adadelta_step(p, grad, group, state):
    _refuse_sparse(grad, "Adadelta")
    if not state:
        state["step"] = torch.tensor(0.0)
        state["square_avg"] = torch.zeros_like(p)
        state["acc_delta"] = torch.zeros_like(p)
    state["step"] += 1
    grad = _decayed(p, grad, group)
    rho, eps = group["rho"], group["eps"]
    sq = state["square_avg"].mul_(rho).addcmul_(grad, grad, value=1 - rho)
    delta = state["acc_delta"].add(eps).sqrt_().div_(sq.add(eps).sqrt_()).mul_(grad)
    state["acc_delta"].mul_(rho).addcmul_(delta, delta, value=1 - rho)
    p.add_(delta, alpha=-group["lr"])


_STEPS = {
    torch.optim.SGD: sgd_step,
    torch.optim.Adam: adam_step,
    torch.optim.RMSprop: rmsprop_step,
    torch.optim.Adagrad: adagrad_step,
    torch.optim.Adadelta: adadelta_step,
}


def register_step_function(optimizer_class, fn):
    """Teach DistributedAdaptThenCombineOptimizer another optimizer:
    fn(param, grad, param_group, state_dict_of_param) updates param in place."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError("optimizer_class must be a torch.optim.Optimizer subclass")
    check_step_function(fn, "fn", "fn(param, grad, group, state)")
    _STEPS[optimizer_class] = fn


def check_step_function(fn, what, form):
    """TypeError unless fn can be called with four arguments, as form says."""
    if not callable(fn):
        raise TypeError(f"{what} must be callable as {form}")
    try:
        inspect.signature(fn).bind(None, None, None, None)
    except TypeError as exc:
        raise TypeError(f"{what} must take four arguments, {form}: {exc}") from None
    except ValueError:
        pass     # (a builtin without a signature: trusted)


class NoStepRule(TypeError, ValueError):
    """The optimizer has no per-parameter rule (a TypeError; also a ValueError, which
    is what Bluefog raised)."""


def _step_of(cls):
    """cls.step without its wrappers (torch's profiling hook, decorators)."""
    return inspect.unwrap(cls.step)


def step_function_for(optimizer):
    kind = type(optimizer)
    for cls in kind.__mro__:
        if cls in _STEPS:
            if _step_of(kind) is not _step_of(cls):
                raise NoStepRule(
                    f"{kind.__name__} overrides step() of {cls.__name__}: DistributedAdaptThenCombineOptimizer "
                    f"would apply {cls.__name__}'s per-parameter rule instead of it. Register its rule with "
                    f"bf.register_step_function({kind.__name__}, fn)")
            return _STEPS[cls]
    raise NoStepRule(f"DistributedAdaptThenCombineOptimizer has no per-parameter step for "
                    f"{type(optimizer).__name__}; supported: {[c.__name__ for c in _STEPS]}. "
                    "Add one with bf.register_step_function(cls, fn)")

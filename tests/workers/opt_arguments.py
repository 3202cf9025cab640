"""The optimizer wrappers' arguments: each bad one raises a clear error naming it."""
import numpy as np
import torch

import bluefog_lite as bf

bf.init()
rank = bf.rank()


def raises(exc, text, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc as e:
        assert text in str(e), f"{exc.__name__} without {text!r}: {e}"
        return
    raise AssertionError(f"{fn.__name__} did not raise {exc.__name__} ({text!r})")


net = torch.nn.Linear(3, 2)
sgd = lambda params: torch.optim.SGD(params, lr=0.1)     # noqa: E731
AWC, ATC = bf.DistributedAdaptWithCombineOptimizer, bf.DistributedAdaptThenCombineOptimizer
GAR, WINPUT = bf.DistributedGradientAllreduceOptimizer, bf.DistributedWinPutOptimizer
for wrapper in (AWC, ATC, GAR, WINPUT):
    raises(TypeError, "optimizer must be a torch.optim.Optimizer, got Linear", wrapper, net, net)
    raises(TypeError, "LBFGS is not supported by the optimizer wrappers", wrapper,
           torch.optim.LBFGS(net.parameters()), net)
    raises(TypeError, "model must be a torch.nn.Module or a list of them, got dict", wrapper,
           sgd(net.parameters()), {"net": net})
    # a list of models: each keeps its own parameter names, as in Bluefog (a WinPut's windows are
    # named after them: Bluefog code reads them by those names), unless two models' names clash
    tail = torch.nn.Linear(2, 1)
    listed = wrapper(sgd([*net.parameters(), *tail.parameters()]), [net, torch.nn.Sequential(tail)])
    assert [n for n, _ in listed._named] == ["weight", "bias", "0.weight", "0.bias"], listed._named
    if wrapper is WINPUT:
        assert sorted(bf.get_current_created_window_names()) == ["0.bias", "0.weight", "bias", "weight"]
    listed.remove_hooks()
    if wrapper is WINPUT:
        listed.free_windows()
    listed = wrapper(sgd([*net.parameters(), *tail.parameters()]), [net, tail])
    assert [n for n, _ in listed._named] == ["0.weight", "0.bias", "1.weight", "1.bias"], listed._named
    listed.remove_hooks()
    if wrapper is WINPUT:
        listed.free_windows()
    raises(ValueError, "num_steps_per_communication must be a positive integer, got 0", wrapper,
           sgd(net.parameters()), net, num_steps_per_communication=0)
    raises(ValueError, "num_steps_per_communication must be a positive integer, got 1.5", wrapper,
           sgd(net.parameters()), net, num_steps_per_communication=1.5)
    # (an optimizer holding part of the model is accepted: opt_subset.py)
    raises(ValueError, "none of the model's parameters that require gradients (['weight', 'bias']) is in the "
           "optimizer", wrapper, sgd([torch.zeros(1, requires_grad=True)]), net)
    raises(ValueError, "the model (ReLU) has no parameters that require gradients", wrapper,
           sgd([torch.zeros(1, requires_grad=True)]), torch.nn.ReLU())
raises(TypeError, "communication_type must be a bf.CommunicationType, got 'allreduce'", AWC,
       sgd(net.parameters()), net, "allreduce")
raises(TypeError, "window_prefix must be a string, got 3", WINPUT, sgd(net.parameters()), net, window_prefix=3)
raises(ValueError, "window_prefix must be a non-empty string", WINPUT, sgd(net.parameters()), net, window_prefix="")
for wrapper in (AWC, ATC, GAR):
    raises(TypeError, "name_prefix must be a string, got 3", wrapper, sgd(net.parameters()), net, name_prefix=3)
    raises(ValueError, "name_prefix must be a non-empty string", wrapper, sgd(net.parameters()), net, name_prefix="")
assert bf.get_current_created_window_names() == []       # the refused ones created none
# two WinPut wrappers over models with parameters of the same names: the window names collide,
# and the error says how to tell them apart (it said only "win_free it first")
other = torch.nn.Sequential()
other.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))     # (its window is made first)
other.register_parameter("weight", torch.nn.Parameter(torch.zeros(2, 3)))
first = WINPUT(sgd(net.parameters()), net)
raises(ValueError, "give one of them a window_prefix", WINPUT, sgd(other.parameters()), other)
assert sorted(bf.get_current_created_window_names()) == ["bias", "weight"], "the refused wrapper left windows"
first.remove_hooks()
# ... and wrapping the same model again without freeing the first wrapper's windows says so
raises(ValueError, "an earlier wrapper of this model whose windows were not freed (call its free_windows())",
       WINPUT, sgd(net.parameters()), net)
first.free_windows()

# WinPut after unfreezing a parameter: the message's recipe (windows freed too) works
frozen = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
frozen[0].requires_grad_(False)
base = sgd(frozen[1].parameters())
wp = WINPUT(base, frozen)
frozen[0].requires_grad_(True)
base.add_param_group({"params": frozen[0].parameters()})
wp.zero_grad()
frozen(torch.ones(2, 3)).sum().backward()
raises(RuntimeError, "call remove_hooks() and free_windows(), then wrap the optimizer again", wp.step)
wp.remove_hooks()
wp.free_windows()
wp = WINPUT(base, frozen)
wp.zero_grad()
frozen(torch.ones(2, 3)).sum().backward()
wp.step()
wp.remove_hooks()
wp.free_windows()
ok = AWC(sgd(net.parameters()), net, num_steps_per_communication=np.int64(2))   # numpy ints are ints
assert ok.num_steps_per_communication == 2 and type(ok.num_steps_per_communication) is int
ok.remove_hooks()
# one wrapper per model at a time: a second would communicate the parameters again
first = AWC(sgd(net.parameters()), net)
raises(ValueError, "the model already has a DistributedAdaptWithCombineOptimizer (one model takes one wrapper); "
       "call its remove_hooks()", ATC, sgd(net.parameters()), net)
raises(ValueError, "wrap each part as its own model", ATC, sgd([net.bias]), net)
first.remove_hooks()
# nor a model that holds its parameters (a part of it, a model containing it, a list with a part)
seq = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
first = GAR(sgd(seq.parameters()), seq)
for other in (seq[1], torch.nn.Sequential(seq, torch.nn.Linear(1, 1)), [torch.nn.Linear(1, 1), seq[0]]):
    raises(ValueError, "of the model are communicated by a DistributedGradientAllreduceOptimizer already (its "
           "model contains them or shares them), so they would be averaged twice per step", AWC,
           sgd([p for m in (other if isinstance(other, list) else [other]) for p in m.parameters()]), other,
           name_prefix="other")
first.remove_hooks()
second = ATC(sgd(net.parameters()), net)      # after remove_hooks, a new one may take its place
second.remove_hooks()
raises(RuntimeError, "hooks were removed", second.step)   # ATC's local steps ran in its hooks

# a sparse gradient cannot be averaged by allreduce: named, on every agent, at step(); with
# the embedding unused on one agent (its gradient: dense zeros), that agent raises naming
# the other instead of waiting for it; the next step works
emb = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
bf.broadcast_parameters(emb.state_dict(), 0)
gar = GAR(sgd(emb.parameters()), emb)
SPARSE = "parameter '0.weight' has a torch.sparse_coo gradient: DistributedGradientAllreduceOptimizer averages " \
    "dense gradients only"
emb(torch.tensor([1, 2])).sum().backward()
raises(TypeError, SPARSE, gar.step)
gar.zero_grad()
if bf.rank() == 0:
    emb[1](torch.ones(2, 4)).sum().backward()
    raises(ValueError, f"failed on every agent because of bad input (rank 1: TypeError: {SPARSE}", gar.step)
else:
    emb(torch.tensor([1, 2])).sum().backward()
    raises(TypeError, SPARSE, gar.step)
gar.zero_grad()
emb[1](torch.full((2, 4), float(bf.rank()))).sum().backward()
gar.step()
rows = bf.allgather(torch.cat([p.detach().reshape(1, -1) for p in emb.parameters()], 1), name="sparse.after")
assert torch.equal(rows[0], rows[1]), "the models differ after the refused steps"
gar.remove_hooks()

# a copy of a wrapped model (copy.deepcopy, torch.save/load) does not start the original's communication
import copy  # noqa: E402
import io  # noqa: E402
for wrapper in (AWC, WINPUT):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    opt = wrapper(sgd(model.parameters()), model)
    x = torch.randn(4, 3)
    twin = copy.deepcopy(model)
    twin(x).sum().backward()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    torch.load(buf, weights_only=False)(x).sum().backward()
    assert not opt._handles and not opt._launched, (wrapper.__name__, opt._handles, opt._launched)
    model(x).sum().backward()                   # the original still communicates
    assert opt._launched == {"0.weight", "0.bias", "1.weight", "1.bias"}, opt._launched
    opt.step()
    opt.remove_hooks()
    if wrapper is WINPUT:
        opt.free_windows()
# ATC steps each parameter inside backward(): a gradient changed between backward() and step()
# (clipped, unscaled, replaced) is named at step(), whose round completes (the next step works)
clip_net = torch.nn.Linear(3, 1)
atc = ATC(sgd(clip_net.parameters()), clip_net)
x = torch.ones(4, 3)
for how in ("clip", "synchronize, then clip", "replace", None):
    atc.zero_grad()
    clip_net(x).sum().backward()
    if how == "synchronize, then clip":
        atc.synchronize()
    if how is not None and how.endswith("clip"):
        torch.nn.utils.clip_grad_norm_(clip_net.parameters(), 0.1)
    elif how == "replace":
        clip_net.bias.grad = torch.zeros(1)
    if how is None:
        atc.step()
    else:
        names = "['bias']" if how == "replace" else "['bias', 'weight']"
        raises(RuntimeError, f"the gradients of {names} were changed after backward() (clip_grad_norm_", atc.step)
atc.remove_hooks()


# ... but not for gradients it changed itself: views of one buffer (biases joined by torch.cat share
# a gradient buffer and its version) stepped by a rule that adds weight decay in place, as
# Bluefog's rules do; nor for a round closed by synchronize() whose gradients were zeroed after
class JoinedBiases(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_bias, self.v_bias = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
        self.aux = torch.nn.Linear(6, 1)

    def forward(self, x):
        return x + torch.cat([self.q_bias, torch.zeros(2), self.v_bias])


def decay_in_place(opt, p, grad, group):
    p.add_(grad.add_(p, alpha=group["weight_decay"]), alpha=-group["lr"])


joined = JoinedBiases()
atc = ATC(torch.optim.SGD(joined.parameters(), lr=0.1, weight_decay=0.01), joined)
atc.register_step_function(decay_in_place)
for _ in range(2):
    atc.zero_grad()
    (joined(torch.ones(3, 6)) ** 2).sum().backward()
    atc.step()
joined.aux(torch.ones(1, 6)).sum().backward()       # a pass for another purpose, closed by synchronize()
atc.synchronize()
joined.zero_grad()
(joined(torch.ones(3, 6)) ** 2).sum().backward()
atc.step()
atc.remove_hooks()


# ... nor two gradients in one memory (torch.stack's backward gives both parameters the same buffer):
# copying one's average in (gradient allreduce) or a rule's in-place change of one moved the other's version
class Stacked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return (x * torch.stack([self.a, self.b]).sum(0)).sum()


for wrapper in (GAR, ATC):
    stacked = Stacked()
    opt = wrapper(torch.optim.SGD(stacked.parameters(), lr=0.1, weight_decay=0.01), stacked)
    if wrapper is ATC:
        opt.register_step_function(decay_in_place)
    for _ in range(2):
        opt.zero_grad()
        stacked(torch.arange(4.0)).backward()
        assert stacked.a.grad.data_ptr() == stacked.b.grad.data_ptr()     # (what the case is about)
        opt.step()
    opt.remove_hooks()
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

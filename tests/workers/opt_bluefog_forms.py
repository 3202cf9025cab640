"""One agent: the optimizer wrappers' Bluefog forms and the cases where they must
equal the plain optimizer (CommunicationType.empty, or one agent), checked against
torch.optim itself:
- ATC steps a parameter whose gradient this pass did not produce (zero_grad(set_to_none=False)
  and a branch used every other step), with momentum, weight decay and Adam's moments;
- ATC refuses a subclass that overrides step() until its rule is registered, and
  Bluefog's opt.register_step_function(f(self, p, grad, group)) gives it;
- a learning-rate scheduler made on the base optimizer of ATC does not warn that
  its step() came first;
- WinPut: synchronize() then step() combines once; force_barrier, window_prefix,
  unregister_window();
- WinPut refuses to combine into memory the model no longer uses (moved after wrapping);
- state-dict hooks registered on a wrapper run (torch.optim.Optimizer's contract);
- turn_off_timeline()/turn_on_timeline(): FORWARD spans only while on."""
import copy
import json
import os
import warnings

import torch

import bluefog_lite as bf

bf.init()
torch.manual_seed(0)


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 2)
        self.b = torch.nn.Linear(3, 2)

    def forward(self, x, step):
        return self.a(x) + (self.b(x) if step % 2 == 0 else 0)


def train(model, opt, steps=5):
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        opt.zero_grad(set_to_none=False)
        model(x, step).pow(2).sum().backward()
        opt.step()


def params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


for make in (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
             lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.1),
             lambda p: torch.optim.Adam(p, lr=0.05)):
    plain = Branchy()
    wrapped = copy.deepcopy(plain)
    train(plain, make(plain.parameters()))
    atc = bf.DistributedAdaptThenCombineOptimizer(make(wrapped.parameters()), wrapped,
                                                  communication_type=bf.CommunicationType.empty)
    train(wrapped, atc)
    atc.remove_hooks()
    assert torch.allclose(params(plain), params(wrapped), rtol=1e-6, atol=1e-7), (params(plain), params(wrapped))


class HalfSGD(torch.optim.SGD):      # its own rule: half the learning rate
    def step(self, closure=None):
        for g in self.param_groups:
            g["lr"] /= 2
        try:
            return super().step(closure)
        finally:
            for g in self.param_groups:
                g["lr"] *= 2


wrapped = Branchy()
atc = bf.DistributedAdaptThenCombineOptimizer(HalfSGD(wrapped.parameters(), lr=0.1), wrapped,
                                              communication_type=bf.CommunicationType.empty)
try:
    wrapped(torch.ones(1, 3), 0).sum().backward()      # the first parameter's hook needs the rule
except TypeError as e:
    assert isinstance(e, ValueError), "Bluefog raised a ValueError: scripts may catch that"
    assert "HalfSGD overrides step() of SGD" in str(e) and "register_step_function" in str(e), e
else:
    raise AssertionError("ATC applied SGD's rule to a subclass with its own step()")
atc.remove_hooks()

plain = Branchy()
wrapped = copy.deepcopy(plain)
train(plain, HalfSGD(plain.parameters(), lr=0.1))
atc = bf.DistributedAdaptThenCombineOptimizer(HalfSGD(wrapped.parameters(), lr=0.1), wrapped,
                                              communication_type=bf.CommunicationType.empty)
atc.register_step_function(lambda opt, p, grad, group: p.add_(grad, alpha=-group["lr"] / 2))
train(wrapped, atc)
atc.remove_hooks()
assert torch.allclose(params(plain), params(wrapped), rtol=1e-6, atol=1e-7)

model = Branchy()
base = torch.optim.SGD(model.parameters(), lr=0.1)
atc = bf.DistributedAdaptThenCombineOptimizer(base, model, communication_type=bf.CommunicationType.empty)
sched = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    train(model, atc, steps=1)
    sched.step()
assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)], [str(w.message) for w in caught]
assert base.param_groups[0]["lr"] == 0.05
atc.remove_hooks()


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1, bias=False)

    def forward(self, x):
        return self.lin(x)


model = Plain()
start = params(model).clone()
win = bf.DistributedWinPutOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, window_prefix="wp")
assert win.window_prefix == "wp." and win.force_barrier is False
assert bf.get_current_created_window_names() == ["wp.lin.weight"]
win.force_barrier = True
win.self_weight, win.src_weights = 0.5, {}       # combine: x <- 0.5 x (no neighbors here)
x = torch.ones(2, 3)
win.zero_grad()
model(x).sum().backward()
grad = model.lin.weight.grad.flatten().clone()
win.synchronize()
win.step()                                      # after synchronize(): no second combination
assert torch.allclose(params(model), 0.5 * start - 0.1 * grad), (params(model), 0.5 * start - 0.1 * grad)
win.unregister_window()
assert bf.get_current_created_window_names() == []
win.remove_hooks()

# WinPut counts forward passes (Bluefog): two passes per step with k=2 combine in every step
model = Plain()
start = params(model).clone()
win = bf.DistributedWinPutOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model,
                                    num_steps_per_communication=2, window_prefix="wp2")
win.self_weight, win.src_weights = 0.5, {}
for s in range(1, 4):
    win.zero_grad()
    for _ in range(2):
        model(x).sum().backward()
    win.step()
    assert torch.allclose(params(model), 0.5 ** s * start), (s, params(model), 0.5 ** s * start)
win.free_windows()
win.remove_hooks()

# WinPut: a model moved to other memory after wrapping (channels_last) is named at the
# combination instead of silently never receiving it
conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
win = bf.DistributedWinPutOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), conv, window_prefix="moved")
conv.to(memory_format=torch.channels_last)
conv(torch.ones(1, 3, 5, 5)).sum().backward()
try:
    win.step()
except RuntimeError as e:
    assert "parameter '0.weight' is no longer in the memory its window 'moved.0.weight' was created on" in str(e), e
else:
    raise AssertionError("a window on the parameter's old memory went unnoticed")
win.free_windows()
win.remove_hooks()

# state-dict hooks registered on a wrapper run around the wrapped optimizer's state, as torch's
# do: a post hook's dict is returned, a load pre hook's dict is loaded
for wrapper in (bf.DistributedAdaptWithCombineOptimizer, bf.DistributedAdaptThenCombineOptimizer,
                bf.DistributedGradientAllreduceOptimizer, bf.DistributedWinPutOptimizer):
    model = Plain()
    opt = wrapper(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append(("pre", o)))
    opt.register_state_dict_post_hook(lambda o, sd: dict(sd, note="saved"))
    opt.register_load_state_dict_pre_hook(
        lambda o, sd: {**sd, "param_groups": [dict(g, lr=0.25) for g in sd["param_groups"]]})
    opt.register_load_state_dict_post_hook(lambda o: seen.append(("post", o)))
    saved = opt.state_dict()
    assert saved["note"] == "saved" and seen == [("pre", opt)], (wrapper.__name__, saved.keys(), seen)
    opt.load_state_dict(saved)
    assert seen[-1] == ("post", opt) and opt.optimizer.param_groups[0]["lr"] == 0.25, (wrapper.__name__, seen)
    opt.remove_hooks()
    if wrapper is bf.DistributedWinPutOptimizer:
        opt.free_windows()

prefix = os.environ["BLUEFOG_TIMELINE"]
model = Plain()
awc = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
for on in (False, True, False):
    (awc.turn_on_timeline if on else awc.turn_off_timeline)()
    with bf.timeline_context("steps", "ON" if on else "OFF"):
        for _ in range(3):
            awc.zero_grad()
            model(x).sum().backward()
            awc.step()
bf.shutdown()
with open(f"{prefix}0.json") as f:
    events = json.load(f)
names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
spans = {label: [e for e in events if e.get("ph") in ("B", "X") and e["name"] == label] for label in ("ON", "OFF")}
assert len(spans["ON"]) == 1 and len(spans["OFF"]) == 2, spans
on = spans["ON"][0]
t0 = on["ts"]
t1 = min(e["ts"] for e in events if e.get("ph") == "E" and (e["pid"], e["tid"]) == (on["pid"], on["tid"])
         and e["ts"] >= t0)
forwards = [e for e in events if e["name"] == "FORWARD" and names.get(e["pid"]) == "lin.weight"]
assert forwards and all(t0 <= e["ts"] <= t1 for e in forwards), (t0, t1, [e["ts"] for e in forwards])
print("AGENT OK 0", flush=True)

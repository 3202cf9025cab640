"""A step that fails on every agent, caught, then training goes on (reference: the
same wrapper in a run where nothing fails, or where the failure's effect is made
explicit):
- AWC and gradient allreduce, synchronize() then step() inside skip_synchronize()
  (the clipping pattern) whose wrapped step raises once and is retried the same way:
  the round was synchronized already, so the retry only steps. Before, the failed
  step marked the round unsynchronized and the retry started the next round's
  communication and left it in flight ("already has communication in flight" in
  every later step; with allreduce, averages applied a step late).
- ATC whose backward pass raises after the last layer's gradient hook ran (it
  updated and sent that layer): zero_grad() refuses, naming synchronize(), which
  finishes that round as step() would; then the batch is skipped. Before, every
  later step raised "received a second gradient before step()", pointing nowhere
  near the cause. Reference: the failed step as an ATC step in which the first
  layer's gradient is zero. Also with the layer in a reentrant checkpoint, and
  after a backward pass made for an input gradient."""

import torch

import bluefog_lite as bf

bf.init()
rank = bf.rank()
X = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3) * (rank + 1)
STEPS, FAIL_AT = 5, 1


class Flaky(torch.optim.SGD):
    fail = False

    def step(self, closure=None):
        if self.fail:
            self.fail = False
            raise RuntimeError("inner step failed")
        return super().step(closure)


class Check(torch.autograd.Function):
    """Identity whose backward raises (mode "raise") or gives zeros (mode "zero")."""
    mode = None

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if Check.mode == "raise":
            raise FloatingPointError("non-finite gradient")
        return g * 0 if Check.mode == "zero" else g


class Net(torch.nn.Module):
    def __init__(self, checkpointed=False):
        super().__init__()
        torch.manual_seed(3)
        self.l1 = torch.nn.Linear(3, 3, dtype=torch.float64)
        self.l2 = torch.nn.Linear(3, 1, dtype=torch.float64)
        self.checkpointed = checkpointed

    def forward(self, x):
        h = Check.apply(torch.tanh(self.l1(x)))
        if self.checkpointed:   # l2's gradient comes from the checkpoint's own inner backward pass
            return torch.utils.checkpoint.checkpoint(self.l2, h, use_reentrant=True)
        return self.l2(h)


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a, b, what):
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-14, msg=lambda m: f"rank {rank}: {what}: {k}: {m}")


# skip_synchronize retry
for make in (lambda o, m: bf.DistributedAdaptWithCombineOptimizer(o, m),
             lambda o, m: bf.DistributedAdaptWithCombineOptimizer(o, m, bf.CommunicationType.allreduce),
             lambda o, m: bf.DistributedGradientAllreduceOptimizer(o, m)):
    results = []
    for failing in (False, True):
        model = Net()
        base = Flaky(model.parameters(), lr=0.1)
        opt = make(base, model)
        for t in range(STEPS):
            opt.zero_grad()
            model(X).sum().backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            base.fail = failing and t == FAIL_AT
            with opt.skip_synchronize():
                try:
                    opt.step()
                except RuntimeError as e:
                    assert "inner step failed" in str(e), e
                    with opt.skip_synchronize():
                        opt.step()
            assert not opt._handles, f"rank {rank}: in flight after step {t}: {sorted(opt._handles)}"
        results.append(state(model))
        opt.remove_hooks()
    same(results[1], results[0], f"{type(opt).__name__}: retried step")

# ATC: a backward that raises after l2's hook ran; the batch is skipped. Also with l2
# in a reentrant checkpoint, whose inner backward pass ends before the outer raises.
for checkpointed in (False, True):
    results = []
    for failing in (False, True):
        model = Net(checkpointed)
        opt = bf.DistributedAdaptThenCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
        for t in range(STEPS):
            opt.zero_grad()
            Check.mode = ("raise" if failing else "zero") if t == FAIL_AT else None
            try:
                model(X).sum().backward()
            except FloatingPointError:
                assert failing and t == FAIL_AT
                try:
                    opt.zero_grad()
                    raise AssertionError("zero_grad() after a backward that updated and sent l2 was taken")
                except RuntimeError as e:
                    assert "Call synchronize() (or step()) to finish that pass's round first" in str(e), e
                opt.synchronize()
                continue
            opt.step()
        Check.mode = None
        results.append(state(model))
        opt.remove_hooks()
    same(results[1], results[0], f"ATC: skipped batch (checkpointed: {checkpointed})")

# ATC: a backward pass made for an input gradient (an adversarial example) has taken its
# local steps already: zero_grad() refuses (plain torch would drop the gradients; ATC
# cannot), and so does the next backward pass, each naming what finishes the round.
model = Net()
opt = bf.DistributedAdaptThenCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
x = X.clone().requires_grad_(True)
model(x).sum().backward()
try:
    opt.zero_grad()
    raise AssertionError("zero_grad() after a backward pass without step() was taken")
except RuntimeError as e:
    assert "use torch.autograd.grad(loss, inputs)" in str(e), e
try:
    model(X).sum().backward()
    raise AssertionError("a second backward pass before step() was taken")
except RuntimeError as e:
    assert "received a second gradient before step()" in str(e) and "call step() or synchronize()" in str(e), e
opt.remove_hooks()
# a removed wrapper's zero_grad() communicates nothing (that round was dropped)
before = state(model)
opt.zero_grad()
same(state(model), before, "ATC: zero_grad() after remove_hooks()")
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

"""The step window counts the steps of every optimizer: a plain torch.optim optimizer
(no wrapper), a wrapper (whose own step() steps the wrapped optimizer: counted once),
an optimizer that steps another in its step() (Lookahead-like: once), with or without
a wrapper around it. Without any optimizer the window never opens, and shutdown says
so. Another global step hook registered after init() sees every step (ending the
window inside torch's hooks made torch raise "OrderedDict mutated during iteration").

An optimizer whose step() raised (caught) before the loop does not stop the counting
(torch runs no post-hook for it: it stayed on the stack of steps in progress, and
every later step looked nested in it). A Lookahead around a wrapper counts once too
(the wrapper counted its own step as well).

argv[1]: plain | wrapped | nested | nested_wrapped | around_wrapper | after_raise | none.
Steps k = 0, 1, ...: one neighbor_allreduce named step<k>, then the optimizer's step."""
import os
import sys
import warnings

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import bluefog_lite as bf
from bluefog_lite.timeline import _recorder

mode = sys.argv[1]
bf.init()
start = int(os.environ["BLUEFOG_TIMELINE_START_STEP"])
end = int(os.environ["BLUEFOG_TIMELINE_END_STEP"])
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)


class Nested(torch.optim.Optimizer):
    """Steps the optimizer it holds (as Lookahead does)."""

    def __init__(self, inner):
        super().__init__(inner.param_groups, inner.defaults)
        self.inner = inner

    def step(self, closure=None):
        self.inner.step()


class Raises(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        raise RuntimeError("a step that raises")


if mode.startswith("nested"):
    opt = Nested(opt)
if mode.endswith("wrapped") or mode == "around_wrapper":
    opt = bf.DistributedAdaptWithCombineOptimizer(opt, model)
if mode == "around_wrapper":
    opt = Nested(opt)
if mode == "after_raise":
    try:
        Raises(torch.nn.Linear(2, 2).parameters()).step()
    except RuntimeError:
        pass
seen = []
register_optimizer_step_post_hook(lambda o, args, kwargs: seen.append(o))
x = torch.ones(8)


def step_once():
    opt.step()


for k in range(end + 3):
    assert (_recorder.current is not None) == (start <= k <= end) or mode == "none", (k, mode)
    bf.neighbor_allreduce(x, name=f"step{k}")
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    if mode != "none":
        step_once()     # (deeper than the step that raised, at module level: still not its inside)
outer = [o for o in seen if o is opt]     # (the other hook saw every step)
assert len(outer) == (0 if mode == "none" else end + 3), (mode, len(outer))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    bf.shutdown()
for w in caught:
    print(f"WARNING {w.category.__name__}: {w.message}", flush=True)
print(f"AGENT OK {bf._runtime._state.rank}", flush=True)

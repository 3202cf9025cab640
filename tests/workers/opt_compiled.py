"""A model compiled with torch.compile (Dynamo, the "eager" backend: no C compiler
needed), before and after it is wrapped: every wrapper's parameters equal those of
the same loop on the uncompiled model, and nothing warns. Before, Dynamo traced the
wrappers' forward hooks into the compiled model and printed a UserWarning on every
agent (they reach a C function it cannot trace); now they run as plain Python
(hooks.keep_out_of_compiled_graphs). Run with BLUEFOG_TIMELINE set: the timeline's
FORWARD/BACKWARD hooks are installed too. ATC and gradient allreduce, which start no
communication in the forward pass, also compile with fullgraph=True (the timeline's
hooks turned off): ATC's pass-counting hook is left to Dynamo to trace."""
import warnings

import torch

import bluefog_lite as bf

bf.init()
rank = bf.rank()
X = torch.linspace(-1, 1, 24, dtype=torch.float64).reshape(8, 3) * (rank + 1)


def run(make_opt, compiled, steps=3):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4, dtype=torch.float64), torch.nn.Tanh(),
                                torch.nn.Linear(4, 1, dtype=torch.float64))
    if compiled == "before":
        model = torch.compile(model, backend="eager")
    opt = make_opt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), model)
    if compiled == "after":
        model = torch.compile(model, backend="eager")
    if compiled == "fullgraph":     # (no communication in forward: ATC's and gradient allreduce's)
        opt.turn_off_timeline()     # (the timeline's hooks read the clock: not in a graph)
        torch._dynamo.reset()       # (else the earlier runs' compiled code is reused, not fullgraph)
        model = torch.compile(model, backend="eager", fullgraph=True)
    for _ in range(steps):
        opt.zero_grad()
        model(X).square().mean().backward()
        opt.step()
    opt.remove_hooks()
    return {k.replace("_orig_mod.", ""): v.detach().clone() for k, v in model.state_dict().items()}


AWC, ATC = bf.DistributedAdaptWithCombineOptimizer, bf.DistributedAdaptThenCombineOptimizer
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for name, make_opt in [
            ("AWC", lambda o, m: AWC(o, m)),
            ("AWC allreduce", lambda o, m: AWC(o, m, bf.CommunicationType.allreduce)),
            ("ATC", lambda o, m: ATC(o, m)),
            ("gradient allreduce", lambda o, m: bf.DistributedGradientAllreduceOptimizer(o, m))]:
        want = run(make_opt, None)
        for when in ("before", "after") + (("fullgraph",) if name in ("ATC", "gradient allreduce") else ()):
            got = run(make_opt, when)
            assert got.keys() == want.keys(), (name, when, got.keys())
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14,
                                           msg=lambda m: f"{name}, compiled {when} wrapping: {k}: {m}")
assert not caught, [f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught]
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

"""A model run inside a torch.func transform between training steps (per-sample
gradients through functional_call, an input gradient for a saliency map or an
adversarial example): the transform's pass is not a training pass of the model, so
AWC and WinPut start nothing in it and do not count it toward
num_steps_per_communication. Reference: the same loop without the transform.
Before, AWC started the parameters' communication with the transform's tensors,
which have no data: step() raised on every agent (allreduce) or at random
(neighbor_allreduce). An operation given such a tensor raises a TypeError naming it."""
import torch

import bluefog_lite as bf

bf.init()
rank = bf.rank()
X = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3) * (rank + 1)


def make():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(3, 4, dtype=torch.float64), torch.nn.Tanh(),
                               torch.nn.Linear(4, 1, dtype=torch.float64))


def loss(model, x):
    return model(x).square().mean()


def run(make_opt, transform, steps=4):
    model = make()
    opt = make_opt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), model)
    for _ in range(steps):
        if transform:
            params = {k: v.detach() for k, v in model.named_parameters()}
            per_sample = torch.func.vmap(torch.func.grad(
                lambda p, x: loss(lambda inp: torch.func.functional_call(model, p, (inp,)), x[None])),
                in_dims=(None, 0))(params, X)
            assert per_sample["0.weight"].shape == (4, 4, 3)
            saliency = torch.func.grad(lambda x: loss(model, x))(X)
            assert saliency.shape == X.shape
        opt.zero_grad()
        loss(model, X).backward()
        if isinstance(opt, bf.DistributedWinPutOptimizer):
            for _, h in list(opt._handles.values()):
                bf.win_wait(h)
            opt._handles.clear()
            bf.barrier()
            opt.step()
            bf.barrier()
        else:
            opt.step()
    result = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if isinstance(opt, bf.DistributedWinPutOptimizer):
        opt.free_windows()
    opt.remove_hooks()
    return result


AWC, ATC = bf.DistributedAdaptWithCombineOptimizer, bf.DistributedAdaptThenCombineOptimizer
for name, make_opt in [
        ("AWC", lambda o, m: AWC(o, m)),
        ("AWC allreduce", lambda o, m: AWC(o, m, bf.CommunicationType.allreduce)),
        ("AWC k=2", lambda o, m: AWC(o, m, num_steps_per_communication=2)),
        ("ATC", lambda o, m: ATC(o, m)),
        ("gradient allreduce", lambda o, m: bf.DistributedGradientAllreduceOptimizer(o, m)),
        ("WinPut k=2", lambda o, m: bf.DistributedWinPutOptimizer(o, m, num_steps_per_communication=2))]:
    want, got = run(make_opt, False), run(make_opt, True)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14, msg=lambda m: f"{name}: {k}: {m}")

try:
    torch.func.grad(lambda x: bf.neighbor_allreduce(x, name="in.transform").sum())(X)
    raise AssertionError("an operation took a tensor of a torch.func transform")
except TypeError as e:
    assert "is a tensor inside a torch.func transform" in str(e), e
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

"""Two backward passes before one step(): AWC steps on the summed gradient, like
torch.optim; ATC, which has already applied and sent the first gradient, raises
instead of silently dropping the second."""
import torch

import bluefog_lite as bf

bf.init()
r = bf.rank()
torch.manual_seed(0)                      # the same model and data on every agent: W x = x
x1, x2 = torch.randn(8, 3), torch.randn(8, 3)


def two_passes(model, opt):
    opt.zero_grad()
    model(x1).pow(2).sum().backward()
    model(x2).pow(2).sum().backward()


torch.manual_seed(1)
model = torch.nn.Linear(3, 2)
ref = torch.nn.Linear(3, 2)
ref.load_state_dict(model.state_dict())
awc = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
plain = torch.optim.SGD(ref.parameters(), lr=0.1)
two_passes(model, awc)
awc.step()
two_passes(ref, plain)
plain.step()
for p, q in zip(model.parameters(), ref.parameters()):
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
awc.remove_hooks()

atc = bf.DistributedAdaptThenCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
try:
    two_passes(model, atc)
except RuntimeError as e:
    assert "second gradient before step()" in str(e), e
else:
    raise AssertionError("ATC accepted a second backward pass before step()")
atc.synchronize()                         # the first pass's exchanges are in flight
bf.shutdown()
print(f"AGENT OK {r}", flush=True)

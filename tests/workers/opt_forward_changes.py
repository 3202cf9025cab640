"""Parameters that the forward pass changes or skips, with the wrappers that start
communication after a module's forward (AWC, WinPut); lr 0, so every step only mixes
(reference: the mixing matrix applied to each agent's values, computed here).

- nn.Embedding(max_norm=...) renormalizes the rows it looks up, in place. Called twice
  in one pass, its weight's communication, started after the first call, was changed
  by the second while in flight: the result mixed both (different rows on different
  runs). Now it starts in step(): W times the weights as the pass left them.
- A module that changes its weight in place in its forward (other than the embedding)
  while the communication is in flight: AWC's step() raises naming the parameter
  instead of applying a torn average.
- nn.MultiheadAttention reads its out_proj's weight without calling out_proj: its puts
  started only in step(), right before WinPut combined, so the neighbors' values of the
  step had not come (always a step stale). Now they go after the model's forward."""
import torch

import bluefog_lite as bf
from _reference import uniform_mixing

bf.init()
rank, n = bf.rank(), bf.size()
M = torch.from_numpy(uniform_mixing(bf.load_topology()))
D = torch.float64
AWC = bf.DistributedAdaptWithCombineOptimizer


def embedding(r):
    torch.manual_seed(100 + r)
    emb = torch.nn.Embedding(10, 4, max_norm=1.0, dtype=D)
    with torch.no_grad():
        emb.weight.mul_(3.0)            # every row's norm is above 1: each lookup renormalizes
    return emb


def lookups(r):      # rows 0-4 in the first call, 5-9 in the second
    g = torch.Generator().manual_seed(r)
    return torch.randint(0, 5, (6,), generator=g), torch.randint(5, 10, (6,), generator=g)


def twice(emb, r):
    a, b = lookups(r)
    return emb(a).sum() + emb(b).sum()


after_forward = []
for r in range(n):
    e = embedding(r)
    twice(e, r)
    after_forward.append(e.weight.detach().clone())
for kind, mix in [(bf.CommunicationType.neighbor_allreduce, M), (bf.CommunicationType.allreduce,
                                                                  torch.full((n, n), 1.0 / n, dtype=D))]:
    emb = embedding(rank)
    opt = AWC(torch.optim.SGD(emb.parameters(), lr=0.0), emb, communication_type=kind)
    opt.zero_grad()
    twice(emb, rank).backward()
    opt.step()
    want = sum(mix[rank, j] * after_forward[j] for j in range(n))
    torch.testing.assert_close(emb.weight.detach(), want, rtol=0, atol=1e-12, msg=lambda m: f"{kind}: {m}")
    opt.remove_hooks()


class Clamped(torch.nn.Linear):
    """Keeps its weight in [-0.5, 0.5], in place, at every call (not a pattern to follow)."""

    def forward(self, x):
        with torch.no_grad():
            self.weight.clamp_(-0.5, 0.5)
        return super().forward(x)


class Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = Clamped(3, 3, dtype=D)

    def forward(self, x):
        return self.layer(self.layer(x))


model = Twice()
opt = AWC(torch.optim.SGD(model.parameters(), lr=0.0), model)
model(torch.ones(2, 3, dtype=D)).sum().backward()
try:
    opt.step()
    raise AssertionError("a weight changed while its communication was in flight was applied")
except RuntimeError as e:
    assert "parameter 'layer.weight' was changed in place while its communication was in flight" in str(e), e
opt.remove_hooks()


def attention(r):
    torch.manual_seed(100 + r)
    return torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=D)


x0 = [dict((k, p.detach().clone()) for k, p in attention(r).named_parameters()) for r in range(n)]
model = attention(rank)
opt = bf.DistributedWinPutOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model)
x = torch.randn(2, 3, 8, dtype=D, generator=torch.Generator().manual_seed(rank))
for s in range(1, 3):
    opt.zero_grad()
    model(x, x, x)[0].sum().backward()
    assert sorted(opt._handles) == ["in_proj_bias", "in_proj_weight", "out_proj.bias", "out_proj.weight"], \
        sorted(opt._handles)            # every put went in the forward pass
    for _, h in list(opt._handles.values()):
        bf.win_wait(h)
    opt._handles.clear()
    bf.barrier()                        # every agent's puts have landed
    opt.step()
    bf.barrier()
    Ms = torch.linalg.matrix_power(M, s)
    for k, p in model.named_parameters():
        want = sum(Ms[rank, j] * x0[j][k] for j in range(n))
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-12, msg=lambda m: f"step {s}, {k}: {m}")
opt.free_windows()
opt.remove_hooks()
bf.shutdown()
print(f"AGENT OK {rank}", flush=True)

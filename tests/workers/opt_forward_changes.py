"""Parameters that the forward pass changes or skips, with the wrappers that start
communication after a module's forward (AWC, WinPut); lr 0, so every step only mixes
(reference: the mixing matrix applied to each agent's values, computed here).

- nn.Embedding(max_norm=...) renormalizes the rows it looks up, in place. Called twice
  in one pass, its weight's communication, started after the first call, was changed
  by the second while in flight: the result mixed both (different rows on different
  runs). Now it starts in step(): W times the weights as the pass left them.
  Subclasses too; with allreduce, whose parameters start in one fixed order, that
  weight comes last, so the layers after it still start in the forward pass.
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


class Lookup(torch.nn.Embedding):
    """A subclass (recognized too)."""


def subclassed(r):
    e = embedding(r)
    sub = Lookup(10, 4, max_norm=1.0, dtype=D)
    with torch.no_grad():
        sub.weight.copy_(e.weight)
    return sub


emb = subclassed(rank)
opt = AWC(torch.optim.SGD(emb.parameters(), lr=0.0), emb)
twice(emb, rank).backward()
opt.step()
torch.testing.assert_close(emb.weight.detach(), sum(M[rank, j] * after_forward[j] for j in range(n)), rtol=0,
                           atol=1e-12)
opt.remove_hooks()

# allreduce starts parameters in one fixed order: the embedding's weight, which starts in
# step(), comes last, so the layers after it still start in the forward pass
torch.manual_seed(7)
net = torch.nn.Sequential(embedding(rank), torch.nn.Linear(4, 3, dtype=D), torch.nn.ReLU(),
                          torch.nn.Linear(3, 1, dtype=D))
opt = AWC(torch.optim.SGD(net.parameters(), lr=0.0), net, communication_type=bf.CommunicationType.allreduce)
net(lookups(rank)[0]).sum().backward()
assert sorted(opt._handles) == ["1.bias", "1.weight", "3.bias", "3.weight"], sorted(opt._handles)
opt.step()
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

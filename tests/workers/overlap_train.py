"""Train a 5-layer MLP with the AWC and then the ATC optimizer while the
timeline records (BLUEFOG_TIMELINE set by the test); test_overlap.py reads the
files. Layer names carry the wrapper's tag (awc0 ... awc4, atc0 ... atc4) so
that each run has its own rows; each step is a STEP span on the row
"<tag>.step". argv: steps per wrapper, width, batch."""
import collections
import sys

import torch

import bluefog_lite as bf

STEPS, WIDTH, BATCH = (int(a) for a in sys.argv[1:4])
LAYERS = 5

bf.init()
r = bf.rank()
torch.manual_seed(r)


def mlp(tag):
    layers = collections.OrderedDict()
    for i in range(LAYERS):
        layers[f"{tag}{i}"] = torch.nn.Linear(WIDTH, WIDTH if i < LAYERS - 1 else 10)
        if i < LAYERS - 1:
            layers[f"{tag}relu{i}"] = torch.nn.ReLU()
    return torch.nn.Sequential(layers)


x = torch.randn(BATCH, WIDTH)
target = torch.randint(10, (BATCH,))
for tag, wrapper in (("awc", bf.DistributedAdaptWithCombineOptimizer),
                     ("atc", bf.DistributedAdaptThenCombineOptimizer)):
    net = mlp(tag)
    bf.broadcast_parameters(net.state_dict(), root_rank=0)
    opt = wrapper(torch.optim.SGD(net.parameters(), lr=0.01), net)
    for step in range(STEPS):
        with bf.timeline_context(f"{tag}.step", "STEP"):      # the test's step boundaries
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), target).backward()
            opt.step()
    opt.remove_hooks()
    bf.barrier()
bf.shutdown()
print(f"AGENT OK {r}", flush=True)

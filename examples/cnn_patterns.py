"""A small convolutional network trained decentralized on generated images.

    bfrun -np 4 python examples/cnn_patterns.py [--optimizer winput awc atc] [--short] [--epochs N]
        [--device cuda]

The data are generated, never downloaded: ten classes, each a fixed 16x16
pattern of 4x4-pixel blocks; a sample is its class's pattern shifted by up to
2 pixels either way (circularly) plus Gaussian noise. The shifts make a
convolutional network the right tool. Every agent generates its own training
set, skewed towards its own classes (half of its samples come from the
classes c with c % size == rank, the rest from all ten), so an agent alone
would see a biased picture; every agent evaluates its own model on a common
test set.

Optimizers, given to --optimizer (default: all three, trained one after the
other from the same initial model; each wraps torch.optim.SGD with momentum,
on the Exp-2 graph):

- ``winput``: DistributedWinPutOptimizer, asynchronous: after each module's
  forward its parameters are put into the neighbors' windows; step()
  averages whatever has arrived, then takes the local step.
- ``awc``: DistributedAdaptWithCombineOptimizer with neighbor_allreduce:
  parameters are sent right after forward, the averaging overlaps backward.
- ``atc``: DistributedAdaptThenCombineOptimizer: each parameter takes its
  local step the moment its gradient is ready and is sent at once, so the
  last layer's exchange overlaps the backward pass of the earlier ones.

With ``--device cuda`` each agent trains on a GPU (its local rank modulo the GPUs
of its machine); the library copies what it communicates through host memory.

Rank 0 prints the agents' mean training loss and test accuracy after each
epoch and, last, per optimizer the mean test accuracy of the agents' models
and the worst one. With a timeline every parameter has its own row, named
after the optimizer (``atc.0.weight``, ``atc.0.bias``, ...): FORWARD and
BACKWARD on the main thread next to the parameter's communication.
"""
import argparse
import collections

import numpy as np
import torch
import torch.nn.functional as F

import bluefog_lite as bf
import topology as topo
from _cli import positive_float
from _timeline_note import shutdown_and_note

SIDE, CLASSES, MAX_SHIFT, NOISE = 16, 10, 2, 1.0


def class_patterns(seed=5):
    """The ten 16x16 class patterns: blocks of 4x4 pixels with random levels,
    each pattern normalized to mean 0 and variance 1."""
    coarse = np.random.default_rng(seed).normal(size=(CLASSES, SIDE // 4, SIDE // 4))
    patterns = np.kron(coarse, np.ones((4, 4)))
    patterns -= patterns.mean(axis=(1, 2), keepdims=True)
    return patterns / patterns.std(axis=(1, 2), keepdims=True)


def make_images(labels, rng, patterns=None, noise=NOISE):
    """Images (float32, N x 16 x 16) of the given labels: shifted pattern + noise."""
    patterns = class_patterns() if patterns is None else patterns
    shifts = rng.integers(-MAX_SHIFT, MAX_SHIFT + 1, size=(len(labels), 2))
    images = np.stack([np.roll(patterns[c], tuple(s), axis=(0, 1)) for c, s in zip(labels, shifts)])
    return (images + noise * rng.normal(size=images.shape)).astype(np.float32)


def training_set(rank, size, samples, seed=11):
    """Agent ``rank``'s (images, labels): half from its own classes, half from all."""
    rng = np.random.default_rng([seed, rank])
    own = [c for c in range(CLASSES) if c % size == rank] or list(range(CLASSES))
    labels = np.concatenate([rng.choice(own, size=samples // 2),
                             rng.integers(CLASSES, size=samples - samples // 2)])
    return make_images(labels, rng), labels


def test_set(samples=1000, seed=99):
    """The common test set (uniform over the classes)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(CLASSES, size=samples)
    return make_images(labels, rng), labels


def make_model():
    """Two 3x3 convolutions (8 and 16 channels, each with ReLU and 2x2 max-pooling)
    and a linear layer: 3818 parameters."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(16 * (SIDE // 4) ** 2, CLASSES))


def wrap(name, optimizer, model):
    if name == "winput":
        return bf.DistributedWinPutOptimizer(optimizer, model)
    wrapper = (bf.DistributedAdaptWithCombineOptimizer if name == "awc"
               else bf.DistributedAdaptThenCombineOptimizer)
    return wrapper(optimizer, model, bf.CommunicationType.neighbor_allreduce)


def accuracy(model, images, labels):
    model.eval()
    with torch.no_grad(), bf.timeline_context("evaluate", "TEST_ACCURACY"):
        acc = (model(images).argmax(1) == labels).double().mean()
    model.train()
    return acc


def train(name, args, train_data, test_data):
    """Train a fresh model (the same start for every optimizer) with optimizer
    ``name``; returns this agent's final test accuracy. The model's layers are
    named after the optimizer (``atc.0.weight``, ...): each run gets its own
    timeline rows."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(collections.OrderedDict([(name, make_model())])).to(train_data[0].device)
    bf.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = wrap(name, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), model)
    (images, labels), order = train_data, torch.Generator().manual_seed(bf.rank())
    for epoch in range(1, args.epochs + 1):
        total = 0.0
        for batch in torch.randperm(len(labels), generator=order).split(args.batch):
            opt.zero_grad()
            loss = F.cross_entropy(model(images[batch]), labels[batch])
            loss.backward()
            opt.step()
            total += loss.item() * len(batch)
        stats = bf.allreduce(torch.tensor([total / len(labels), float(accuracy(model, *test_data))]),
                             name="epoch_stats")
        if bf.rank() == 0:
            print(f"{name} epoch {epoch:2d}: training loss {stats[0]:.4f}, "
                  f"test accuracy {100 * stats[1]:.1f} %", flush=True)
    if name == "winput":
        opt.free_windows()
    opt.remove_hooks()
    return accuracy(model, *test_data)


def main():
    ap = argparse.ArgumentParser(description="decentralized CNN training on generated patterns")
    ap.add_argument("--optimizer", nargs="+", choices=["winput", "awc", "atc"], default=["winput", "awc", "atc"],
                    help="one or more, trained one after the other (default: all three)")
    ap.add_argument("--epochs", type=int, default=None, help="epochs (default 10; 5 with --short)")
    ap.add_argument("--short", action="store_true", help="quick run for the tests")
    ap.add_argument("--samples", type=int, default=640, help="training images per agent")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=positive_float, default=0.05)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the agents train")
    args = ap.parse_args()
    if args.epochs is None:
        args.epochs = 5 if args.short else 10
    if min(args.epochs, args.samples, args.batch) < 1:
        ap.error(f"--epochs, --samples and --batch must be at least 1, got {args.epochs}, {args.samples}, "
                 f"{args.batch}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA GPU here")

    bf.init(topology_fn=topo.ExponentialTwoGraph)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", bf.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    images, labels = (torch.from_numpy(a).to(device) for a in training_set(bf.rank(), bf.size(), args.samples))
    test_images, test_labels = (torch.from_numpy(a).to(device) for a in test_set())
    results = []
    for name in args.optimizer:
        acc = train(name, args, (images.unsqueeze(1), labels), (test_images.unsqueeze(1), test_labels))
        accs = bf.allgather(acc.reshape(1), name="final_accuracy")
        results.append(f"{name} {100 * accs.mean():.1f} % (worst agent {100 * accs.min():.1f} %)")
    if bf.rank() == 0:
        print("final test accuracy: " + ", ".join(results), flush=True)
    shutdown_and_note()


if __name__ == "__main__":
    main()

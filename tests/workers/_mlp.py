"""The small MLP and per-agent batches that optimizer workers train (imported from their own folder)."""
import torch


def data(r, s):
    """Agent r's batch of step s."""
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(r * 1000 + s))


def make():
    """The MLP, with the same initial weights every time."""
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))

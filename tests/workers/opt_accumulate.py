"""Two backward passes before one step(): AWC steps on the summed gradient, like
torch.optim; ATC, which has already applied and sent the first gradient, raises
instead of silently dropping the second; gradient allreduce accumulates with
num_steps_per_communication=2 and raises with 1; after such an error, remove_hooks() frees
the parameters' names for a new wrapper. Optimizer parameters outside the model are
stepped locally by every wrapper."""
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


def accumulates_like_sgd(make):
    """Two passes, then step(): the same as plain SGD on the summed gradient."""
    torch.manual_seed(1)
    model, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    wrapped = make(torch.optim.SGD(model.parameters(), lr=0.1), model)
    plain = torch.optim.SGD(ref.parameters(), lr=0.1)
    for m, o in ((model, wrapped), (ref, plain)):
        two_passes(m, o)
        o.step()
    for p, q in zip(model.parameters(), ref.parameters()):    # same data everywhere: the average is it
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    wrapped.remove_hooks()


def refuses_a_second_pass(make, words):
    model = torch.nn.Linear(3, 2)
    wrapped = make(torch.optim.SGD(model.parameters(), lr=0.1), model)
    try:
        two_passes(model, wrapped)
    except RuntimeError as e:
        assert words in str(e), e
    else:
        raise AssertionError(f"{make.__name__} accepted a second backward pass before step()")
    wrapped.synchronize()                 # the first pass's communication is in flight
    wrapped.remove_hooks()
    # the same without synchronize(): remove_hooks() finishes the communication in flight,
    # so that a new wrapper on the model can use the parameters' names
    wrapped = make(torch.optim.SGD(model.parameters(), lr=0.1), model)
    try:
        two_passes(model, wrapped)
    except RuntimeError:
        pass
    wrapped.remove_hooks()
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    again = make(torch.optim.SGD(model.parameters(), lr=0.1), model)
    plain = torch.optim.SGD(ref.parameters(), lr=0.1)
    for m, o in ((model, again), (ref, plain)):
        o.zero_grad()
        m(x1).pow(2).sum().backward()
        o.step()
    for p, q in zip(model.parameters(), ref.parameters()):    # same data everywhere: W x = x
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    again.remove_hooks()


accumulates_like_sgd(bf.DistributedAdaptWithCombineOptimizer)
refuses_a_second_pass(bf.DistributedAdaptThenCombineOptimizer, "second gradient before step()")
# Gradient allreduce: k passes accumulate (num_steps_per_communication=k); a pass more
# before step() raises (it added to a gradient whose average is in flight, and the
# average would have overwritten it).
accumulates_like_sgd(lambda opt, model: bf.DistributedGradientAllreduceOptimizer(
    opt, model, num_steps_per_communication=2))
refuses_a_second_pass(bf.DistributedGradientAllreduceOptimizer,
                      "received gradient 2 before step(), with num_steps_per_communication=1")

# An optimizer parameter that is not in the model (a learnable scale): every wrapper
# steps it locally, as the wrapped optimizer alone would.
for make in (bf.DistributedAdaptThenCombineOptimizer, bf.DistributedAdaptWithCombineOptimizer,
             bf.DistributedGradientAllreduceOptimizer):
    torch.manual_seed(2)
    model, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    scale, ref_scale = torch.ones(1, requires_grad=True), torch.ones(1, requires_grad=True)
    wrapped = make(torch.optim.SGD([{"params": model.parameters()}, {"params": [scale], "lr": 0.3}],
                                   lr=0.1, momentum=0.5), model)
    plain = torch.optim.SGD([{"params": ref.parameters()}, {"params": [ref_scale], "lr": 0.3}],
                            lr=0.1, momentum=0.5)
    for _ in range(3):
        for m, s, o in ((model, scale, wrapped), (ref, ref_scale, plain)):
            o.zero_grad()
            (s * m(x1)).pow(2).sum().backward()
            o.step()
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=1e-6, msg=lambda m: f"{make.__name__}: {m}")
    assert not torch.equal(scale, torch.ones(1)), make.__name__
    for p, q in zip(model.parameters(), ref.parameters()):     # same data everywhere: W x = x
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    wrapped.remove_hooks()

# A layer used in two reentrant checkpoints gets a gradient per checkpoint within one
# backward(): the refusal says so (the message otherwise asks for a step() per pass)
for make in (bf.DistributedAdaptThenCombineOptimizer, bf.DistributedGradientAllreduceOptimizer):
    shared = torch.nn.Linear(3, 3)
    wrapped = make(torch.optim.SGD(shared.parameters(), lr=0.1), shared)
    checkpoint = torch.utils.checkpoint.checkpoint
    h = checkpoint(shared, x1.requires_grad_(), use_reentrant=True)
    try:
        checkpoint(shared, h, use_reentrant=True).sum().backward()
    except RuntimeError as e:
        assert "use_reentrant=False" in str(e), e
    else:
        raise AssertionError(f"{make.__name__}: two reentrant checkpoints of one layer went unnoticed")
    wrapped.remove_hooks()
    x1 = x1.detach()
bf.shutdown()
print(f"AGENT OK {r}", flush=True)

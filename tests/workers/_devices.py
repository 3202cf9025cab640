"""The device tensors of the device tests: real CUDA tensors (BF_TEST_DEVICE=cuda, on
a machine with a GPU) or, by default, a stand-in that reports device cuda:0 while its
memory is the host's (test machines have no GPU; bluefog_lite treats it as a device
tensor: copied to the host at the call, the result copied back at synchronize).
BF_TEST_SLOW_COPY=1 (stand-in only): the copies to the host of nonblocking calls
land only some milliseconds after the call, as a GPU's do when it is busy."""
import os
import threading
import time

import torch

import bluefog_lite._devices


class FakeCudaTensor(torch.Tensor):
    """What a CUDA tensor looks like to bluefog_lite. Like a CUDA tensor's memory, it
    must not be touched by the communication thread (which cannot know the caller's
    stream): any torch call on it from a thread but the main one raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(f"a device tensor was used on thread {threading.current_thread().name!r} "
                               f"({getattr(func, '__name__', func)})")
        return super().__torch_function__(func, types, args, kwargs)

    @property
    def device(self):
        return torch.device("cuda", 0)

    @property
    def is_cuda(self):
        return True

    @property
    def is_cpu(self):
        return False


REAL = os.environ.get("BF_TEST_DEVICE", "fake") == "cuda"
if REAL:
    assert torch.cuda.is_available(), "BF_TEST_DEVICE=cuda on a machine without CUDA"


class SlowCopy:
    """A copy to the host that lands delay_s (20 ms) after the call (a GPU still busy with the work
    queued before): until then the host buffer holds other values (NaN, or 77 for
    integers), which an operation that read it before query() is true would use."""
    made = 0
    delay_s = 0.02

    def __init__(self, host, t):
        SlowCopy.made += 1
        self.host, self.values = host, t.as_subclass(torch.Tensor).clone()   # the device's values at the call
        host.fill_(float("nan") if host.is_floating_point() or host.is_complex() else 77)
        self.due = time.monotonic() + self.delay_s
        self.lock, self.done = threading.Lock(), False

    def query(self):
        if time.monotonic() < self.due:
            return False
        with self.lock:
            if not self.done:
                self.host.copy_(self.values)
                self.done = True
        return True

    def synchronize(self):
        time.sleep(max(0.0, self.due - time.monotonic()))
        self.query()


SLOW = os.environ.get("BF_TEST_SLOW_COPY") == "1"
if SLOW:
    assert not REAL, "BF_TEST_SLOW_COPY is for the stand-in device"
    bluefog_lite._devices._copy_later = SlowCopy


def to_device(t):
    """A copy of host tensor t on the device (the stand-in keeps t's layout)."""
    return t.to("cuda") if REAL else FakeCudaTensor(t.clone())


def on_device(t):
    """True when t is a device tensor (the stand-in's are its own class)."""
    return t.is_cuda and (REAL or isinstance(t, FakeCudaTensor))


def to_host(t):
    """A host copy of t's values (for numpy)."""
    t = t.detach()
    return (t.cpu() if REAL else t.as_subclass(torch.Tensor)).clone()


def model_to_device(model):
    """model with its parameters on the device, in place."""
    if REAL:
        return model.to("cuda")
    for module in model.modules():
        for n, p in list(module.named_parameters(recurse=False)):
            setattr(module, n, torch.nn.Parameter(FakeCudaTensor(p.detach().clone())))
    return model

"""Operations on tensors of an accelerator: copied to the host at the call, the result
copied back to the device at synchronize (bluefog_lite/_devices.py). Workers:
tests/workers/ops_devices.py (and _devices.py, which makes the device tensors)."""
import re

import pytest
import torch

from mpi_helpers import run_agents


def test_device_tensors_through_a_stand_in_device():
    """A tensor that reports device cuda:0 (no GPU here) goes every way a CUDA tensor
    goes: ops, in-place forms, parameter helpers, optimizer wrappers."""
    _, out = run_agents(4, "ops_devices.py", timeout=150)
    assert out.count("DEVICE stand-in") == 4


def test_operations_wait_for_copies_that_land_later():
    """A nonblocking call returns once the copy of its device tensor to the host is
    queued; the operation (alone or fused) starts when the copy is done. Here the
    stand-in's copies land 20 ms late and the host buffer holds NaN until then: every
    result must still match the reference."""
    _, out = run_agents(4, "ops_devices.py", timeout=150, env={"BF_TEST_SLOW_COPY": "1"})
    assert out.count("DEVICE stand-in") == 4
    made = [int(n) for n in re.findall(r"SLOW COPIES (\d+)", out)]
    assert len(made) == 4 and min(made) > 20, made


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the stand-in test runs everywhere)")
def test_cuda_tensors():
    _, out = run_agents(4, "ops_devices.py", timeout=300, env={"BF_TEST_DEVICE": "cuda"})
    assert out.count("DEVICE cuda") == 4
